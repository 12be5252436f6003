"""`rollway docs config|topology`: write (or check) the configuration reference (docs/configuration.md) and
the topology block of the README and docs/concepts.md (from topics/topology.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "docs"
HELP = ("Generate documentation: `config` writes the configuration reference from the pydantic config models; "
        "`topology` the pipeline block of README.md and docs/concepts.md from topics/topology.py.")
TOPOLOGY_FILES = ("README.md", "docs/concepts.md")
DEFAULT_OUT = "docs/configuration.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["config", "topology"],
                        help="config: the configuration reference; topology: the README's pipeline block")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"file to write (default {DEFAULT_OUT}, from the "
                        "repository root)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the file differs from what would be written")


def run(args: argparse.Namespace) -> int:
    if args.what == "topology":
        return _topology(args.check)
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


def _topology(check: bool) -> int:
    """Rewrite (or check) the generated topology block of each file in TOPOLOGY_FILES."""
    from rollway.topics.topology import with_diagram

    stale = []
    for name in TOPOLOGY_FILES:
        path = Path(name)
        current = path.read_text()
        wanted = with_diagram(current)
        if wanted != current:
            stale.append(name)
            if not check:
                path.write_text(wanted)
    if check and stale:
        print(f"rollway docs: the topology block of {', '.join(stale)} is stale (topics/topology.py changed); "
              "run `rollway docs topology`", file=sys.stderr)
        return 1
    print("topology block current in " + ", ".join(TOPOLOGY_FILES) if check else "\n".join(TOPOLOGY_FILES))
    return 0
