"""One-process jobs (`runtime.processes: one`): every stage of a job runs as an asyncio task on one event
loop in a thread of the `rollway up` process, each the sole worker of its stage (it takes its
partitions without a consumer-group join). A small job then pays for one interpreter, one set of
imports and no group joins instead of six of each (docs/benchmarks.md, "rollway up's own cost").

`LocalStage` offers the part of a stage process `Job` uses (start, alive, restarts, exit code, terminate,
wait, kill), so supervision is the same code for both: a stage whose task raises is restarted in place
from its committed offsets, like a crashed worker process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from rollway.config.run import RunConfig

log = structlog.get_logger()

KILLED = -9
"""The exit code of a stage task cancelled by `kill` (what a SIGKILLed process reports)."""


class StageLoop:
    """The event loop (uvloop when installed) the stage tasks share, in its own daemon thread."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollway-stages", daemon=True)
        self.thread.start()

    def call(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self, timeout_s: float = 5.0) -> None:
        """Once the stages have ended: cancel what is left on the loop (a killed stage's clients, their
        background reads) and let it unwind, then stop the loop."""
        if self.loop.is_closed():
            return

        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.wait(rest, timeout=timeout_s) if rest else None

        try:
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(timeout_s + 1)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.loop.close()


class LocalStage:
    """One stage of a one-process job: its task on the shared loop, looking like a worker process to `Job`
    (`proc` is itself: poll, returncode, pid, terminate, wait, kill)."""

    def __init__(self, stage: str, cfg: RunConfig, bootstrap: str, run_dir: Path, loop: StageLoop, log_path: Path):
        self.stage, self.index, self.log_path = stage, 0, log_path
        self.cfg, self.bootstrap, self.run_dir, self.host = cfg, bootstrap, run_dir, loop
        self.restarts = 0
        self.returncode: int | None = None
        self.future: concurrent.futures.Future | None = None
        self.stop_event: asyncio.Event | None = None

    @property
    def proc(self) -> LocalStage:
        return self if self.future is not None else None  # type: ignore[return-value]

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def alive(self) -> bool:
        return self.future is not None and self.returncode is None

    def poll(self) -> int | None:
        return self.returncode

    def start(self) -> None:
        self.returncode = None
        self.future = asyncio.run_coroutine_threadsafe(self._run(), self.host.loop)

    async def _run(self) -> None:
        from rollway.runners.stage import run_stage
        from rollway.runtime.kafka import BrokerUnavailable

        structlog.contextvars.bind_contextvars(stage=self.stage)  # this task's lines go to the stage's logs
        self.stop_event = asyncio.Event()
        try:
            await run_stage(self.stage, self.cfg, self.bootstrap, self.run_dir, self.stop_event, sole_worker=True)
            self.returncode = 0
        except asyncio.CancelledError:
            self.returncode = KILLED
            raise
        except BrokerUnavailable as err:
            log.error(f"rollway stage {self.stage}: {err}")
            self.returncode = 1
        except BaseException:  # noqa: BLE001 - a crashed stage: logged, and restarted by the job
            log.exception("stage failed; the job restarts it from its committed offsets")
            self.returncode = 1

    def terminate(self) -> None:
        """Ask the stage to stop as SIGTERM asks a worker process: finish in-flight work, commit, close."""
        if self.stop_event is not None:
            self.host.call(self.stop_event.set)
        elif self.future is not None:  # not begun yet
            self.kill()

    def wait(self, timeout_s: float | None = None) -> int:
        if self.future is None:
            raise RuntimeError(f"stage {self.stage} was never started")
        try:
            self.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise subprocess.TimeoutExpired(f"stage {self.stage}", timeout_s) from None
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            self.returncode = KILLED
        return self.returncode if self.returncode is not None else KILLED

    def kill(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.cancel()  # cancels the task on its loop
            self.returncode = KILLED
