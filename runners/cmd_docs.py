"""`rollway docs config`: write (or check) the configuration reference, docs/configuration.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "docs"
HELP = "Generate documentation: `config` writes the configuration reference from the pydantic config models."
DEFAULT_OUT = "docs/configuration.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["config"], help="config: the configuration reference")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"file to write (default {DEFAULT_OUT}, from the "
                        "repository root)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the file differs from what would be written")


def run(args: argparse.Namespace) -> int:
    from rollway.runners.config_docs import COMMAND, config_reference

    text, out = config_reference(), Path(args.out)
    if args.check:
        current = out.read_text() if out.exists() else None
        if current != text:
            print(f"rollway docs: {out} is stale (the config models changed); run `{COMMAND}`"
                  + (f" --out {out}" if args.out != DEFAULT_OUT else ""), file=sys.stderr)
            return 1
        print(f"{out} is current")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(out)
    return 0
