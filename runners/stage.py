"""Build and run one stage worker (used by `rollway stage` and by `rollway up`'s child processes)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from rollway.actors import STAGES
from rollway.actors.base import Actor
from rollway.actors.services import Services
from rollway.core.config import RunConfig
from rollway.core.kafka import ensure_topics, stage_group_id
from rollway.core.run_dir import RunDir
from rollway.runners.stage_runtime import LogReader, StageWorker


def build_actor(name: str, services: Services, log_reader: LogReader | None) -> Actor:
    if name == "scheduler":
        from rollway.actors.scheduler import SchedulerActor
        from rollway.runners.topic_scan import StreamingTopicScanner

        return SchedulerActor(services, StreamingTopicScanner(services.cfg, log_reader.bootstrap) if log_reader else None)
    if name == "init":
        from rollway.actors.init import InitActor

        return InitActor(services)
    if name == "agent":
        from rollway.actors.agent import AgentActor

        return AgentActor(services, log_reader)
    if name == "reward":
        from rollway.actors.reward import RewardActor

        return RewardActor(services)
    if name == "learner":
        from rollway.actors.learner import LearnerActor

        return LearnerActor(services)
    if name == "sink":
        from rollway.actors.sink import SinkActor

        return SinkActor(services)
    raise ValueError(f"unknown stage {name!r}; stages are: {', '.join(STAGES)}")


def stage_inputs(name: str) -> tuple:
    """The topics the learner or the sink consumes (class attributes: no actor is built)."""
    from rollway.actors.learner import LearnerActor
    from rollway.actors.sink import SinkActor

    return {"learner": LearnerActor, "sink": SinkActor}[name].inputs


def stage_concurrency(name: str, cfg: RunConfig) -> int:
    """Messages a worker of this stage handles at once."""
    if name == "agent":
        from rollway.actors.scheduling import agent_worker_slots

        return agent_worker_slots(cfg)
    section = {"init": cfg.init, "reward": cfg.reward}.get(name)
    return section.concurrency if section is not None else 1


def stage_prefetch(name: str, cfg: RunConfig) -> int:
    section = {"init": cfg.init, "agent": cfg.agent, "reward": cfg.reward}.get(name)
    return section.prefetch if section is not None else 0


def group_id(name: str, cfg: RunConfig) -> str:
    """Every stage's group belongs to its run (core/kafka.py: stage_group_id)."""
    return stage_group_id(name, cfg.topics, cfg.run.id)


async def run_stage(name: str, cfg: RunConfig, bootstrap: str, run_dir: Path, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await ensure_topics(cfg.broker, cfg.topics, bootstrap)
    log_reader = LogReader(cfg, bootstrap) if name in ("agent", "scheduler") else None
    services = Services(cfg, run_dir)
    actor = build_actor(name, services, log_reader)
    try:
        status = RunDir(run_dir).worker_status_path(name, os.getpid())
        telemetry = RunDir(run_dir).telemetry_path(name, os.getpid())
        if cfg.runtime.engine_for(name) == "faust":
            from rollway.runners.faust_runtime import run_faust_worker  # imports faust only when chosen

            await run_faust_worker(actor, cfg, bootstrap, stage_concurrency(name, cfg), group_id(name, cfg),
                                   run_dir, stop, status_path=status, prefetch=stage_prefetch(name, cfg),
                                   telemetry_path=telemetry)
            return
        await StageWorker(actor, cfg, bootstrap, stage_concurrency(name, cfg), group_id(name, cfg),
                          prefetch=stage_prefetch(name, cfg), telemetry_path=telemetry, status_path=status).run(stop)
    finally:
        if log_reader is not None:
            await log_reader.close()
        await services.close()


def run_stage_sync(name: str, cfg: RunConfig, bootstrap: str, run_dir: Path) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(run_stage(name, cfg, bootstrap, run_dir))
