"""Blocking work the agent can influence (host-side tools reading its files), run off the event loop
with a deadline, on threads of its own: a call that gets stuck neither wedges the stage nor takes the
threads every other `asyncio.to_thread` of the process shares, nor keeps the process from exiting."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

MAX_THREADS = 8
"""Threads running agent-influenced blocking calls at once in one process. A call past its deadline
keeps its thread (Python cannot stop a thread) until it returns; with all of them held, further calls
wait for one within their own deadline, then fail."""

_slots = threading.BoundedSemaphore(MAX_THREADS)


class BlockingTimeout(TimeoutError):
    """A blocking call did not finish within its deadline (its thread is left to end on its own)."""


async def run_blocking(fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
    """`fn(*args)` on a daemon thread; BlockingTimeout after `timeout_s` (waiting for a free thread
    included). Cancelling the awaiting task leaves the thread to finish and drops its result."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not _slots.acquire(blocking=False):
        if loop.time() >= deadline:
            raise BlockingTimeout(f"no thread free for {timeout_s:.0f}s: {MAX_THREADS} earlier calls are still "
                                  "running past their limits")
        await asyncio.sleep(0.05)
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            result, ok = fn(*args), True
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting task
            result, ok = err, False
        finally:
            _slots.release()
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this
            pass

    threading.Thread(target=work, name=f"rollway-blocking-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    try:
        return await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
    except TimeoutError:
        raise BlockingTimeout(f"{getattr(fn, '__name__', 'the call')} did not finish within {timeout_s:.0f}s") from None
