"""`rollway tasks`: build SWE task instances from a library's sdist, and verify them in real sandboxes."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

NAME = "tasks"
HELP = ("build SWE-style task instances from a package's sdist (build); check a task set (verify CONFIG: gold "
        "policy resolves every task, doing nothing resolves none) or SWE instances' gold patches (verify FILE.jsonl); "
        "find or build every task image of a swebench/harbor config (build-images CONFIG)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tasks_command", required=True, metavar="{build,verify,build-images}")
    build = sub.add_parser("build", help="inject bugs into a library and keep those its tests catch")
    build.add_argument("kind", choices=["swe", "buglocal"],
                       help="task family to build: swe (one library, --sdist) or buglocal (bug localisation from "
                            "several libraries, --train/--heldout, into the folder --out)")
    build.add_argument("--sdist", default=None, help="swe: source archive on the package index, NAME==VERSION")
    build.add_argument("--train", default="", help="buglocal: training libraries, comma-separated (NAME or NAME==VERSION)")
    build.add_argument("--heldout", default="", help="buglocal: held-out libraries (never in --train), comma-separated")
    build.add_argument("--per-library", type=int, default=30, help="buglocal: instances per library (default 30)")
    build.add_argument("--max-per-function", type=int, default=2,
                       help="buglocal: bugs kept in one function at most (default 2)")
    build.add_argument("--max-tasks", type=int, default=5, help="stop after this many instances (default 5)")
    build.add_argument("--seed", type=int, default=0, help="order of the mutations tried (default 0)")
    build.add_argument("--out", required=True, help="instances file to write (JSONL)")
    build.add_argument("--max-failing", type=int, default=None,
                       help="keep a bug only when 1..K tests fail with it (default 5; buglocal 50)")
    build.add_argument("--max-candidates", type=int, default=400,
                       help="give up after trying this many mutations (default 400)")
    build.add_argument("--cache", default=None, help="cache folder for sdists and snapshots (default ~/.cache/rollway)")
    build.add_argument("--format", choices=["rollway", "swebench"], default="rollway",
                       help="rollway: instances over the unpacked sdist (tasks.type=swe); swebench: SWE-bench rows "
                            "over a git repository written into --mirror (tasks.type=swebench), checked in images")
    build.add_argument("--mirror", default=None, help="--format swebench: folder of git repositories to write into")
    build.add_argument("--variant", choices=["swebench", "swe-gym", "swe-smith", "r2e-gym"], default="swebench",
                       help="--format swebench: write the rows in this dataset's field layout (default swebench)")
    build.add_argument("--base-image", default="rollway-sandbox:bookworm",
                       help="--format swebench: image the instance images are built from")
    verify = sub.add_parser("verify", help="CONFIG.yaml: play every task with the gold policy (reference_solution) "
                            "and a do-nothing policy; FILE: grade each instance's gold and empty patch (or a Harbor "
                            "task's solution and an empty run) in a real sandbox")
    verify.add_argument("file", help="a run config (YAML: any task set), an instances file from `rollway tasks build "
                        "swe`, a SWE-bench-schema rows file (JSONL/Parquet), or a Harbor task folder (or a folder of them)")
    verify.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (with a CONFIG)")
    verify.add_argument("--run-dir", default=None, help="folder for the episodes' files (CONFIG; default a temp folder)")
    verify.add_argument("--type", choices=["auto", "swe", "swebench", "harbor"], default="auto",
                        help="task family of FILE (auto: a folder is harbor, rows with `mutation` swe, else swebench)")
    verify.add_argument("--mirror", default=None, help="swebench: folder of git repositories (tasks.mirror)")
    verify.add_argument("--base-image", default=None, help="swebench/harbor: tasks.base_image")
    verify.add_argument("--json", action="store_true", help="print the result as JSON")
    verify.add_argument("--timeout", type=float, default=120.0, help="test time limit per grading, seconds")
    verify.add_argument("--cache", default=None, help="cache folder for snapshots (default ~/.cache/rollway)")
    verify.add_argument("--sandbox", choices=["local", "docker"], default="local",
                        help="grade in the bubblewrap jail (default) or in Docker containers")
    verify.add_argument("--image", default=None, help="docker image (default: sandbox.image, the locally built base)")


    images = sub.add_parser("build-images", help="CONFIG.yaml: find or build every task's image (swebench, harbor) "
                            "before a run, with progress")
    images.add_argument("file", help="a run config (YAML) with tasks.type swebench or harbor")
    images.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    images.add_argument("--jobs", type=int, default=None, help="images built side by side (default tasks.image_build_jobs)")
    images.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    if args.tasks_command == "build":
        return _build(args)
    if args.tasks_command == "build-images":
        from rollway.runners.tasks_formats import build_images_command

        return build_images_command(args)
    kind = _verify_kind(args)
    if kind not in ("swe", "config"):
        from rollway.runners.tasks_formats import verify_formats

        return asyncio.run(verify_formats(args, kind))
    return asyncio.run(_verify(args))


def _verify_kind(args: argparse.Namespace) -> str:
    if args.file.endswith((".yaml", ".yml")):
        return "config"  # a run config: played with the gold and the do-nothing policy
    if args.type != "auto":
        return args.type
    path = Path(args.file)
    if path.is_dir():
        return "harbor"
    if path.suffix in (".jsonl", ".json") and path.is_file():
        first = next((line for line in path.read_text().splitlines() if line.strip()), "{}")
        if path.suffix == ".jsonl" and "mutation" in json.loads(first):
            return "swe"
    return "swebench"


def _build(args: argparse.Namespace) -> int:
    from rollway.envs.sdist import SdistError
    from rollway.envs.swe_build import BuildError, BuildOptions, build_instances

    if args.kind == "buglocal":
        return _build_buglocal(args)
    if not args.sdist:
        print("error: tasks build swe needs --sdist NAME==VERSION", file=sys.stderr)
        return 2
    args.max_failing = 5 if args.max_failing is None else args.max_failing
    if args.max_tasks < 1 or args.max_failing < 1:
        print("error: --max-tasks and --max-failing must be at least 1", file=sys.stderr)
        return 2
    started = time.monotonic()
    opts = BuildOptions(sdist=args.sdist, max_tasks=args.max_tasks, seed=args.seed, max_failing=args.max_failing,
                        max_candidates=args.max_candidates, cache_dir=args.cache)
    try:
        instances = build_instances(opts)
    except (BuildError, SdistError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.format == "swebench":
        from rollway.runners.tasks_formats import write_swebench

        return write_swebench(args, instances, started)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in instances))
    print(f"wrote {len(instances)} instances to {out} in {time.monotonic() - started:.1f}s"
          + ("" if len(instances) == args.max_tasks else f" (asked for {args.max_tasks})"))
    return 0


def _build_buglocal(args: argparse.Namespace) -> int:
    from rollway.envs.buglocal_build import FamilyOptions, build_family
    from rollway.envs.sdist import SdistError
    from rollway.envs.swe_build import BuildError

    train = [x.strip() for x in args.train.split(",") if x.strip()]
    heldout = [x.strip() for x in args.heldout.split(",") if x.strip()]
    if not train and not heldout:
        print("error: tasks build buglocal needs --train and/or --heldout libraries", file=sys.stderr)
        return 2
    # A task lists its first failing tests only (envs/buglocal.py), so a bug many tests catch is kept:
    # --max-failing defaults to 50 here (5 for swe, where every failing test is in the statement).
    max_failing = 50 if args.max_failing is None else args.max_failing
    opts = FamilyOptions(out=Path(args.out), train=train, heldout=heldout, per_library=args.per_library,
                         seed=args.seed, max_failing=max_failing,
                         max_candidates=max(args.max_candidates, 4 * args.per_library),
                         max_per_function=args.max_per_function, cache_dir=args.cache)
    try:
        summary = build_family(opts)
    except (BuildError, SdistError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1))
    print(f"train: {summary['train']} tasks in {args.out}/train.jsonl, held-out: {summary['heldout']} tasks in "
          f"{args.out}/heldout.jsonl ({summary['wall_seconds']:.0f}s; re-running resumes from {args.out}/libs)")
    return 0


async def verify_instances(instances: list[dict[str, Any]], timeout_s: float = 120.0,
                           cache_dir: str | None = None, progress: Any = None,
                           sandbox: dict[str, Any] | None = None) -> dict[str, Any]:
    """Grade gold and empty patches of every instance in a real sandbox (`sandbox`: SandboxConfig
    fields; default the local bubblewrap jail)."""
    from rollway.envs.swe import grade_patch
    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.factory import build_sandbox_provider

    provider = build_sandbox_provider(SandboxConfig(**{"type": "local", **(sandbox or {})}))
    rows = []
    for inst in instances:
        gold = await grade_patch(inst, inst["patch"], provider, test_timeout_s=timeout_s, cache_dir=cache_dir)
        empty = await grade_patch(inst, "", provider, test_timeout_s=timeout_s, cache_dir=cache_dir)
        rows.append({"instance_id": inst["instance_id"], "gold_resolved": gold.resolved,
                     "empty_resolved": empty.resolved, "gold_stop_reason": gold.stop_reason,
                     "empty_stop_reason": empty.stop_reason})
        if progress is not None:  # a rollway.runners.progress.ProgressDisplay
            progress.update(len(rows), len(instances), f"{sum(r['gold_resolved'] for r in rows)} gold resolved")
    return {"total": len(rows), "gold_resolved": sum(r["gold_resolved"] for r in rows),
            "empty_resolved": sum(r["empty_resolved"] for r in rows), "instances": rows}


async def _verify_config(args: argparse.Namespace) -> int:
    import tempfile

    from rollway.core.config import ConfigError
    from rollway.core.logging import log_to_stderr
    from rollway.runners.verify import verify_taskset

    log_to_stderr()  # stdout: the result only
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rollway-verify-"))
    try:
        summary = await verify_taskset(args.file, list(args.overrides), run_dir)
    except ConfigError as err:
        print(f"rollway tasks verify: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for row in summary["tasks"]:
            print(f"{row['task_id']}: gold {'resolved' if row['gold_resolved'] else 'NOT resolved'} "
                  f"({row['gold_stop_reason']}, {row['gold_turns']} turns), "
                  f"do-nothing {'RESOLVED' if row['nothing_resolved'] else 'not resolved'}"
                  + (f"\n  why: {row['gold_why']}" if "gold_why" in row else ""))
        print(f"gold_resolved {summary['gold_resolved']}/{summary['total']}, "
              f"nothing_resolved {summary['nothing_resolved']}/{summary['total']}")
        print(f"trajectories: rollway show {Path(summary['trajectories']['gold']).parent} (gold), "
              f"rollway show {Path(summary['trajectories']['nothing']).parent} (do-nothing)")
    return 0 if summary["gold_resolved"] == summary["total"] and summary["nothing_resolved"] == 0 else 1


async def _verify(args: argparse.Namespace) -> int:
    if args.file.endswith((".yaml", ".yml")):
        return await _verify_config(args)
    from rollway.envs.swe import load_instances

    try:
        instances = load_instances(args.file, args.cache)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from rollway.runners.progress import ProgressDisplay

    progress = ProgressDisplay("instances verified", every_s=10.0)
    try:
        sandbox = {"type": args.sandbox, **({"image": args.image} if args.image else {})}
        summary = await verify_instances(instances, args.timeout, args.cache, progress, sandbox)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for row in summary["instances"]:
            print(f"{row['instance_id']}: gold {'resolved' if row['gold_resolved'] else 'NOT resolved'}"
                  f"{' (' + row['gold_stop_reason'] + ')' if row['gold_stop_reason'] else ''}, "
                  f"empty {'RESOLVED' if row['empty_resolved'] else 'not resolved'}")
        print(f"gold_resolved {summary['gold_resolved']}/{summary['total']}, "
              f"empty_resolved {summary['empty_resolved']}/{summary['total']}")
    ok = summary["gold_resolved"] == summary["total"] and summary["empty_resolved"] == 0
    return 0 if ok else 1
