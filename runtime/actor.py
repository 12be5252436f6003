"""The actor contract: plain async logic between a decoded input message and its outputs."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from rollway.base.redaction import redact
from rollway.schemas.messages import EpisodeFailure, EpisodeMessage, Message
from rollway.topics import EPISODE_FAILURES, TopicSpec


@dataclass(frozen=True)
class Output:
    """One message to produce. `key` is the episode id on per-episode topics."""

    topic: TopicSpec
    key: str | None
    value: Message


@dataclass(frozen=True)
class MessageMeta:
    """Where an input message came from (for rebuilds and dead letters)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int = 0


class _FromStage:
    """`name` and `inputs` of a pipeline actor, read from its stage in topics/topology.py (an actor
    never declares them again); an actor outside the pipeline (a test's) sets both as class attributes."""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj: Any, owner: type) -> Any:
        from rollway.topics.topology import stage_of_actor

        stage = stage_of_actor(owner)
        if stage is None:
            raise AttributeError(f"{owner.__name__} is not a stage in topics/topology.py: give it `name` and `inputs`")
        return stage.name if self.attr == "name" else stage.consumes


class Actor(ABC):
    """One pipeline stage. The runner consumes `inputs`, calls `handle` once per message (up to the
    stage's concurrency at a time, one at a time per key), produces the outputs, then commits.
    A pipeline actor's `name` and `inputs` come from its stage (topics/topology.py)."""

    name: str = _FromStage()  # type: ignore[assignment]
    inputs: tuple[TopicSpec, ...] = _FromStage()  # type: ignore[assignment]

    async def setup(self) -> None:
        """Called once before the first message."""

    @abstractmethod
    async def handle(self, msg: Any, meta: MessageMeta) -> list[Output]:
        """Process one message; raise to dead-letter it (the runner also reports an episode failure
        through `on_error`)."""

    priority_epoch = 0
    """Bumped by an actor whose ranking rule changed (from inside `priority`): the runtime then
    ranks the messages it already queued again."""

    def priority(self, msg: Any) -> float:
        """Order of queued messages when the stage prefetches (`prefetch` > 0): higher runs first."""
        return 0.0

    def on_error(self, msg: Any, error: BaseException) -> list[Output]:
        """Extra outputs when `handle` raised for a decoded message (e.g. an EpisodeFailure)."""
        return []

    def held_offsets(self) -> set[tuple[str, int, int]]:
        """(topic, partition, offset) of handled messages whose effect is not durable yet (e.g.
        buffered for a later training step); the runner does not commit past them."""
        return set()

    async def tick(self) -> list[Output]:
        """Called periodically by the runner (the scheduler issues work here)."""
        return []

    @property
    def done(self) -> bool:
        """True when this actor has nothing left to do and its worker may exit."""
        return False

    async def close(self) -> None:
        """Called once at shutdown."""


MAX_FAILURE_REASON_CHARS = 2000
"""A failure's reason is cut to this: the error text may quote hostile model output."""


def failure_output(msg: EpisodeMessage, stage: str, error: BaseException, retryable: bool = True) -> Output:
    """Tell the scheduler this attempt failed in `stage` (it re-issues or records the failure). An
    output the broker refused is not retryable: the same policy would likely write it again."""
    reason = f"{type(error).__name__}: {error}"[:MAX_FAILURE_REASON_CHARS]
    return Output(EPISODE_FAILURES, msg.episode_id, EpisodeFailure(
        episode=msg.episode, stage=stage, reason=redact(reason),  # it crosses the broker
        retryable=retryable and not isinstance(error, OutputRefused),
        at=time.time()))


class OutputRefused(Exception):
    """An output that no retry can deliver: it cannot be encoded (an integer beyond 64 bits), it is
    larger than `broker.max_message_bytes`, or the broker refused it for what it is. The runtime
    dead-letters the input with this reason and produces the actor's `on_error` outputs instead."""

    output: Output | None = None
    """The refused output (set by the runtime), for an `on_error` that delivers a smaller one instead."""
    room: int = 0
    """Bytes a message's key and value may take on this broker (set by the runtime)."""


class StaleMessage(Exception):
    """Raised by `handle` for a redelivery rollway expects (a turn of an attempt that already ended,
    whose sandbox is gone): the runtime skips it with an info line, produces nothing, dead-letters
    nothing and commits past it. The message says why it is stale."""


class FatalActorError(RuntimeError):
    """Raised by `handle`/`tick` when the actor's in-memory state can no longer be trusted (e.g. a
    training step failed after its groups left the buffer). The runtime does not dead-letter it: the
    worker exits with an error, its uncommitted offsets are redelivered to its restart."""

    infrastructure = True
    """Observed from outside the sandbox: never the agent's doing (base/blame.py)."""
