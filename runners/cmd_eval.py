"""`rollway eval CONFIG`: k attempts per task, no training; pass@1 and pass@k to DIR/eval.json."""

from __future__ import annotations

import argparse
import json
import sys

from rollway.base.run_dir import RunDir, fresh_run_folder
from rollway.runners.common import add_config_arguments, load_or_exit

NAME = "eval"
HELP = ("Evaluate the policy: k attempts per task at a set temperature, pass@k into DIR/eval.json "
        "(a failed attempt counts as incorrect).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--run-dir", default=None, help="run folder (default runs/<name>-eval-<time>)")
    parser.add_argument("--bootstrap", default=None, help="use this Kafka cluster instead of the embedded broker")
    parser.add_argument("--workers", action="append", default=[], metavar="STAGE=N", help="processes per stage")


def eval_overrides(cfg) -> list[str]:
    """What turns a training config into an evaluation: one group of `attempts` per task, one pass,
    the evaluation temperature, and a learner that only records."""
    return [f"scheduler.group_size={cfg.eval.attempts}", "scheduler.epochs=1", "scheduler.num_tasks=null",
            f"agent.temperature={cfg.eval.temperature}", _record_learner(cfg)]


def _record_learner(cfg) -> str:
    """`learner.type=record`; a plugin learner's section is replaced by its LearnerConfig fields (its own
    options are not fields of `record`)."""
    from rollway.learning.config import LearnerConfig

    if type(cfg.learner) is LearnerConfig:
        return "learner.type=record"
    own = cfg.learner.model_dump(mode="json", include=set(LearnerConfig.model_fields) & cfg.learner.model_fields_set)
    return "learner=" + json.dumps({**own, "type": "record"})


def run(args: argparse.Namespace) -> int:
    from rollway.actors.scheduler import new_run_id
    from rollway.config.run import load_config
    from rollway.reports.eval_outputs import track_eval, write_eval
    from rollway.runners.cmd_up import prepare_run_dir
    from rollway.runners.up import JobFailed, parse_workers, run_job, write_run_files
    from rollway.runtime.broker import BrokerError, EmbeddedBroker
    from rollway.runtime.kafka import BrokerUnavailable

    base = load_or_exit(args, "eval")
    overrides = [*args.overrides, *eval_overrides(base)]
    cfg = load_config(args.config, overrides)
    cfg.run.id = cfg.run.id or new_run_id()
    args.run_dir = args.run_dir or str(fresh_run_folder(f"{cfg.run.name}-eval"))
    run_dir = prepare_run_dir(args, cfg, "eval")
    write_run_files(run_dir, cfg)
    broker = None
    try:
        if args.bootstrap is None and cfg.broker.bootstrap is None:
            broker = EmbeddedBroker(cfg.broker.port, log_path=RunDir(run_dir).broker_log).start()
        bootstrap = args.bootstrap or cfg.broker.bootstrap or broker.bootstrap
        run_job(cfg, args.config, overrides, bootstrap, run_dir, parse_workers(args.workers),
                own_broker=broker is not None)
    except (BrokerError, BrokerUnavailable, JobFailed, ValueError) as err:
        print(f"rollway eval: {err}", file=sys.stderr)
        return 1
    finally:
        if broker is not None:
            broker.stop()
    result = write_eval(run_dir, cfg)
    track_eval(run_dir, cfg, result)
    print(json.dumps({k: v for k, v in result.items() if k != "per_task"}))
    return 0
