"""`rollway stage NAME CONFIG`: one worker of one stage; start more to scale the stage."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rollway.runners.common import add_config_arguments, load_or_exit
from rollway.topics.topology import STAGE_NAMES as STAGES
from rollway.topics.topology import get_stage

NAME = "stage"
HELP = "Run one worker of one pipeline stage against a Kafka broker."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=STAGES, help="stage to run")
    add_config_arguments(parser)
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers, HOST:PORT")
    parser.add_argument("--run-dir", default=None, help="folder for this stage's files (default: run.dir or runs/<name>)")


def run(args: argparse.Namespace) -> int:
    from rollway.base.logging import configure_logging, register_secrets
    from rollway.config.run import secret_values
    from rollway.runners.stage import run_stage_sync
    from rollway.runtime.kafka import BrokerUnavailable

    cfg = load_or_exit(args, "stage")  # secrets come from the environment (SECRETS_ENV), never argv
    register_secrets(secret_values(cfg))
    run_dir = Path(args.run_dir or cfg.run.dir or f"runs/{cfg.run.name}")
    run_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(args.name, run_dir)
    if get_stage(args.name).ranks_setting and int(os.environ.get("RANK", "0")) > 0:
        from rollway.learning.distributed import run_follower  # a sharded learner's rank > 0: no broker

        return run_follower(cfg.learner, run_dir, cfg.scheduler.group_size)
    try:
        run_stage_sync(args.name, cfg, args.bootstrap, run_dir)
    except BrokerUnavailable as err:
        print(f"rollway stage {args.name}: {err}", file=sys.stderr)
        return 1
    return 0
