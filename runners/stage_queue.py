"""Helpers of the stage runtime: a local priority backlog of fetched messages and a per-message hop trace."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition


class Backlog:
    """Messages fetched beyond the stage's concurrency, highest priority first, fetch order among equals."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, TopicPartition, Any]] = []
        self.seq = itertools.count()

    def __len__(self) -> int:
        return len(self.heap)

    def push(self, priority: float, tp: TopicPartition, record: Any) -> None:
        heapq.heappush(self.heap, (-priority, next(self.seq), tp, record))

    def pop(self) -> tuple[TopicPartition, Any]:
        _, _, tp, record = heapq.heappop(self.heap)
        return tp, record

    def rerank(self, priority: Callable[[TopicPartition, Any], float]) -> None:
        """Rank every queued message again (fetch order among equals stays)."""
        self.heap = [(-priority(tp, record), seq, tp, record) for _, seq, tp, record in self.heap]
        heapq.heapify(self.heap)

    def drop(self, tps: set[TopicPartition]) -> None:
        """Forget queued messages of partitions given away (uncommitted, so their next owner reads them)."""
        self.heap = [item for item in self.heap if item[2] not in tps]
        heapq.heapify(self.heap)


class KeyLocks:
    """One lock per message key, so messages of one key (one episode) never run at once. A key's lock
    is dropped when no message holds or awaits it any more: `Lock.locked()` cannot tell, since it is
    False while a woken waiter has not yet taken the lock, and a message arriving then would get a
    fresh lock and run beside that waiter."""

    def __init__(self) -> None:
        self.locks: dict[Any, asyncio.Lock] = {}
        self.users: dict[Any, int] = {}

    def __len__(self) -> int:
        return len(self.locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: Any) -> AsyncIterator[None]:
        lock = self.locks.setdefault(key, asyncio.Lock())
        self.users[key] = self.users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self.users[key] -= 1
            if not self.users[key]:
                del self.users[key], self.locks[key]


def sent_time(msg: Any) -> float:
    """When the producer sent this message (0 when it does not say)."""
    for name in ("sent_at", "issued_at", "created_at"):
        value = getattr(msg, name, 0.0)
        if value:
            return float(value)
    return 0.0


class HopTrace:
    """One JSON line per handled message: when it was sent, when the worker started the poll that
    fetched it, when it was fetched, when handling started and ended (wall-clock seconds)."""

    def __init__(self, path: Path, stage: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1 << 16)
        self.stage = stage
        self.fetches: dict[tuple[TopicPartition, int], tuple[float, float]] = {}

    def fetched(self, tp: TopicPartition, offset: int, polled_at: float, fetched_at: float) -> None:
        self.fetches[(tp, offset)] = (polled_at, fetched_at)

    def handled(self, tp: TopicPartition, record: Any, msg: Any, started: float, ended: float) -> None:
        polled, fetched = self.fetches.pop((tp, record.offset), (started, started))
        self.file.write(json.dumps({
            "stage": self.stage, "topic": tp.topic, "partition": tp.partition, "offset": record.offset,
            "episode_id": getattr(msg, "episode_id", None), "turn": getattr(msg, "turn", None),
            "bytes": len(record.value or b""), "sent": sent_time(msg), "polled": polled, "fetched": fetched,
            "started": started, "ended": ended}) + "\n")

    def close(self) -> None:
        self.file.close()
