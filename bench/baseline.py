"""The baseline: bounded async batching. A fixed number of slots, each running one episode's init, agent
turns and grading in sequence with the real actors' `handle`, in-process, no broker. It records the same
telemetry as the stage runtimes (runtime/telemetry.py), a message's production being the end of the
handling that made it."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rollway.actors.scheduler import SchedulerActor, Ticket
from rollway.actors.services import Services
from rollway.base.run_dir import RunDir, worker_name
from rollway.config.run import RunConfig
from rollway.runtime.inprocess import InProcessDriver
from rollway.runtime.telemetry import TelemetryLog
from rollway.schemas.messages import Trajectory


@dataclass
class BaselineResult:
    trajectories: list[Trajectory]
    issued_at: dict[str, float]
    """Episode id -> when its slot started it."""
    started: float
    ended: float
    peak_busy_slots: int
    slots: int
    busy_slots_log: list[tuple[float, int]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return self.ended - self.started


class BatchDispatcher:
    """Runs episodes in the scheduler's order through `slots` slots; a slot takes the next episode
    only when its current one is graded (the bounded async batching of the reference system)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, slots: int):
        self.services = Services(cfg, run_dir)
        self.slots = slots
        self.busy = self.peak = 0
        self.busy_log: list[tuple[float, int]] = []
        self.issued_at: dict[str, float] = {}
        self.telemetry = TelemetryLog(RunDir(run_dir).telemetry_path("baseline", worker_name()), "baseline")
        self.driver = InProcessDriver(self.services, self.telemetry)

    async def plan(self) -> list[Ticket]:
        """The same episodes in the same order as the pipeline's scheduler issues them."""
        scheduler = SchedulerActor(self.services)
        await scheduler.setup()
        return [t for group in scheduler.groups for t in group]

    async def run(self) -> BaselineResult:
        queue = deque(await self.plan())
        results: list[Trajectory] = []
        started = time.time()
        try:
            async with self.driver:
                await asyncio.gather(*(self._slot(queue, results) for _ in range(self.slots)))
        finally:
            await self.services.inference.close()
            self.telemetry.close()
        ended = max(t.created_at for t in results) if results else time.time()
        return BaselineResult(results, self.issued_at, started, ended, self.peak, self.slots, self.busy_log)

    async def _slot(self, queue: deque[Ticket], results: list[Trajectory]) -> None:
        while queue:
            ticket = queue.popleft()
            self._count(+1)
            self.issued_at[ticket.episode_id] = time.time()
            try:
                results.append(await self.driver.play(ticket.key))
            finally:
                self._count(-1)

    def _count(self, delta: int) -> None:
        self.busy += delta
        self.peak = max(self.peak, self.busy)
        self.busy_log.append((time.time(), self.busy))


async def run_baseline(cfg: RunConfig, run_dir: Path, slots: int) -> BaselineResult:
    return await BatchDispatcher(cfg, run_dir, slots).run()
