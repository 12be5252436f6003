"""`rollway tasks`: build SWE task instances from a library's sdist, and verify them in real sandboxes."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

NAME = "tasks"
HELP = ("build SWE tasks (SWE-bench rows over a git repository) from a package's sdist (build); check a task set "
        "(verify CONFIG: gold policy resolves every task, doing nothing resolves none) or SWE rows' gold patches "
        "(verify FILE.jsonl); "
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
    build.add_argument("--out", required=True, help="swe: rows file to write (JSONL); buglocal: a folder")
    build.add_argument("--max-failing", type=int, default=None,
                       help="keep a bug only when 1..K tests fail with it (default 5; buglocal 50)")
    build.add_argument("--max-candidates", type=int, default=400,
                       help="give up after trying this many mutations (default 400)")
    build.add_argument("--cache", default=None, help="cache folder for sdists and snapshots (default ~/.cache/rollway)")
    build.add_argument("--format", choices=["swebench", "instances"], default="swebench",
                       help="swebench (default): SWE-bench rows over a git repository written into --mirror "
                            "(tasks.type swe or swebench); instances: rollway's older mutation instances over the "
                            "unpacked sdist (what tasks.type=buglocal reads; swe/swebench convert them on load)")
    build.add_argument("--mirror", default=None, help="folder of git repositories to write into (default: `mirror` "
                       "next to --out, where the task set looks for it)")
    build.add_argument("--sandbox", choices=["local", "docker"], default="local",
                       help="where each row's gold patch is checked before it is written: its tree in the bubblewrap "
                            "jail (default) or its instance image (docker)")
    build.add_argument("--variant", choices=["swebench", "swe-gym", "swe-smith", "r2e-gym"], default="swebench",
                       help="write the rows in this dataset's field layout (default swebench)")
    build.add_argument("--base-image", default="rollway-sandbox:bookworm",
                       help="--sandbox docker: image the instance images are built from")
    verify = sub.add_parser("verify", help="CONFIG.yaml: play every task with the gold policy (reference_solution) "
                            "and a do-nothing policy; FILE: grade each instance's gold and empty patch (or a Harbor "
                            "task's solution and an empty run) in a real sandbox")
    verify.add_argument("file", help="a run config (YAML: any task set), a SWE-bench-schema rows file (JSONL/Parquet; "
                        "an older instances file is converted), or a Harbor task folder (or a folder of them)")
    verify.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (with a CONFIG)")
    verify.add_argument("--run-dir", default=None, help="folder for the episodes' files (CONFIG; default a temp folder)")
    verify.add_argument("--type", choices=["auto", "swe", "swebench", "harbor"], default="auto",
                        help="task family of FILE (auto: a folder is harbor, else SWE rows; swe and swebench are one)")
    verify.add_argument("--mirror", default=None, help="swebench: folder of git repositories (tasks.mirror)")
    verify.add_argument("--base-image", default=None, help="swebench/harbor: tasks.base_image")
    verify.add_argument("--json", action="store_true", help="print the result as JSON")
    verify.add_argument("--timeout", type=float, default=120.0, help="test time limit per grading, seconds")
    verify.add_argument("--cache", default=None, help="cache folder for snapshots (default ~/.cache/rollway)")
    verify.add_argument("--sandbox", choices=["local", "docker"], default="local",
                        help="SWE rows: grade in the bubblewrap jail on the tree from the mirror (default) or in "
                             "containers of each instance's image (docker); Harbor tasks always run in docker")
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
    if kind == "config":
        return asyncio.run(_verify_config(args))
    from rollway.runners.tasks_formats import verify_formats

    return asyncio.run(verify_formats(args, kind))


def _verify_kind(args: argparse.Namespace) -> str:
    if args.file.endswith((".yaml", ".yml")):
        return "config"  # a run config: played with the gold and the do-nothing policy
    if args.type != "auto":
        return "swebench" if args.type == "swe" else args.type
    return "harbor" if Path(args.file).is_dir() else "swebench"


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
    # --format instances: the older format, for the task sets built on the mutations (buglocal).
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
    print(f"train: {summary['train']} tasks ({summary['train_named']} named) in {args.out}/train.jsonl, held-out: "
          f"{summary['heldout']} tasks ({summary['heldout_named']} named) in {args.out}/heldout.jsonl "
          f"({summary['wall_seconds']:.0f}s; re-running resumes from {args.out}/libs)")
    if summary["left_out"]:  # written without them; exit 1 so a script does not take the family for whole
        print(f"error: not fetched, left out: {', '.join(summary['left_out'])}; run the same command again to "
              "try them (the rest is cached)", file=sys.stderr)
        return 1
    return 0


async def _verify_config(args: argparse.Namespace) -> int:
    import tempfile

    from rollway.audit.verify import verify_taskset
    from rollway.config.run import ConfigError

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
                  + (f"\n  why: {row['gold_why']}" if "gold_why" in row else "")
                  + (f"\n  ANSWER LEAKS: {row['leaks']}" if row.get("leaks") else ""))
        print(f"gold_resolved {summary['gold_resolved']}/{summary['total']}, "
              f"nothing_resolved {summary['nothing_resolved']}/{summary['total']}, "
              f"leaking {summary['leaking']}/{summary['total']}")
        print(f"trajectories: rollway show {Path(summary['trajectories']['gold']).parent} (gold), "
              f"rollway show {Path(summary['trajectories']['nothing']).parent} (do-nothing)")
    ok = summary["gold_resolved"] == summary["total"] and summary["nothing_resolved"] == 0 and not summary["leaking"]
    return 0 if ok else 1
