"""`rollway bench up [CONFIG]`: what `rollway up` adds to a job's own work, one process against a process
per stage, side by side. Each run's added time is the command's wall time minus its handling span (first
message handled to last, from the run's telemetry): interpreter and imports, the broker, the stages'
start and group joins, stopping, the summary and the report."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rollway.base.figures import dumps, put, ratio
from rollway.base.process import Child
from rollway.base.run_dir import fresh_run_folder

MODES = ("one", "per-stage")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="examples/smoke.yaml", help="job to run (default the smoke job)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every run")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode, alternating (default 3)")
    parser.add_argument("--run-dir", default=None, help="folder for the runs (default runs/bench-up-<time>)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def handling_span(run_dir: Path) -> float:
    """Seconds from the first message a handler started on to the last one it finished."""
    from rollway.runtime.telemetry import handled, read_telemetry

    records = handled(read_telemetry(run_dir))
    if not records:
        raise RuntimeError(f"{run_dir}: no handled message in its telemetry")
    return max(r.ended_at for r in records) - min(r.started_at for r in records)


def one_run(config: str, overrides: list[str], mode: str, run_dir: Path) -> dict:
    argv = [sys.executable, "-m", "rollway.runners", "up", config, *overrides, f"runtime.processes={mode}",
            "--run-dir", str(run_dir)]
    t0 = time.monotonic()
    code = Child(argv, run_dir.parent / f"{run_dir.name}.out", name=f"rollway up ({mode})").start().wait()
    wall = time.monotonic() - t0
    if code != 0:
        raise subprocess.CalledProcessError(code, argv)
    span = handling_span(run_dir)
    return {"mode": mode, "wall_s": round(wall, 3), "span_s": round(span, 3), "added_s": round(wall - span, 3)}


def run(args: argparse.Namespace) -> int:
    if args.runs < 1:
        print("rollway bench up: --runs must be at least 1", file=sys.stderr)
        return 2
    root = Path(args.run_dir) if args.run_dir else fresh_run_folder("bench-up")
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(args.runs):
        for mode in MODES:  # alternating: load that drifts during the bench reaches both modes alike
            runs.append(one_run(args.config, list(args.overrides), mode, root / f"{mode}-{i}"))
            print(f"rollway bench up: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    result: dict = {"config": args.config, "runs": runs}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        result[mode] = {k: round(statistics.median(r[k] for r in mine), 3) for k in ("wall_s", "span_s", "added_s")}
    put(result, "added_ratio_per_stage_to_one", ratio(result["per-stage"]["added_s"], result["one"]["added_s"]),
        "one process added no time to the job (median added_s 0): no ratio to take")
    (root / "bench-up.json").write_text(dumps(result, indent=1))
    print(dumps(result) if args.json else dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return 0
