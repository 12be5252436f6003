"""`rollway docs config|topology`: write (or check) the configuration reference (docs/configuration.md) and
the topology block of the README and docs/concepts.md (from topics/topology.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "docs"
HELP = ("Generate documentation: `config` writes the configuration reference from the pydantic config models; "
        "`topology` the pipeline block of README.md and docs/concepts.md from topics/topology.py.")
DEFAULT_OUT = "docs/configuration.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["config", "topology"],
                        help="config: the configuration reference; topology: the README's pipeline block")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"file to write (default {DEFAULT_OUT}, from the "
                        "repository root)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the file differs from what would be written")


def run(args: argparse.Namespace) -> int:
    from rollway.docgen.pages import write_config_reference, write_topology

    if args.what == "topology":
        return write_topology(args.check)
    return write_config_reference(Path(args.out), args.check, named_out=args.out != DEFAULT_OUT)
