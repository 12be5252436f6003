"""`rollway up CONFIG`: run a whole job on this machine and write the run folder."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rollway.runners.common import add_config_arguments, load_or_exit

NAME = "up"
HELP = "Run the whole pipeline on this machine (embedded broker unless --bootstrap) to completion."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--bootstrap", default=None, help="use this Kafka cluster instead of the embedded broker")
    parser.add_argument("--run-dir", default=None, help="run folder (default: run.dir or runs/<name>-<time>)")
    parser.add_argument("--workers", action="append", default=[], metavar="STAGE=N",
                        help="processes for a stage, e.g. --workers agent=2 (repeatable; default 1 each)")


def run(args: argparse.Namespace) -> int:
    from rollway.actors.scheduler import new_run_id
    from rollway.core.kafka import BrokerUnavailable
    from rollway.runners.broker import BrokerError, EmbeddedBroker
    from rollway.runners.progress import Progress
    from rollway.runners.up import Job, parse_workers, read_json, summarize, write_run_files

    cfg = load_or_exit(args, "up")
    cfg.run.id = cfg.run.id or new_run_id()
    run_dir = Path(args.run_dir or cfg.run.dir or f"runs/{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        workers = parse_workers(args.workers)
    except ValueError as err:
        print(f"rollway up: {err}", file=sys.stderr)
        return 2
    if (run_dir / "trajectories.jsonl").exists() or (run_dir / "summary.json").exists():
        print(f"rollway up: run folder {run_dir} already holds a run; choose another --run-dir or delete it",
              file=sys.stderr)
        return 2
    write_run_files(run_dir, cfg)
    broker = None
    if args.bootstrap is None and cfg.broker.bootstrap is None:
        try:
            broker = EmbeddedBroker(cfg.broker.port, log_path=run_dir / "logs" / "broker.out")
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            broker.start()
        except BrokerError as err:
            print(f"rollway up: {err}", file=sys.stderr)
            return 1
    bootstrap = args.bootstrap or cfg.broker.bootstrap or broker.bootstrap
    try:
        return _run_job(cfg, args, bootstrap, run_dir, workers, Job, Progress, read_json, summarize)
    except BrokerUnavailable as err:
        print(f"rollway up: {err}", file=sys.stderr)
        return 1
    finally:
        if broker is not None:
            broker.stop()


def _run_job(cfg, args, bootstrap, run_dir, workers, Job, Progress, read_json, summarize) -> int:
    import asyncio

    from rollway.core.kafka import ensure_topics

    asyncio.run(ensure_topics(cfg.broker, cfg.topics, bootstrap))
    job = Job(cfg, args.config, list(args.overrides), bootstrap, run_dir, workers)
    t0 = time.monotonic()
    job.start()
    print(f"rollway up: run {cfg.run.id} on {bootstrap}, run folder {run_dir}", file=sys.stderr)
    progress = Progress(total_hint=None)
    code = None
    try:
        while (code := job.scheduler_exit_code()) is None:
            if time.monotonic() - t0 > cfg.run.timeout_s:
                print(f"rollway up: timed out after {cfg.run.timeout_s:.0f}s (run.timeout_s)", file=sys.stderr)
                return 1
            for note in job.restart_dead_workers():
                print(f"rollway up: {note}", file=sys.stderr)
            progress.update(read_json(run_dir / "scheduler.json"), read_json(run_dir / "sink-status.json"))
            time.sleep(0.25)
        sched = read_json(run_dir / "scheduler.json")
        if code != 0 or not sched.get("done"):
            print(f"rollway up: the scheduler exited with code {code}; see {run_dir / 'logs'}", file=sys.stderr)
            return 1
        _wait_for_consumers(run_dir, sched["episodes_completed"], read_json)
    finally:
        progress.close()
        job.stop()
    summary = summarize(run_dir, cfg, time.monotonic() - t0, job)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("episodes_scheduled", "episodes_completed", "episodes_failed",
                                              "reward_mean", "wall_seconds")}))
    return 0


def _wait_for_consumers(run_dir: Path, completed: int, read_json, timeout_s: float = 60.0) -> None:
    """The scheduler has seen every outcome; wait until the sink and learner have too."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sink = read_json(run_dir / "sink-status.json").get("episodes_written", 0)
        learner = read_json(run_dir / "learner-status.json").get("episodes_received", 0)
        if sink >= completed and learner >= completed:
            return
        time.sleep(0.2)
    print("rollway up: sink/learner did not catch up within 60s; the summary may be incomplete", file=sys.stderr)
