"""`rollway bench learn CONFIG`: held-out pass rate before training, a training run, the same
evaluation after, and whether the rise is larger than the noise for the sample size."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from rollway.base.figures import dumps
from rollway.base.process import Child
from rollway.base.run_dir import RunDir, fresh_run_folder
from rollway.bench.bench_dir import BenchDir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="training config, e.g. examples/learn.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every phase")
    parser.add_argument("--run-dir", default=None, help="folder for the three runs (default runs/learn-bench-<time>)")
    parser.add_argument("--eval-tasks", type=int, default=50, help="held-out tasks evaluated before and after")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _rollway(*args: str, stop_grace_s: float = 60.0) -> None:
    cmd = [sys.executable, "-m", "rollway.runners", *args]
    print(f"rollway bench learn: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    # Not its own process group: a terminal's Ctrl-C reaches the phase as it reaches this process.
    child = Child(cmd, name="rollway " + args[0], own_group=False).start()
    try:
        code = child.wait()
    except BaseException:
        # Stopped (SIGTERM, Ctrl-C): SIGTERM lets the phase stop its stage workers and engine itself
        # (subprocess.run would SIGKILL it, leaving everything it started running).
        child.stop(grace_s=stop_grace_s)
        raise
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)


def paired_difference(before: dict, after: dict) -> dict:
    """Per-task pass rates on the same held-out tasks: mean rise, its standard error (paired over
    tasks, which also covers the correlation of attempts within a task) and z = rise / SE."""
    tasks = sorted(set(before["per_task"]) & set(after["per_task"]))
    diffs = [after["per_task"][t]["pass@1"] - before["per_task"][t]["pass@1"] for t in tasks]
    n = len(diffs)
    mean = sum(diffs) / n if n else 0.0
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(var / n) if n else 0.0
    return {"tasks": n, "rise": round(mean, 4), "se": round(se, 4), "z": round(mean / se, 2) if se else None}


def run(args: argparse.Namespace) -> int:
    root = Path(args.run_dir or fresh_run_folder("learn-bench"))
    held_out = ["tasks.split=test", f"tasks.limit={args.eval_tasks}"]
    t0 = time.monotonic()
    _rollway("eval", args.config, *args.overrides, *held_out, "--run-dir", str(RunDir(root).sub("before").path))
    t1 = time.monotonic()
    _rollway("up", args.config, *args.overrides, "--run-dir", str(RunDir(root).sub("train").path))
    t2 = time.monotonic()
    checkpoints = sorted(RunDir(root).sub("train").checkpoints.glob("step_*"))
    if not checkpoints:
        print("rollway bench learn: the training run wrote no checkpoint (no update had signal)", file=sys.stderr)
        return 1
    _rollway("eval", args.config, *args.overrides, *held_out, f"policy.model={checkpoints[-1]}",
             "--run-dir", str(RunDir(root).sub("after").path))
    t3 = time.monotonic()
    before = json.loads(RunDir(root).sub("before").eval_result.read_text())
    after = json.loads(RunDir(root).sub("after").eval_result.read_text())
    train = json.loads(RunDir(root).sub("train").summary.read_text())
    result = {
        "before": {k: before[k] for k in ("tasks", "attempts", "pass@1", "pass@4") if k in before},
        "after": {k: after[k] for k in ("tasks", "attempts", "pass@1", "pass@4") if k in after},
        "paired": paired_difference(before, after),
        "train": {"episodes": train["episodes_completed"], "reward_mean": train["reward_mean"],
                  "checkpoint": str(checkpoints[-1]), "wall_seconds": round(t2 - t1)},
        "wall_seconds": {"eval_before": round(t1 - t0), "train": round(t2 - t1), "eval_after": round(t3 - t2)},
        "run_dir": str(root),
    }
    result["rose_beyond_noise"] = bool(result["paired"]["z"] and result["paired"]["z"] > 2)
    BenchDir(root).learn_bench_result.write_text(dumps(result, indent=1))
    print(dumps(result) if args.json else dumps(result, indent=1))
    return 0
