"""`rollway sandbox check`: attack a throwaway sandbox and report which protections hold here."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

NAME = "sandbox"
HELP = "Check that the sandbox (bubblewrap or Docker) contains a hostile agent on this machine."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="probe network, filesystem, user and limit protections")
    check.add_argument("config", nargs="?", default=None, help="run config YAML (its `sandbox:` section)")
    check.add_argument(
        "overrides", nargs="*", default=[], help="dotted overrides, e.g. sandbox.memory_mb=512"
    )
    check.add_argument("--type", choices=["local", "docker"], default=None, help="override sandbox.type")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    bench = sub.add_parser("bench", help="time sandbox creation and a trivial command (p50/p95)")
    bench.add_argument("--type", choices=["local", "docker"], default="local", help="sandbox type")
    bench.add_argument("-n", type=int, default=20, help="sandboxes to create, one after another")
    bench.add_argument(
        "--source", default=None, help="folder copied into each sandbox (e.g. an SWE task's repository)"
    )
    bench.add_argument(
        "--pool", type=int, default=0, help="docker: sandbox.warm_pool (started containers kept ready)"
    )
    bench.add_argument(
        "--gap", type=float, default=0.0, help="seconds between creations (an init stage's arrivals)"
    )
    reap = sub.add_parser("reap", help="remove the sandboxes killed workers left (of one run, or every run)")
    reap.add_argument("config", nargs="?", default=None, help="run config YAML (its `sandbox:` section)")
    reap.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. sandbox.root=/tmp/boxes")
    reap.add_argument("--run", default=None, metavar="RUN",
                      help="run id (summary.json's run_id); without it every episode sandbox of every run goes, "
                           "so run it only when no run is running here")
    reap.add_argument("--type", choices=["local", "docker"], default=None, help="override sandbox.type")
    fleet = sub.add_parser("fleet", help="each docker engine of sandbox.engines: up/down/out of disk, sandboxes by "
                                         "run, capacity, images, round-trip latency")
    fleet.add_argument("config", nargs="?", default=None, help="run config YAML (its `sandbox:` section)")
    fleet.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. sandbox.engines=[...]")
    fleet.add_argument("--json", action="store_true", help="print the engines as JSON")
    image = sub.add_parser("image", help="docker sandbox images, built here from the local base image")
    image_sub = image.add_subparsers(dest="image_command", required=True, metavar="ACTION")
    build = image_sub.add_parser(
        "build", help="build a task image FROM the base (PyPI packages at build time)"
    )
    build.add_argument("tag", help="name:tag of the new image (then: sandbox.image=TAG or the task's image)")
    build.add_argument(
        "--pip", nargs="*", default=[], metavar="PKG", help="packages to pip install from PyPI"
    )
    build.add_argument(
        "--run", action="append", default=[], metavar="CMD", help="extra RUN command (repeatable)"
    )
    build.add_argument("--base", default=None, help="base image (default: rollway-sandbox:bookworm)")


def run(args: argparse.Namespace) -> int:
    """check: 0 when every protection holds, 1 when one does not, 2 when the sandbox cannot run at all.
    image build: 0 when built, 2 when it could not be."""
    if getattr(args, "sandbox_command", "check") == "image":
        return _build_image(args)
    if getattr(args, "sandbox_command", "check") == "reap":
        return _reap(args)
    if getattr(args, "sandbox_command", "check") == "fleet":
        return _fleet(args)
    if getattr(args, "sandbox_command", "check") == "bench":
        print(json.dumps(asyncio.run(_bench(args.type, args.n, args.source, args.pool, args.gap))))
        return 0
    from rollway.config.run import ConfigError, load_config
    from rollway.sandboxes.base import SandboxError, again_while_output_lost
    from rollway.sandboxes.factory import build_sandbox_provider

    overrides = list(getattr(args, "overrides", []) or [])
    config = args.config
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # `sandbox check key=value` without a file
    if args.type:
        overrides.append(f"sandbox.type={args.type}")
    try:
        cfg = load_config(config, overrides).sandbox
        report = asyncio.run(again_while_output_lost(  # the engine's race: the check again, in a fresh sandbox
            lambda: build_sandbox_provider(cfg).check(),
            lambda lost: print(f"rollway sandbox check: {lost}; checking again", file=sys.stderr)))
    except (SandboxError, ConfigError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        print(f"rollway sandbox check: {exc}", file=sys.stderr)
        return 2
    ok = bool(report.get("all_protections_hold"))
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0 if ok else 1


def _table(report: dict[str, Any]) -> str:
    lines = []
    for key, value in report.items():
        mark = ("ok  " if value else "FAIL") if isinstance(value, bool) else "    "
        lines.append(f"{mark} {key}: {value}")
    return "\n".join(lines)


def _reap(args: argparse.Namespace) -> int:
    """0 when every leftover went (printed as JSON), 1 when some could not be removed, 2 on bad input."""
    from rollway.config.run import ConfigError, load_config
    from rollway.sandboxes.base import SandboxError
    from rollway.sandboxes.factory import build_sandbox_provider
    from rollway.sandboxes.reaper import reap_run

    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]
    if args.type:
        overrides.append(f"sandbox.type={args.type}")
    try:
        provider = build_sandbox_provider(load_config(config, overrides).sandbox)
        report = asyncio.run(reap_run(provider, args.run))
    except (SandboxError, ConfigError, ValueError) as exc:
        print(f"rollway sandbox reap: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"run": args.run, "removed": report.removed, "failed": report.failed}))
    return 1 if report.failed else 0


def _fleet(args: argparse.Namespace) -> int:
    """0 when every engine answers, 1 when some do not, 2 on bad input (the table or JSON either way)."""
    from rollway.config.run import ConfigError, load_config
    from rollway.sandboxes.fleet import FleetSandboxProvider

    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]
    try:
        cfg = load_config(config, [*overrides, "sandbox.type=docker"]).sandbox
    except ConfigError as exc:
        print(f"rollway sandbox fleet: {exc}", file=sys.stderr)
        return 2
    rows = FleetSandboxProvider(cfg).status()  # type: ignore[arg-type]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'engine':<12} {'state':<11} {'sandboxes':>9} {'capacity':>8} {'latency':>9}  reason / by run / images")
        for r in rows:
            if r["state"] == "down":
                print(f"{r['id']:<12} {'down':<11} {'-':>9} {r['capacity'] or '-':>8} {'-':>9}  {r['reason']}")
                continue
            detail = (", ".join(f"{k}: {v}" for k, v in r["by_run"].items()) or "-") + " | " + ", ".join(r["images"])
            print(f"{r['id']:<12} {r['state']:<11} {r['sandboxes']:>9} {r['capacity'] or '-':>8} "
                  f"{r['latency_ms']:>7.1f}ms  {r.get('reason', '') + ' | ' if 'reason' in r else ''}{detail}")
    return 0 if all(r["state"] == "up" for r in rows) else 1


def _build_image(args: argparse.Namespace) -> int:
    from rollway.sandboxes.base import SandboxError
    from rollway.sandboxes.images import build_image

    try:
        result = build_image(args.tag, args.pip, args.run, args.base)
    except SandboxError as exc:
        print(f"rollway sandbox image build: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


async def _bench(
    kind: str, n: int, source: str | None = None, pool: int = 0, gap: float = 0.0
) -> dict[str, Any]:
    """Create `n` sandboxes one after another (one file or `source`, base snapshot), run `true` in
    each, destroy; with `pool`, the docker provider keeps that many containers started."""
    import time
    import uuid

    from rollway.sandboxes.base import SandboxSpec
    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.factory import build_sandbox_provider

    pooled = {"warm_pool": pool} if pool else {}  # a docker field: other types have no warm pool
    provider = build_sandbox_provider(SandboxConfig(type=kind, **pooled))  # type: ignore[arg-type]
    spec = SandboxSpec(source_dir=source, files={} if source else {"a.py": "x = 1\n"})
    creates, execs = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        await asyncio.sleep(gap)
        box = await provider.create(spec, f"bench-{uuid.uuid4().hex[:10]}")
        t1 = time.perf_counter()
        await box.exec("true")
        execs.append(time.perf_counter() - t1)
        creates.append(t1 - t0)
        await box.destroy()
    await provider.close()

    def pct(xs: list[float], q: float) -> float:
        return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)

    return {"type": kind, "n": n, "pool": pool, "gap_s": gap, "create_p50_ms": pct(creates, 0.5), "create_p95_ms": pct(creates, 0.95),
            "exec_p50_ms": pct(execs, 0.5), "exec_p95_ms": pct(execs, 0.95)}  # fmt: skip
