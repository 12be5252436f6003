"""`rollway show DIR`: view recorded episodes turn by turn (terminal or HTML), from a run folder or topic."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "show"
HELP = "Show recorded episodes turn by turn (model output, tool calls, observations, reward) in the terminal or as HTML."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", default=None, help="run folder (holds trajectories.jsonl)")
    parser.add_argument("--episode", default=None, help="episode id (default: list the episodes, show the first)")
    parser.add_argument("--html", default=None, metavar="OUT", help="write HTML to OUT instead of printing")
    parser.add_argument("--bootstrap", default=None, help="read the trajectories topic on this broker instead")
    parser.add_argument("--topic-prefix", default="", help="topics.prefix of the run (with --bootstrap)")
    parser.add_argument("--max-chars", type=int, default=2000, help="clip longer texts to this (0: never)")


def load(args: argparse.Namespace) -> tuple[list[dict], str]:
    from rollway.reports.episodes import load_run_dir, load_topic

    if args.bootstrap:
        return load_topic(args.bootstrap, args.topic_prefix, args.episode), f"{args.topic_prefix}trajectories"
    if not args.run_dir:
        raise FileNotFoundError("give a run folder or --bootstrap HOST:PORT")
    return load_run_dir(Path(args.run_dir)), str(args.run_dir)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rollway.base.redaction import redact
    from rollway.reports.episodes import EpisodeNotFound, find_episode
    from rollway.reports.show import episode_stage_seconds, render, render_html
    from rollway.runtime.kafka import BrokerUnavailable
    from rollway.schemas.codec import DecodeError

    try:
        trajs, source = load(args)
        if not trajs:
            print(f"rollway show: no episodes in {source}", file=sys.stderr)
            return 1
        episode = find_episode(trajs, args.episode, source) if args.episode else trajs[0]
    except (FileNotFoundError, EpisodeNotFound, BrokerUnavailable, DecodeError) as err:
        print(f"rollway show: {err}", file=sys.stderr)
        return 2
    listing = args.episode is None
    seconds = None if args.bootstrap else episode_stage_seconds(Path(args.run_dir), episode)
    if args.html:
        Path(args.html).write_text(redact(render_html(trajs, episode, listing, args.max_chars, seconds)))
        print(args.html)
    else:
        render(trajs, episode, listing, args.max_chars, Console(), seconds)
    return 0
