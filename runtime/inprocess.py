"""Episodes played in this process, no broker: each message goes to the rollout stage that consumes its
topic (topics/topology.py) until one comes out that no rollout stage reads, the trajectory or the
episode's failure. `rollway tasks verify`, the grader check, the benchmarks and tests play episodes so."""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from rollway.base.registry import import_target
from rollway.runtime.actor import Actor, MessageMeta, Output
from rollway.runtime.kafka import topic_name
from rollway.schemas.messages import EpisodeKey, InitRequest, Message, Trajectory
from rollway.topics import TRAJECTORIES
from rollway.topics.topology import STAGES, Stage, check_output, drain_stages, issuing_stage

Around = Callable[[Stage, Message, MessageMeta], contextlib.AbstractAsyncContextManager]
"""Wraps one handling (`stage`, its input, where the input sits): the benchmarks' gates and telemetry."""


class EpisodeFailed(RuntimeError):
    """The episode ended in a failure, or a stage produced no single next message for it."""


def solo_key(task_id: str, prefix: str) -> EpisodeKey:
    """A fresh one-episode group on `task_id`."""
    episode_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
    return EpisodeKey(episode_id=episode_id, group_id=episode_id, task_id=task_id)


class InProcessDriver:
    """The rollout stages' actors (every stage but the issuer and the drain stages), built from
    `services` as a stage worker builds them (without a log reader). Each topic is a one-partition log
    of this driver: offsets count from 0, a message's timestamp is when it was produced. Keep one
    driver per run folder: the reward stage's ledger there knows handled messages by offset.
    `async with` sets the actors up and closes them."""

    def __init__(self, services: Any):
        self.services = services
        stages = [s for s in STAGES if not s.issues_work and s not in drain_stages()]
        self.actors: dict[str, Actor] = {s.name: import_target(s.actor)(services) for s in stages}
        self.reader = {t: s for s in stages for t in s.consumes}
        self.entry = next(t for t in issuing_stage().produces if t in self.reader)
        self.offsets: defaultdict[Any, itertools.count] = defaultdict(itertools.count)

    async def __aenter__(self) -> InProcessDriver:
        for actor in self.actors.values():
            await actor.setup()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for actor in self.actors.values():
            await actor.close()  # e.g. a harness episode's gateway, the docker sandbox's warm pool

    async def play(self, key: EpisodeKey, deadline_s: float | None = None, around: Around | None = None,
                   outputs: list[Output] | None = None) -> Trajectory:
        """Episode `key` from its init request (deadline `deadline_s` away, None: the scheduler's) to
        its trajectory. `outputs` collects every produced message in order. Raises EpisodeFailed;
        an actor's error propagates."""
        now = time.time()
        deadline = now + (self.services.cfg.scheduler.episode_deadline_s if deadline_s is None else deadline_s)
        out, produced_at = Output(self.entry, key.episode_id, InitRequest(episode=key, issued_at=now, deadline=deadline)), now
        while out.topic in self.reader:
            stage = self.reader[out.topic]
            meta = MessageMeta(topic_name(out.topic, self.services.cfg.topics), 0, next(self.offsets[out.topic]),
                               int(produced_at * 1000))
            async with around(stage, out.value, meta) if around else contextlib.nullcontext():
                produced = await self.actors[stage.name].handle(out.value, meta)
            produced_at = time.time()
            if len(produced) != 1:
                raise EpisodeFailed(f"task {key.task_id}: stage {stage.name} produced {len(produced)} messages for "
                                    f"episode {key.episode_id}, not one (another run's, or past its deadline?)")
            out = produced[0]
            check_output(stage.name, out.topic)
            if outputs is not None:
                outputs.append(out)
        if out.topic is not TRAJECTORIES:
            raise EpisodeFailed(f"task {key.task_id}: the episode failed: {out.value}")
        return out.value
