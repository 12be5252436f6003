"""Helpers of the stage runtimes: a local priority backlog of fetched messages and per-key locks."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Callable
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
