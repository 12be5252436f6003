"""The event loop a command's coroutine runs on (uvloop when installed), with signals that still stop it."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop when it is installed. SIGTERM or SIGINT meanwhile cancels `main`, and the
    signal is raised again once the loop has closed, for the process's own handler (the CLI's unwinding):
    uvloop runs Python signal handlers inside a loop callback, where what they raise is only logged, so a
    command on uvloop went on after SIGTERM."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    caught: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    async def guarded() -> T:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                if callable(handler):  # a handler of the process's own (not ignored, not the default)
                    loop.add_signal_handler(sig, lambda sig=sig: (caught.append(sig), task.cancel()))
        return await main

    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(guarded())
    finally:
        if caught:  # the loop put the default action back when it closed: the process's own handler again
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.raise_signal(caught[0])
