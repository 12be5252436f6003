"""RankedGate: the agent's model-call slots when tool calls overlap generation (agent.tool_overlap)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import run

from rollway.actors.gate import RankedGate


def test_gate_caps_holders_and_hands_a_freed_slot_to_the_best_ranked_waiter_at_that_moment():
    async def go() -> tuple[list[str], int]:
        gate = RankedGate(2)
        ranks = {"a": 1.0, "b": 1.0, "c": 5.0, "d": 1.0, "e": 3.0}
        order: list[str] = []
        peak = 0
        release = asyncio.Event()

        async def turn(name: str) -> None:
            nonlocal peak
            async with gate.slot(lambda: ranks[name]):
                order.append(name)
                peak = max(peak, gate.held)
                if name in "ab":
                    await release.wait()
                else:
                    await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(turn(n)) for n in "abcde"]
        await asyncio.sleep(0.05)  # a and b hold the slots; c, d, e wait
        assert order == ["a", "b"] and len(gate.waiters) == 3
        ranks["d"] = 9.0  # the ranking changes while d waits (the agent's drain does this)
        release.set()
        await asyncio.gather(*tasks)
        return order, peak

    order, peak = run(go())
    assert peak == 2, "never more holders than slots"
    assert order == ["a", "b", "d", "c", "e"], "freed slots go to the best rank read at release time"


def test_gate_keeps_arrival_order_among_equal_ranks_and_loses_no_slot_to_a_cancelled_waiter():
    async def go() -> tuple[list[int], int]:
        gate = RankedGate(1)
        order: list[int] = []
        hold = asyncio.Event()

        async def turn(i: int) -> None:
            async with gate.slot(lambda: 0.0):
                order.append(i)
                if i == 0:
                    await hold.wait()

        first = asyncio.create_task(turn(0))
        await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(turn(i)) for i in (1, 2, 3)]
        await asyncio.sleep(0.01)
        waiting[1].cancel()  # turn 2 gives up (its worker lost the partition, say)
        hold.set()
        await asyncio.gather(first, waiting[0], waiting[2])
        with pytest.raises(asyncio.CancelledError):
            await waiting[1]
        return order, gate.free

    order, free = run(go())
    assert order == [0, 1, 3]
    assert free == 1, "every slot is back once all holders left"


def test_gate_refuses_zero_slots():
    with pytest.raises(ValueError, match="at least one slot"):
        RankedGate(0)
