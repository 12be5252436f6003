"""A counting gate whose waiters enter by a rank read when a slot frees, not when they arrived."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable


class RankedGate:
    """At most `slots` holders at once. When a slot frees it passes straight to the waiter whose
    `rank()` is highest at that moment (arrival order among equals), so a ranking rule that changes
    while turns wait (the agent's drain) applies to them too."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"a gate needs at least one slot, got {slots}")
        self.slots = slots
        self.free = slots
        self.waiters: list[tuple[int, Callable[[], float], asyncio.Future]] = []
        self._seq = itertools.count()

    @property
    def held(self) -> int:
        return self.slots - self.free

    @contextlib.asynccontextmanager
    async def slot(self, rank: Callable[[], float]) -> AsyncIterator[None]:
        await self._acquire(rank)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, rank: Callable[[], float]) -> None:
        if self.free and not self.waiters:
            self.free -= 1
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (next(self._seq), rank, granted)
        self.waiters.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if entry in self.waiters:
                self.waiters.remove(entry)
            elif granted.done() and not granted.cancelled():
                self._release()  # the slot was handed over as we were cancelled: pass it on
            raise

    def _release(self) -> None:
        if not self.waiters:
            self.free += 1
            return
        best = max(self.waiters, key=lambda w: (w[1](), -w[0]))
        self.waiters.remove(best)
        best[2].set_result(None)
