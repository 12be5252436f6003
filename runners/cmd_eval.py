"""`rollway eval CONFIG`: k attempts per task, no training; pass@1 and pass@k to DIR/eval.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollway.base.redaction import redact_data
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


def write_eval(run_dir: Path, cfg, task_ids: list[str] | None = None) -> dict:
    """pass@k over every scheduled attempt (`attempts` per task of the task set, as the eval
    overrides schedule them): a failed or unfinished attempt counts as incorrect, and the reasons
    of the failed ones are reported."""
    from collections import Counter

    from rollway.actors.sink import belongs_to_run
    from rollway.learning.passk import evaluate_scheduled

    if task_ids is None:
        from rollway.envs.factory import build_taskset

        task_ids = [t.task_id for t in build_taskset(cfg.tasks).tasks()]
    trajs = {t["episode"]["episode_id"]: t for t in read_jsonl(RunDir(run_dir).trajectories)
             if belongs_to_run(t["episode"]["episode_id"], cfg.run.id)}
    last_failure = {f["episode"]["episode_id"]: f for f in read_jsonl(RunDir(run_dir).failures)
                    if belongs_to_run(f["episode"]["episode_id"], cfg.run.id)}
    reasons = Counter(_reason(f)[:200] for eid, f in last_failure.items() if eid not in trajs)
    ks = sorted({*cfg.eval.ks, cfg.eval.attempts})
    completed = [(t["episode"]["task_id"], bool(t["resolved"])) for t in trajs.values()]
    result = {"temperature": cfg.eval.temperature, "attempts_per_task": cfg.eval.attempts,
              "reward_mean": round(sum(t["reward"] for t in trajs.values()) / len(trajs), 6) if trajs else None,
              **evaluate_scheduled(dict.fromkeys(task_ids, cfg.eval.attempts), completed, ks),
              "failure_reasons": dict(reasons.most_common())}
    if cfg.tasks.type in ("swebench", "harbor"):
        from rollway.reports.eval_outputs import write_atif, write_predictions

        reasons_by_task = {f["episode"]["task_id"]: _reason(f) for eid, f in last_failure.items() if eid not in trajs}
        report = write_predictions(run_dir, cfg, task_ids, list(trajs.values()), reasons_by_task)
        result["swebench"] = {k: report[k] for k in ("resolved_instances", "unresolved_instances", "error_instances")}
        result["atif_files"] = write_atif(run_dir, cfg, list(trajs.values()))
    RunDir(run_dir).eval_result.write_text(json.dumps(redact_data(result), indent=1))
    return result


def read_jsonl(path: Path) -> list[dict]:
    from rollway.base.run_dir import read_records

    return read_records(path)


def run(args: argparse.Namespace) -> int:

    from rollway.actors.scheduler import new_run_id
    from rollway.config.run import load_config
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


def track_eval(run_dir: Path, cfg, result: dict) -> None:
    """The evaluation's figures to `tracking.trackers` (the run's tracker run): `eval/pass_at_K` overall and
    `eval/SOURCE/pass_at_K` per task source (learning/passk.py), `eval/reward_mean`."""
    from rollway.config.run import dump_config
    from rollway.learning.tracking import TrackingHub

    hub = TrackingHub.for_run(cfg.tracking, run_dir, cfg.run.name, cfg.run.id, dump_config(cfg))
    if hub is None:
        return
    figures = {"eval/reward_mean": result["reward_mean"]}
    for prefix, row in [("eval", result), *((f"eval/{s}", r) for s, r in result["per_source"].items())]:
        figures.update({f"{prefix}/{k.replace('@', '_at_')}": v for k, v in row.items() if k.startswith("pass@")})
    hub.log(0, figures)
    hub.close()


def _reason(failure: dict) -> str:
    """"stage: reason"; the scheduler's final verdict already names the stage the attempt failed in."""
    from rollway.actors.scheduler import GIVE_UP_STAGE

    return failure["reason"] if failure["stage"] == GIVE_UP_STAGE else f"{failure['stage']}: {failure['reason']}"
