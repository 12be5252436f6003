"""`rollway grader check`: play hostile-agent attacks against every built-in grader and report which are contained."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

NAME = "grader"
HELP = "Check that the graders (swe, swebench, humaneval, harbor, toy, tool calls) contain a hostile agent."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="grader_command", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="attack each task family's grader in real sandboxes; a table or --json")
    check.add_argument("--type", choices=["local", "docker"], default="local", help="sandbox type (default local)")
    check.add_argument("--family", action="append", default=[], metavar="NAME",
                       help="task family to attack (repeatable): swe, swebench, humaneval, harbor, toy; default all "
                            "(swebench and harbor need --type docker)")
    check.add_argument("--attack", action="append", default=[], metavar="ROW", help="only this row (repeatable)")
    check.add_argument("--row-timeout", type=float, default=300.0, help="seconds one row may take (default 300)")
    check.add_argument("--jobs", type=int, default=2, help="rows played side by side (default 2)")
    check.add_argument("--swe-instances", default=None, help="swe rows file (or an older instances file; default: toolz, built once)")
    check.add_argument("--swebench-rows", default=None, help="swebench rows file (with --mirror; default: toolz)")
    check.add_argument("--mirror", default=None, help="git mirror folder of --swebench-rows")
    check.add_argument("--harbor", default=None, help="Harbor task folder (default examples/harbor/file-permissions)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """0 when every row is contained, 1 when one is not, 2 when the suite cannot run here."""
    from rollway.audit.grader_check import FAMILIES, Options, run_suite, table
    from rollway.sandboxes.base import SandboxError


    unknown = sorted(set(args.family) - set(FAMILIES))
    if unknown:
        print(f"rollway grader check: unknown --family {', '.join(unknown)}; use {', '.join(FAMILIES)}",
              file=sys.stderr)
        return 2
    opts = Options(sandbox=args.type, families=tuple(args.family) or FAMILIES, attacks=tuple(args.attack),
                   row_timeout_s=args.row_timeout, jobs=max(1, args.jobs), swe_instances=args.swe_instances,
                   swebench_rows=args.swebench_rows, mirror=args.mirror, harbor=args.harbor)
    try:
        report = asyncio.run(run_suite(opts))
    except (SandboxError, RuntimeError, FileNotFoundError, ValueError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        print(f"rollway grader check: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0 if report["all_contained"] else 1
