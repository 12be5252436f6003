"""`rollway bench search CONFIG --family DIR`: does the AST search tool make an agent localise bugs better,
and learn it faster? Two arms on the bug-localisation family (`rollway tasks build buglocal`), `bash + search
+ locate` against `bash + locate`, same config otherwise: held-out pass@1/pass@8 before training, a training
run per arm (`rollway up`, same episodes), the same evaluation after; paired over held-out tasks."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from rollway.base.figures import dumps
from rollway.base.run_dir import RunDir, fresh_run_folder
from rollway.bench.learn import _rollway

ARMS = {"search": ["bash", "search", "locate"], "bash": ["bash", "locate"]}
"""Each arm's tools; the worked example navigates with the arm's own tool (search, or grep through bash)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="training config, e.g. examples/buglocal.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every phase of both arms")
    parser.add_argument("--family", required=True, help="folder written by `rollway tasks build buglocal` "
                        "(train.jsonl for training, heldout.jsonl for evaluation)")
    parser.add_argument("--run-dir", default=None, help="folder for every run (default runs/search-bench-<time>)")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of every phase (sampling, task order)")
    parser.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks evaluated (default all)")
    parser.add_argument("--attempts", type=int, default=8, help="attempts per held-out task (pass@1 and pass@K)")
    parser.add_argument("--before-only", action="store_true", help="measure both arms before training and stop")
    parser.add_argument("--train-filter", type=int, default=0, metavar="N",
                        help="first play each training task N times with the arm's base policy and train only on "
                             "the tasks it solved at least once (a task nobody solves gives no signal); the "
                             "config's training groups are then taken from those tasks in turn (default 0: no filter)")
    parser.add_argument("--arms", default="search,bash", help="arms to run, comma-separated (default both)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def arm_overrides(arm: str) -> list[str]:
    return [f"tools.enabled={json.dumps(ARMS[arm])}", f"tasks.worked_example={arm}"]


def set_aside_unfinished(folder: RunDir) -> None:
    """A phase cut short (the machine or the session stopped) left its folder without a result: renamed to
    PHASE.interrupted-N, kept for a look, so the phase runs again from the start in a clean folder."""
    if not folder.path.exists():
        return
    n = 1
    while (aside := folder.path.with_name(f"{folder.path.name}.interrupted-{n}")).exists():
        n += 1
    folder.path.rename(aside)
    print(f"rollway bench search: {folder.path} was not finished; moved to {aside.name}, running it again",
          file=sys.stderr)


def _eval(args: argparse.Namespace, root: RunDir, arm: str, phase: str, model: str | None = None,
          tasks: Path | None = None, attempts: int | None = None) -> dict:
    folder = root.sub(arm).sub(phase)
    attempts = attempts or args.attempts
    if not folder.eval_result.is_file():  # a re-run resumes: finished phases are kept
        set_aside_unfinished(folder)
        held_out = [f"tasks.path={tasks or Path(args.family) / 'heldout.jsonl'}", f"eval.attempts={attempts}",
                    f"eval.ks=[1,{attempts}]", "tasks.split=all"]
        held_out += [f"tasks.limit={args.eval_tasks}"] if args.eval_tasks and tasks is None else []
        held_out += [f"policy.model={model}"] if model else []
        _rollway("eval", args.config, *args.overrides, *arm_overrides(arm), f"run.seed={args.seed}", *held_out,
                 "--run-dir", str(folder.path))
    return json.loads(folder.eval_result.read_text())


def training_tasks(args: argparse.Namespace, root: RunDir, arm: str) -> tuple[Path, list[str]] | None:
    """The training file of `arm`: the family's, or with --train-filter the rows its base policy solved at
    least once in N attempts (written to ARM/train-tasks.jsonl); None when it solved none."""
    train = Path(args.family) / "train.jsonl"
    if not args.train_filter:
        return train, []
    result = _eval(args, root, arm, "filter", tasks=train, attempts=args.train_filter)
    kept = sorted(task for task, row in result["per_task"].items() if row["correct"] > 0)
    if not kept:
        return None
    out = root.sub(arm).path / "train-tasks.jsonl"
    rows = [line for line in train.read_text().splitlines() if line.strip() and json.loads(line)["instance_id"] in kept]
    out.write_text("".join(line + "\n" for line in rows))
    return out, kept


def _train(args: argparse.Namespace, root: RunDir, arm: str) -> str | None:
    folder = root.sub(arm).sub("train")
    if not folder.summary.is_file():
        set_aside_unfinished(folder)
        picked = training_tasks(args, root, arm)
        if picked is None:
            print(f"rollway bench search: the {arm} arm's base policy solved no training task in "
                  f"{args.train_filter} attempts each; nothing to train on", file=sys.stderr)
            return None
        path, kept = picked
        cycle = []
        if kept:  # the config's groups, taken from the kept tasks in turn
            from rollway.config.run import load_config

            groups = load_config(args.config, list(args.overrides)).scheduler.num_tasks or len(kept)
            cycle = [f"scheduler.num_tasks={len(kept)}", f"scheduler.epochs={-(-groups // len(kept))}"]
        _rollway("up", args.config, *args.overrides, *arm_overrides(arm), f"run.seed={args.seed}",
                 f"tasks.path={path}", *cycle, "--run-dir", str(folder.path))
    from rollway.learning.checkpoint import latest_checkpoint, load_state

    checkpoint = latest_checkpoint(folder.path)
    if checkpoint is None or load_state(checkpoint).step == 0:  # the base weights, saved for the engine
        print(f"rollway bench search: the {arm} arm's training ran no update (no group had a reward signal); "
              f"its after-training figures are its before-training ones", file=sys.stderr)
        return None
    return str(checkpoint)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def file_accuracy(folder: RunDir) -> float | None:
    """Share of finished attempts that named the right file (the second figure; reward needs the function)."""
    trajs = read_jsonl(folder.trajectories)
    return round(sum(bool(t["grade"].get("file_correct")) for t in trajs) / len(trajs), 4) if trajs else None


KNOWN_TOOLS = {"bash", "search", "locate"}


def tool_calls(traj: dict[str, Any]) -> Counter:
    """Calls per tool; `invalid` counts the rest (no parseable call, a tool the arm does not have)."""
    return Counter(obs["tool"] if obs["tool"] in KNOWN_TOOLS else "invalid"
                   for turn in traj["turns"] for obs in turn["observations"])


def tool_calls_per_episode(trajs: list[dict[str, Any]]) -> dict[str, float]:
    totals: Counter = Counter()
    for t in trajs:
        totals.update(tool_calls(t))
    return {tool: round(n / len(trajs), 3) for tool, n in sorted(totals.items())} if trajs else {}


def training_curves(folder: RunDir) -> dict[str, Any]:
    """Reward per update (the learner's metrics) and tool calls per episode by the policy version that
    played the episode's first turn (the number of updates it had seen)."""
    steps = [{"step": m["step"], "reward_mean": round(m["reward_mean"], 4)}
             for m in read_jsonl(folder.metrics) if "reward_mean" in m]
    by_version: dict[int, list[dict]] = defaultdict(list)
    for t in read_jsonl(folder.trajectories):
        if t["turns"]:
            by_version[t["turns"][0]["policy_version"]].append(t)
    tools = [{"policy_version": v, "episodes": len(ts), **tool_calls_per_episode(ts)}
             for v, ts in sorted(by_version.items())]
    return {"updates": len(steps), "reward_per_update": steps, "tool_calls_by_version": tools}


def paired(a: dict, b: dict, key: str) -> dict:
    """b - a per held-out task (same tasks, both evaluations): mean, its standard error over tasks, z."""
    tasks = sorted(set(a["per_task"]) & set(b["per_task"]))
    diffs = [b["per_task"][t][key] - a["per_task"][t][key] for t in tasks]
    n = len(diffs)
    mean = sum(diffs) / n if n else 0.0
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else 0.0
    return {"tasks": n, "diff": round(mean, 4), "se": round(se, 4), "z": round(mean / se, 2) if se else None}


def gain_difference(before: dict[str, dict], after: dict[str, dict], key: str) -> dict:
    """(search after - before) - (bash after - before), paired per task: is search's gain the larger?"""
    arms = ("search", "bash")
    tasks = sorted(set.intersection(*(set(e[a]["per_task"]) for e in (before, after) for a in arms)))
    diffs = [(after["search"]["per_task"][t][key] - before["search"]["per_task"][t][key])
             - (after["bash"]["per_task"][t][key] - before["bash"]["per_task"][t][key]) for t in tasks]
    n = len(diffs)
    mean = sum(diffs) / n if n else 0.0
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else 0.0
    return {"tasks": n, "diff": round(mean, 4), "se": round(se, 4), "z": round(mean / se, 2) if se else None}


def filter_summary(folder: RunDir) -> dict:
    """Training tasks the arm's base policy played before training, and how many it solved at least once."""
    ev = json.loads(folder.eval_result.read_text()) if folder.eval_result.is_file() else {"per_task": {}}
    return {"tasks": len(ev["per_task"]), "attempts_per_task": ev.get("attempts_per_task"),
            "kept": sum(row["correct"] > 0 for row in ev["per_task"].values()), "pass@1": ev.get("pass@1")}


BAND = (0.1, 0.7)
"""The base policy's held-out pass@K worth training from: a task nobody solves teaches nothing, one everybody
solves leaves nothing to gain (the reference recipe filters its training set the same way)."""


def band_warning(arm: str, ev: dict, k: int) -> str | None:
    """A line when the arm's pass@K before training is outside BAND: the comparison is then weak."""
    rate = ev.get(f"pass@{k}")
    if rate is None or BAND[0] <= rate <= BAND[1]:
        return None
    side = "below" if rate < BAND[0] else "above"
    return (f"the {arm} arm's held-out pass@{k} before training is {rate:.3f}, {side} {BAND[0]}-{BAND[1]}: "
            f"{'few held-out tasks are ever solved' if side == 'below' else 'little is left to gain'}, so a "
            "gain will be hard to tell from noise (other held-out libraries, or tasks.difficulty, agent.max_turns)")


def phase_walls(root: RunDir, arms: list[str]) -> dict[str, int]:
    """Each finished phase's own run time (its summary.json), so a resumed bench still reports the phases
    an earlier invocation ran."""
    walls = {}
    for arm in arms:
        for phase in ("filter", "before", "train", "after"):
            summary = root.sub(arm).sub(phase).summary
            if summary.is_file() and "wall_seconds" in (data := json.loads(summary.read_text())):
                walls[f"{arm}_{phase}"] = round(data["wall_seconds"])
    return walls


def heldout_libraries(family: str) -> list[str] | None:
    """The libraries (NAME==VERSION) of the family's held-out rows, so a result says which split it measured
    (`rollway bench search-seeds` lists them per seed)."""
    rows = read_jsonl(Path(family) / "heldout.jsonl")
    return sorted({str(row["repo"]) for row in rows if row.get("repo")}) or None


def _summary(ev: dict, folder: RunDir, k: int) -> dict:
    return {"tasks": ev["tasks"], "attempts": ev["attempts"], "failed": ev.get("failed"),
            "pass@1": ev.get("pass@1"), f"pass@{k}": ev.get(f"pass@{k}"), "file_accuracy": file_accuracy(folder),
            "tool_calls_per_episode": tool_calls_per_episode(read_jsonl(folder.trajectories))}


def run(args: argparse.Namespace) -> int:
    root = RunDir(Path(args.run_dir or fresh_run_folder("search-bench")))
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    k, result = args.attempts, {"seed": args.seed, "run_dir": str(root.path), "heldout": heldout_libraries(args.family)}
    before: dict[str, dict] = {}
    for arm in arms:
        before[arm] = _eval(args, root, arm, "before")
    result["before"] = {arm: _summary(before[arm], root.sub(arm).sub("before"), k) for arm in arms}
    for arm in arms:
        if (warning := band_warning(arm, before[arm], k)) is not None:
            print(f"rollway bench search: {warning}", file=sys.stderr)
    if len(before) == 2:
        result["before_search_minus_bash"] = {f"pass@{x}": paired(before["bash"], before["search"], f"pass@{x}")
                                              for x in (1, k)}
    if not args.before_only:
        after: dict[str, dict] = {}
        phases: dict[str, str] = {}
        for arm in arms:
            checkpoint = _train(args, root, arm)
            after[arm] = _eval(args, root, arm, "after", checkpoint) if checkpoint else before[arm]
            phases[arm] = "after" if checkpoint else "before"  # no update: the policy is the one measured before
        result["after"] = {arm: _summary(after[arm], root.sub(arm).sub(phases[arm]), k) for arm in arms}
        result["gain"] = {arm: paired(before[arm], after[arm], "pass@1") for arm in arms}
        result["training"] = {arm: training_curves(root.sub(arm).sub("train")) for arm in arms}
        if args.train_filter:
            result["train_filter"] = {arm: filter_summary(root.sub(arm).sub("filter")) for arm in arms}
        if len(arms) == 2:
            result["after_search_minus_bash"] = {f"pass@{x}": paired(after["bash"], after["search"], f"pass@{x}")
                                                 for x in (1, k)}
            result["gain_search_minus_bash"] = gain_difference(before, after, "pass@1")
    result["wall_seconds"] = phase_walls(root, arms)
    out = root.path / "search-bench.json"
    out.write_text(dumps(result, indent=1))
    plot(result, root.path / "search-bench.png", k)
    print(dumps(result) if args.json else dumps(result, indent=1))
    return 0


def plot(result: dict, path: Path, k: int) -> None:
    """Pass rates per arm and phase; reward per update; tool calls per episode over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    bars = [(f"{arm} {phase}", result[phase][arm]) for phase in ("before", "after") if phase in result
            for arm in result[phase]]
    for i, metric in enumerate(("pass@1", f"pass@{k}", "file_accuracy")):
        axes[0].bar([j + i * 0.27 for j in range(len(bars))], [b[1].get(metric) or 0 for b in bars], 0.27,
                    label=metric)
    axes[0].set_xticks([j + 0.27 for j in range(len(bars))], [b[0] for b in bars], rotation=20)
    axes[0].set(title="held-out", ylim=(0, 1))
    axes[0].legend()
    for arm, curves in result.get("training", {}).items():
        steps = curves["reward_per_update"]
        axes[1].plot([s["step"] for s in steps], [s["reward_mean"] for s in steps], marker="o", label=arm)
        rows = curves["tool_calls_by_version"]
        for tool in sorted({key for r in rows for key in r} - {"policy_version", "episodes"}):
            axes[2].plot([r["policy_version"] for r in rows], [r.get(tool, 0) for r in rows], marker=".",
                         label=f"{arm}: {tool}")  # a marker: an arm with no update has one version, one point
    axes[1].set(title="training reward per update", xlabel="update")
    axes[2].set(title="tool calls per episode", xlabel="policy version")
    for ax in axes[1:]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
