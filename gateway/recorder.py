"""Where captured calls go before the program sees a response: the log (Kafka) or memory (tests)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from rollway.schemas import encode
from rollway.schemas.messages import CapturedCall


class RecordFailed(RuntimeError):
    """The call could not be written and acknowledged; the program gets 503 and may retry."""

    infrastructure = True
    """Observed from outside the sandbox: never the agent's doing (base/blame.py)."""


class RecordTooLarge(RecordFailed):
    """The encoded call exceeds the broker's message size limit: the program's call made it so (answered
    413), so it does not inherit the infrastructure mark."""

    infrastructure = False


class CallRecorder(ABC):
    """Writes each captured call durably. The gateway awaits `record` before answering the call, so
    an answered call is always in the record; `record` raises RecordFailed when it cannot say so."""

    @abstractmethod
    async def record(self, call: CapturedCall) -> None:
        """Return only once `call` is durably written."""

    async def close(self) -> None:
        """Release connections."""


class MemoryRecorder(CallRecorder):
    """Keeps calls in a list (unit tests and benchmarks of the gateway alone; not durable)."""

    def __init__(self) -> None:
        self.calls: list[CapturedCall] = []

    async def record(self, call: CapturedCall) -> None:
        self.calls.append(call)

    def of(self, episode_id: str) -> list[CapturedCall]:
        return [c for c in self.calls if c.episode_id == episode_id]


class KafkaRecorder(CallRecorder):
    """Produces each call to the gateway-calls topic keyed by episode id and waits for the broker's
    acknowledgement (acks=all, idempotent where the broker allows: rollway's producer)."""

    def __init__(self, producer: Any, topic: str, max_message_bytes: int):
        self.producer, self.topic, self.max_message_bytes = producer, topic, max_message_bytes

    @classmethod
    async def connect(cls, broker: Any, topics: Any, bootstrap: str) -> KafkaRecorder:
        """A recorder on `bootstrap` with rollway's producer; creates the topic when missing.
        `broker` and `topics` are the run's BrokerConfig and TopicsConfig."""
        from rollway.runtime.kafka import ensure_topics, make_producer, topic_name
        from rollway.topics import GATEWAY_CALLS

        await ensure_topics(broker, topics, bootstrap, (GATEWAY_CALLS,))
        producer = await make_producer(broker, bootstrap)
        return cls(producer, topic_name(GATEWAY_CALLS, topics), broker.max_message_bytes)

    async def record(self, call: CapturedCall) -> None:
        from aiokafka.errors import KafkaError

        value = encode(call)
        # The record batch adds its own headers: keep a margin under the broker's limit.
        if len(value) + 1024 > self.max_message_bytes:
            raise RecordTooLarge(f"call {call.call_index} of episode {call.episode_id} encodes to {len(value)} "
                                 f"bytes, over broker.max_message_bytes={self.max_message_bytes}: shorten the "
                                 "prompt or raise broker.max_message_bytes")
        try:
            await self.producer.send_and_wait(self.topic, value, key=call.episode_id.encode())
        except KafkaError as err:
            raise RecordFailed(f"the log did not acknowledge call {call.call_index} of episode "
                               f"{call.episode_id}: {type(err).__name__}: {err}") from err

    async def close(self) -> None:
        await self.producer.stop()
