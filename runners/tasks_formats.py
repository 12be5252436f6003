"""`rollway tasks build swe` (SWE-bench rows over git) and `rollway tasks verify` for SWE rows and Harbor tasks."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any


def default_mirror(out: str | Path) -> Path:
    """Where `rollway tasks build swe` writes its git repositories unless told: `mirror/` next to the rows
    file (several libraries built into one folder share it; the task set looks there by default)."""
    return Path(out).expanduser().parent / "mirror"


def write_swebench(args: argparse.Namespace, instances: list[dict[str, Any]], started: float) -> int:
    """Commit the instances into the mirror as git history, check each gold patch on the task path
    (`--sandbox`: the exported tree in the local jail, or the instance image), write the rows."""
    from rollway.envs.swe_export import as_variant, export_swebench, validate_rows

    mirror = str(Path(args.mirror).expanduser() if args.mirror else default_mirror(args.out))
    rows = export_swebench(instances, mirror, args.cache)
    rows = asyncio.run(validate_rows(rows, mirror, args.sandbox, args.base_image, args.cache,
                                     lambda line: print(line, file=sys.stderr, flush=True)))
    if not rows:
        print(f"error: no instance passed with its gold patch ({args.sandbox} sandbox)", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(as_variant(row, args.variant)) + "\n" for row in rows))
    print(f"wrote {len(rows)} {args.variant} rows to {out} (repositories in {mirror}) "
          f"in {time.monotonic() - started:.1f}s" + ("" if len(rows) == args.max_tasks else f" (asked for {args.max_tasks})"))
    return 0


async def verify_formats(args: argparse.Namespace, kind: str) -> int:
    """`rollway tasks verify FILE`: a Harbor folder (docker), or SWE rows (an instances file is converted
    on load) graded on the task path in the `--sandbox` given."""
    from rollway.envs.config import HarborTasksConfig, SWEBenchTasksConfig
    from rollway.sandboxes.config import DockerSandboxConfig, SandboxConfig
    from rollway.sandboxes.docker import DockerSandboxProvider
    from rollway.sandboxes.factory import build_sandbox_provider

    extra = {"base_image": args.base_image} if args.base_image else {}
    try:
        if kind == "harbor":
            from rollway.envs.harbor import HarborTaskSet, verify_tasks

            provider = DockerSandboxProvider(DockerSandboxConfig(**({"image": args.base_image} if args.base_image
                                                                      else {})))
            summary = await verify_tasks(HarborTaskSet(HarborTasksConfig(path=args.file, **extra)), provider)
            ok = summary["oracle_passed"] == summary["with_solution"] and summary["empty_passed"] == 0
            lines = [f"{r['task']}: oracle {r.get('oracle_reward')} ({r.get('oracle_outcome')}), "
                     f"empty {r.get('empty_reward')} ({r.get('empty_outcome')})" for r in summary["tasks"]]
            lines.append(f"oracle_passed {summary['oracle_passed']}/{summary['with_solution']}, "
                         f"empty_passed {summary['empty_passed']}/{summary['total']}")
        else:
            from rollway.envs.swebench import SWEBenchTaskSet, verify_instances
            from rollway.runners.progress import ProgressDisplay

            image = args.image or args.base_image
            sandbox = SandboxConfig(type=args.sandbox, **({"image": image} if image and args.sandbox == "docker"
                                                          else {}))
            provider = build_sandbox_provider(sandbox)
            taskset = SWEBenchTaskSet(SWEBenchTasksConfig(path=args.file, mirror=args.mirror, cache_dir=args.cache,
                                                          test_timeout_s=args.timeout, **extra))
            taskset.sandbox_config = sandbox
            progress = ProgressDisplay("instances verified", every_s=10.0)
            try:
                summary = await verify_instances(taskset, provider, progress)
            finally:
                progress.close()
            ok = summary["gold_resolved"] == summary["total"] and summary["empty_resolved"] == 0
            lines = [f"{r['instance_id']}: gold {r['gold_outcome']}, empty {r['empty_outcome']}"
                     for r in summary["instances"]]
            lines.append(f"gold_resolved {summary['gold_resolved']}/{summary['total']}, "
                         f"empty_resolved {summary['empty_resolved']}/{summary['total']}")
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else "\n".join(lines))
    return 0 if ok else 1


def build_task_images(cfg: Any, workers: int | None = None, quiet: bool = False) -> dict[str, Any] | None:
    """Every selected task's image found or built (task sets with `build_images`: swebench, harbor), with
    progress on stderr; None when the task set has no images to build. Failures are listed, not raised:
    their episodes fail at init (env_error) and are retried by the pipeline's rules."""
    from rollway.envs.factory import build_taskset
    from rollway.runners.progress import ProgressDisplay

    taskset = build_taskset(cfg.tasks, cfg.sandbox)
    build = getattr(taskset, "build_images", None)
    if build is None:
        return None
    started = time.monotonic()
    progress = ProgressDisplay("task images ready", every_s=5.0, enabled=not quiet)
    try:
        summary = build(workers or cfg.tasks.image_build_jobs, progress)
    finally:
        progress.close()
    summary["seconds"] = round(time.monotonic() - started, 1)
    return summary


def prebuild_at_start(cfg: Any, quiet: bool = False) -> None:
    """Start of `rollway up`/`eval`: build the task images first (tasks.prebuild_images, docker sandboxes)."""
    if not getattr(cfg.tasks, "prebuild_images", False) or cfg.sandbox.type != "docker":
        return
    if cfg.tasks.type in ("toy", "humaneval", "calc", "sim"):  # built-in sets without task images
        return
    import structlog

    summary = build_task_images(cfg, quiet=quiet)
    if summary is None:
        return
    log = structlog.get_logger()
    log.info("task images ready", images=len(summary["images"]), built=len(summary["built"]),
             failed=len(summary["failed"]), seconds=summary["seconds"])
    for task_id, error in summary["failed"].items():
        log.warning("task image failed; its episodes will fail at init", task_id=task_id, error=error)


def build_images_command(args: argparse.Namespace) -> int:
    """`rollway tasks build-images CONFIG [key=value ...]`."""
    from rollway.config.run import ConfigError, load_config

    try:
        cfg = load_config(args.file, list(args.overrides))
    except ConfigError as err:
        print(f"rollway tasks build-images: {err}", file=sys.stderr)
        return 2
    summary = build_task_images(cfg, args.jobs)
    if summary is None:
        print(f"rollway tasks build-images: tasks.type={cfg.tasks.type} has no task images (swebench and harbor "
              "do)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for task_id, image in sorted(summary["images"].items()):
            print(f"{task_id}: {image}{' (built)' if image in summary['built'] else ''}")
        for task_id, error in sorted(summary["failed"].items()):
            print(f"{task_id}: FAILED {error}")
        print(f"{len(summary['images'])} images ready ({len(summary['built'])} built), {len(summary['failed'])} "
              f"failed, {summary['seconds']} s")
    return 0 if not summary["failed"] else 1
