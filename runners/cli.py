"""The `rollway` command: every `cmd_*` module of the command packages is one subcommand."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import signal
import sys

from rollway.base.logging import log_to_stderr

COMMAND_PACKAGES = ("rollway.runners", "rollway.bench")
"""Packages whose `cmd_*` modules are subcommands. Found by name at run time: `rollway.bench` sits
above the runners it drives, so the runners never import it."""


def command_modules() -> list:
    modules = []
    for package in COMMAND_PACKAGES:
        path = importlib.import_module(package).__path__
        names = sorted(m.name for m in pkgutil.iter_modules(path) if m.name.startswith("cmd_"))
        modules += [importlib.import_module(f"{package}.{name}") for name in names]
    return sorted(modules, key=lambda m: m.NAME)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollway", description="Agent RL rollouts as a Kafka stream pipeline.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in command_modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Dotted overrides may come after options (`up smoke.yaml --run-dir D agent.max_turns=3`).
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # SIGTERM (kill, a job manager, a CI timeout) unwinds like Ctrl-C: every command's `finally`
    # stops what it started (stage processes, broker, engine, sim server), which run in their own
    # sessions and would otherwise outlive it. `rollway stage` installs its own graceful handler.
    signal.signal(signal.SIGTERM, _terminate)
    # Log lines go to stderr: a command's stdout is its result (`--json` above all). A command that runs a job
    # (`up`, `stage`) sets its own logging up.
    log_to_stderr()
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM (a BaseException, so `except Exception` does not stop it)."""


def _terminate(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # unwind once, whatever arrives meanwhile
    raise Terminated()


if __name__ == "__main__":
    sys.exit(main())
