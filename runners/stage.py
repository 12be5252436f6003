"""Build and run one stage worker (used by `rollway stage` and by `rollway up`'s child processes)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from rollway.actors.services import Services
from rollway.base.registry import import_target
from rollway.base.run_dir import RunDir, worker_name
from rollway.config.run import RunConfig
from rollway.runtime.actor import Actor
from rollway.runtime.kafka import ensure_topics, stage_group_id
from rollway.runtime.metrics import MetricsServer
from rollway.runtime.worker import LogReader, StageWorker
from rollway.topics.topology import get_stage


def build_actor(name: str, services: Services, log_reader: LogReader | None) -> Actor:
    """The actor topics/topology.py declares for stage `name`, built from the services (and the log
    reader, for stages that read the log back)."""
    stage = get_stage(name)
    actor_class = import_target(stage.actor)
    if stage.reads_log == "stream":  # its inputs streamed back on restart (runtime/scan.py)
        from rollway.runtime.scan import StreamingTopicScanner

        return actor_class(services, StreamingTopicScanner(services.cfg, log_reader.bootstrap) if log_reader else None)
    return actor_class(services, log_reader) if stage.reads_log == "history" else actor_class(services)


def _setting(cfg: RunConfig, dotted: str) -> object:
    value: object = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def stage_concurrency(name: str, cfg: RunConfig) -> int:
    """Messages a worker of this stage handles at once: the setting its declaration names."""
    setting = get_stage(name).concurrency
    if setting is None:
        return 1
    if setting == "agent.concurrency":  # a turn beyond the model-call slots overlaps its tool calls
        return int(_setting(cfg, setting)) + cfg.agent.tool_overlap
    return int(_setting(cfg, setting))


def stage_prefetch(name: str, cfg: RunConfig) -> int:
    """Messages fetched beyond the concurrency: the `prefetch` of the section that sets it."""
    setting = get_stage(name).concurrency
    return int(getattr(_setting(cfg, setting.split(".")[0]), "prefetch", 0)) if setting else 0


def group_id(name: str, cfg: RunConfig) -> str:
    """Every stage's group belongs to its run (runtime/kafka.py: stage_group_id)."""
    return stage_group_id(name, cfg.topics, cfg.run.id)


async def run_stage(name: str, cfg: RunConfig, bootstrap: str, run_dir: Path, stop: asyncio.Event | None = None,
                    *, sole_worker: bool = False) -> None:
    """One worker of stage `name` until `stop` is set (or, for the scheduler, the job is done). With no
    `stop` given it is the process's only stage and stops on SIGINT/SIGTERM. `sole_worker`: the stage's
    only worker (a one-process job): it takes every partition instead of joining the group."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
    await ensure_topics(cfg.broker, cfg.topics, bootstrap)
    server = MetricsServer.acquire(cfg.metrics, run_dir, cfg.run.id)
    clean = False
    try:
        await _run_actor(name, cfg, bootstrap, run_dir, stop, sole_worker)
        clean = True
    finally:
        if server is not None:
            await server.release(clean)


async def _run_actor(name: str, cfg: RunConfig, bootstrap: str, run_dir: Path, stop: asyncio.Event,
                     sole_worker: bool) -> None:
    log_reader = LogReader(cfg, bootstrap) if get_stage(name).reads_log != "no" else None
    services = Services(cfg, run_dir)
    actor = build_actor(name, services, log_reader)
    try:
        status = RunDir(run_dir).worker_status_path(name, worker_name())
        telemetry = RunDir(run_dir).telemetry_path(name, worker_name())
        if cfg.runtime.engine_for(name) == "faust":
            from rollway.runtime.faust import run_faust_worker  # imports faust only when chosen

            await run_faust_worker(actor, cfg, bootstrap, stage_concurrency(name, cfg), group_id(name, cfg),
                                   run_dir, stop, status_path=status, prefetch=stage_prefetch(name, cfg),
                                   telemetry_path=telemetry)
            return
        await StageWorker(actor, cfg, bootstrap, stage_concurrency(name, cfg), group_id(name, cfg),
                          prefetch=stage_prefetch(name, cfg), telemetry_path=telemetry, status_path=status,
                          sole_worker=sole_worker).run(stop)
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
