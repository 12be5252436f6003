"""Streams a whole topic from its beginning to its current end, one decoded message at a time (the
scheduler rebuilds its state from it after a restart, keeping only what it needs per episode), and
fails loudly when the scan cannot finish: a scheduler that went on from half the log would issue
again what it had issued, or wait for episodes it never issued."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from rollway.runtime.kafka import make_consumer, read_to_end, topic_name, topic_partitions
from rollway.runtime.settings import StreamConfig
from rollway.schemas.codec import DecodeError, decode
from rollway.topics import TopicSpec


class ScanIncomplete(RuntimeError):
    """The broker stopped serving a topic before the scan reached its end."""


class StreamingTopicScanner:
    """`scan(spec)` yields every decodable message of one topic, partition by partition in offset
    order (undecodable records are skipped: they went to dead-letters). Raises ScanIncomplete when
    no record arrives for `stall_s` before the end: a stall, not a slow scan of a long log, fails it."""

    def __init__(self, cfg: StreamConfig, bootstrap: str, stall_s: float = 60.0):
        self.cfg, self.bootstrap, self.stall_s = cfg, bootstrap, stall_s

    async def __call__(self, spec: TopicSpec) -> AsyncIterator[Any]:
        name = topic_name(spec, self.cfg.topics)
        consumer = await make_consumer(self.cfg.broker, self.bootstrap, group_id=None)
        try:
            tps = await topic_partitions(consumer, [name])
            if not tps:
                return
            ends = await consumer.end_offsets(tps)
            records = read_to_end(consumer, dict.fromkeys(tps), ends, timeout_s=None).__aiter__()
            while True:
                try:
                    _tp, record = await asyncio.wait_for(records.__anext__(), self.stall_s)
                except StopAsyncIteration:
                    return
                except TimeoutError as err:
                    raise ScanIncomplete(
                        f"reading {name} back stalled: no record for {self.stall_s:.0f}s before its end "
                        f"(offsets {dict((tp.partition, o) for tp, o in ends.items())}). The broker stopped "
                        "serving it; fix the broker (or --bootstrap) and restart this stage") from err
                try:
                    yield decode(record.value, spec.value)
                except DecodeError:
                    continue
        finally:
            await consumer.stop()
