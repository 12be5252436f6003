"""Argument and config helpers shared by the runners."""

from __future__ import annotations

import argparse
import sys

from rollway.config.run import ConfigError, RunConfig, load_config


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    parser.add_argument("config", nargs=None if config_required else "?", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. agent.max_turns=8 scheduler.group_size=4")


def load_or_exit(args: argparse.Namespace, prog: str) -> RunConfig:
    """Load the config; on a bad file or key print the message and exit 2."""
    try:
        return load_config(getattr(args, "config", None), args.overrides)
    except ConfigError as err:
        print(f"rollway {prog}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
