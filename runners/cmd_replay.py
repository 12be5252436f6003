"""`rollway replay TOPIC`: read any topic back as decoded JSON lines, with partition and offset;
`rollway replay --rerun EPISODE`: re-run a recorded episode's tool calls in a fresh sandbox."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

NAME = "replay"
HELP = ("Print the decoded messages of a topic (JSON lines with partition and offset), or re-run a recorded "
        "episode against a fresh sandbox (--rerun).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", nargs="?", default=None,
                        help="topic name without prefix, e.g. trajectories, agent-steps, dead-letters; with "
                             "--rerun: an optional CONFIG (default: RUN_DIR/config.json)")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers, HOST:PORT")
    parser.add_argument("--episode", default=None, help="only messages of this episode id")
    parser.add_argument("--from-offset", type=int, default=None, help="start at this offset in every partition")
    parser.add_argument("--partition", type=int, default=None, help="only this partition")
    parser.add_argument("--limit", type=int, default=None, help="stop after this many messages")
    parser.add_argument("--json", action="store_true", help="JSON lines (the default output is also JSON lines)")
    parser.add_argument("--topic-prefix", default="", help="topics.prefix of the run")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds to keep retrying an unreachable broker")
    rerun = parser.add_argument_group("re-run an episode (exit 0: every observation matches, 1: some differ)")
    rerun.add_argument("--rerun", metavar="EPISODE", default=None,
                       help="re-run this episode's recorded model outputs through the tools in a fresh sandbox")
    rerun.add_argument("--run-dir", default=None, help="run folder holding the episode (trajectories.jsonl)")
    rerun.add_argument("--exact", action="store_true",
                       help="compare byte for byte (default: file times and durations are ignored)")
    rerun.add_argument("--ignore", action="append", default=[], metavar="REGEX",
                       help="also ignore text matching this regular expression (repeatable)")
    parser.set_defaults(overrides=[])  # dotted config overrides for --rerun (`sandbox.root=...`)


def rerun_config(args: argparse.Namespace):
    """The config the episode ran with: CONFIG if given, else the run folder's config.json."""
    from rollway.base.run_dir import RunDir
    from rollway.runners.common import load_or_exit

    config = args.topic or (str(RunDir(args.run_dir).config) if args.run_dir else None)
    if config is None:
        print("rollway replay: --rerun with --bootstrap needs the run's CONFIG (or --run-dir)", file=sys.stderr)
        raise SystemExit(2)
    return load_or_exit(argparse.Namespace(config=config, overrides=args.overrides), "replay")


def run_rerun(args: argparse.Namespace) -> int:
    from rollway.audit.rerun import (
        NotRerunnable,
        check_rerunnable,
        format_result,
        normalizer,
        rerun_episode,
    )
    from rollway.reports.episodes import EpisodeNotFound, find_episode, load_run_dir, load_topic
    from rollway.schemas.codec import DecodeError

    cfg = rerun_config(args)
    try:
        if args.bootstrap:
            prefix = args.topic_prefix or cfg.topics.prefix
            source, trajs = f"{prefix}trajectories", load_topic(args.bootstrap, prefix, args.rerun, args.timeout)
        else:
            source, trajs = str(args.run_dir), load_run_dir(Path(args.run_dir))
        traj = find_episode(trajs, args.rerun, source)
        check_rerunnable(traj)
    except (FileNotFoundError, EpisodeNotFound, DecodeError, NotRerunnable) as err:
        print(f"rollway replay: {err}", file=sys.stderr)
        return 2
    result = asyncio.run(rerun_episode(traj, cfg, normalizer(args.exact, args.ignore)))
    print(json.dumps(result.to_json()) if args.json else format_result(result))
    return 1 if result.differences else 0


def run(args: argparse.Namespace) -> int:
    from rollway.reports.episodes import read_topic
    from rollway.runtime.kafka import BrokerUnavailable

    if args.rerun:
        if not args.run_dir and not args.bootstrap:
            print("rollway replay: --rerun needs --run-dir DIR or --bootstrap HOST:PORT", file=sys.stderr)
            return 2
        try:
            return run_rerun(args)
        except BrokerUnavailable as err:
            print(f"rollway replay: {err}", file=sys.stderr)
            return 2
    if args.topic is None or args.bootstrap is None or args.overrides:
        print("rollway replay: give TOPIC --bootstrap HOST:PORT (key=value overrides only go with --rerun)",
              file=sys.stderr)
        return 2

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")

    try:
        return asyncio.run(read_topic(args, emit))
    except BrokerUnavailable as err:
        print(f"rollway replay: {err}", file=sys.stderr)
        return 1
    except KeyError as err:
        print(f"rollway replay: {err.args[0]}", file=sys.stderr)
        return 2
