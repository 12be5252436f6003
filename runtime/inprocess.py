"""Episodes played in this process, no broker: each message goes to the rollout stage that consumes its topic
(topics/topology.py) until the trajectory comes out. `tasks verify`, the grader check and the benchmarks use it.
Each output must be one the broker would take (encoded and measured as a stage worker's producer does): one it
would refuse gets the actor's failure outputs instead, as in a stage worker (an episode too large for the
broker is graded 0 on the turns that fit)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import defaultdict
from typing import Any

from rollway.base.registry import import_target
from rollway.runtime.actor import MessageMeta, Output, OutputRefused
from rollway.runtime.kafka import topic_name
from rollway.runtime.telemetry import TelemetryLog
from rollway.runtime.worker import OutputSender, failure_outputs
from rollway.schemas.messages import EpisodeKey, InitRequest, Trajectory
from rollway.topics import INIT_REQUESTS, TRAJECTORIES
from rollway.topics.topology import STAGES, check_output, drain_stages


class InProcessDriver:
    """The rollout stages' actors (all but the issuing and the drain stages), built from `services` as a
    stage worker builds them, without a log reader; `async with` sets them up and closes them. Each topic
    is a one-partition log of the driver: offsets count from 0, a message's timestamp is when it was
    produced. Keep one driver per run folder (the reward stage's ledger there knows messages by offset).
    `telemetry` records each handling as a stage runtime does."""

    def __init__(self, services: Any, telemetry: TelemetryLog | None = None):
        self.topics, self.telemetry = services.cfg.topics, telemetry or TelemetryLog(None, "in-process")
        stages = [s for s in STAGES if not s.issues_work and s not in drain_stages()]
        self.actors = {s.name: import_target(s.actor)(services) for s in stages}
        self.reader = {t: s for s in stages for t in s.consumes}
        self.senders = {s.name: OutputSender(s.name, services.cfg, None, {}) for s in stages}  # type: ignore[arg-type]
        """Encoding only (nothing is produced): the size and encoding checks of a stage worker's producer."""
        self.offsets: defaultdict[Any, itertools.count] = defaultdict(itertools.count)
        self.services = services

    async def __aenter__(self) -> InProcessDriver:
        for actor in self.actors.values():
            await actor.setup()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for actor in self.actors.values():
            await actor.close()  # e.g. a harness episode's gateway, the docker sandbox's warm pool

    async def play(self, key: EpisodeKey, around: Any = None) -> Trajectory:
        """Episode `key` from its init request to its trajectory; RuntimeError if it failed. The request
        has no deadline (0): no scheduler here re-issues it. `around(stage, msg, meta)`, an async context
        manager, wraps each handling of a message (the benchmarks' gates; tests see the messages so)."""
        now = time.time()
        out = Output(INIT_REQUESTS, key.episode_id, InitRequest(episode=key, issued_at=now, deadline=0.0))
        sandbox: dict[str, Any] | None = None  # the attempt's, from the first stage that hands it on
        try:
            while out.topic in self.reader:
                stage = self.reader[out.topic]
                meta = MessageMeta(topic_name(out.topic, self.topics), 0, next(self.offsets[out.topic]), int(now * 1000))
                async with around(stage, out.value, meta) if around else contextlib.nullcontext():
                    started = time.time()  # after any wait for a free slot, as the stage runtimes record it
                    produced = await self.actors[stage.name].handle(out.value, meta)
                now = time.time()
                self.telemetry.record(meta.topic, 0, meta.offset, meta.timestamp_ms, None, out.value, started, now,
                                      stage=stage.name)
                if len(produced) != 1:  # init skips another run's episode
                    raise RuntimeError(f"task {key.task_id}: stage {stage.name} produced {len(produced)} messages, not 1")
                check_output(stage.name, produced[0].topic)
                try:
                    self.senders[stage.name].encode_all(produced)
                except OutputRefused as err:  # as runtime/worker.deliver: the actor's failure outputs instead
                    produced = failure_outputs(self.actors[stage.name], out.value, err)
                out = produced[0]
                sandbox = sandbox or getattr(out.value, "sandbox", None)
            if out.topic is not TRAJECTORIES:
                raise RuntimeError(f"task {key.task_id}: the episode failed: {out.value}")
        except BaseException:
            await self._discard(sandbox)
            raise
        return out.value

    async def _discard(self, handle: dict[str, Any] | None) -> None:
        """A failed attempt's sandbox, which no run's reaper removes after an in-process play (a stage worker's
        failure leaves it to one). The stage that failed may have removed it already."""
        if handle:
            with contextlib.suppress(Exception):
                await (await self.services.sandboxes.attach(handle)).destroy()
