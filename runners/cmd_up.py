"""`rollway up CONFIG`: run a whole job on this machine and write the run folder."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from rollway.base.run_dir import RunDir, fresh_run_folder
from rollway.runners.common import add_config_arguments, load_or_exit

NAME = "up"
HELP = "Run the whole pipeline on this machine (embedded broker unless --bootstrap) to completion."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--bootstrap", default=None, help="use this Kafka cluster instead of the embedded broker")
    parser.add_argument("--run-dir", default=None, help="run folder (default: run.dir or runs/<name>-<time>)")
    parser.add_argument("--workers", action="append", default=[], metavar="STAGE=N",
                        help="processes for a stage, e.g. --workers agent=2 (repeatable; default 1 each)")
    parser.add_argument("--no-report", action="store_true",
                        help="skip drawing report.html and plots/ at the end (`rollway report DIR` draws them later)")


def prepare_run_dir(args: argparse.Namespace, cfg, prog: str) -> Path:
    """The run folder: new, or at least not holding another run's results."""
    run_dir = Path(args.run_dir or cfg.run.dir or fresh_run_folder(cfg.run.name))
    if RunDir(run_dir).trajectories.exists() or RunDir(run_dir).summary.exists():
        print(f"rollway {prog}: run folder {run_dir} already holds a run; choose another --run-dir or delete it",
              file=sys.stderr)
        raise SystemExit(2)
    return run_dir


EXIT_GRACE_S = 30.0
"""Time the process may take to exit once the job ended (its run folder is written)."""


def exit_soon(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Make sure the process ends once the job has: a thread of a one-process job's stage that is stuck
    in a blocking call (Python cannot stop it, and the interpreter waits for such threads at exit) must
    not keep `rollway up` running past `run.timeout_s`. After `grace_s` the process exits with `code`.
    Only in the `rollway` command's own process (a program that calls `run` keeps its process)."""
    from rollway.runners.cli import main

    if getattr(sys.modules.get("__main__"), "main", None) is not main:
        return

    def hard_exit() -> None:
        stuck = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]
        print(f"rollway up: threads still blocked {grace_s:.0f}s after the job ended ({', '.join(stuck) or 'none'}); "
              "exiting without them", file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(grace_s, hard_exit)
    timer.daemon = True
    timer.start()


def run(args: argparse.Namespace) -> int:
    from rollway.actors.scheduler import new_run_id
    from rollway.base.logging import configure_logging
    from rollway.runners.report_worker import ReportWorker
    from rollway.runners.up import JobFailed, parse_workers, run_job, write_run_files
    from rollway.runtime.broker import BrokerError, EmbeddedBroker
    from rollway.runtime.kafka import BrokerUnavailable

    cfg = load_or_exit(args, "up")
    cfg.run.id = cfg.run.id or new_run_id()
    run_dir = prepare_run_dir(args, cfg, "up")
    try:
        workers = parse_workers(args.workers)
    except ValueError as err:
        print(f"rollway up: {err}", file=sys.stderr)
        return 2
    write_run_files(run_dir, cfg)
    configure_logging("up", run_dir)
    # Loads the plotting library on the other core while the stages run.
    reporter = None if args.no_report else ReportWorker(run_dir).start()
    broker = None
    try:
        if args.bootstrap is None and cfg.broker.bootstrap is None:
            broker = EmbeddedBroker(cfg.broker.port, log_path=RunDir(run_dir).broker_log).start()
        bootstrap = args.bootstrap or cfg.broker.bootstrap or broker.bootstrap
        summary = run_job(cfg, args.config, list(args.overrides), bootstrap, run_dir, workers,
                          own_broker=broker is not None)
        if reporter is not None:
            reporter.draw()  # while the broker stops
    except (BrokerError, BrokerUnavailable, JobFailed) as err:
        print(f"rollway up: {err}", file=sys.stderr)
        exit_soon(1)
        return 1
    finally:
        if broker is not None:
            broker.stop()
        if reporter is not None:
            reporter.finish()
    exit_soon(0)
    print(json.dumps({k: summary[k] for k in ("episodes_scheduled", "episodes_completed", "episodes_failed",
                                              "reward_mean", "wall_seconds")}))
    return 0
