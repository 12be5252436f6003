"""Init actor: build the episode's sandbox and first prompt, emit turn 0 to agent-steps."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import structlog

from rollway.actors.services import Services
from rollway.actors.sink import belongs_to_run
from rollway.runtime import metrics
from rollway.runtime.actor import Actor, MessageMeta, Output, failure_output
from rollway.schemas.messages import AgentStep, InitRequest
from rollway.topics import AGENT_STEPS

log = structlog.get_logger()


def sandbox_name(episode_id: str, attempt: int) -> str:
    """Unique per creation: a re-issued attempt, or an init request redelivered after a crash, never
    shares (or wipes) a sandbox that another copy of the episode may already be using."""
    return f"{episode_id}-a{attempt}-{uuid.uuid4().hex[:6]}"


LIVE_SANDBOXES_INTERVAL_S = 5.0
"""How often an init worker counts the run's sandboxes on the engine (the `rollway_sandboxes_live` metric)."""


class InitActor(Actor):

    def __init__(self, services: Services):
        self.s = services
        self._live_counted = 0.0

    async def tick(self) -> list[Output]:
        if time.monotonic() - self._live_counted >= LIVE_SANDBOXES_INTERVAL_S:
            self._live_counted = time.monotonic()
            await self._count_live_sandboxes()
        return []

    async def _count_live_sandboxes(self) -> None:
        """The run's sandboxes the engine holds now (the reaper's listing: whoever destroys them, once)."""
        from rollway.sandboxes.reaper import names_by_engine, run_prefix

        try:
            names = await asyncio.to_thread(names_by_engine, self.s.sandboxes, run_prefix(self.s.cfg.run.id), True)
        except Exception as err:  # noqa: BLE001 - a metric must never stop the stage
            log.debug("live sandboxes not counted", error=f"{type(err).__name__}: {err}")
            return
        for engine, held in names.items():
            metrics.SANDBOXES_LIVE.labels("init", engine).set(len(held))

    async def setup(self) -> None:
        _ = self.s.sandboxes, self.s.chat, self.s.toolbox.build(self.s.taskset.default_tools)

    async def close(self) -> None:
        await self.s.sandboxes.close()  # e.g. the docker sandbox's idle warm-pool containers

    async def handle(self, msg: InitRequest, meta: MessageMeta) -> list[Output]:
        if not belongs_to_run(msg.episode_id, self.s.cfg.run.id):
            return []  # another run's episode on shared topics: its own init stage builds it
        if msg.deadline and time.time() > msg.deadline:
            log.info("init request past its deadline, skipped", episode_id=msg.episode_id, attempt=msg.attempt)
            return []  # the scheduler has re-issued it (or will)
        task = self.s.taskset.get(msg.task_id)
        await self.s.taskset.prepare(task)  # e.g. its image built in a thread, off this loop
        name = sandbox_name(msg.episode_id, msg.attempt)
        try:
            engine = self.s.sandboxes.engine  # None: a fleet, which counts on the engine it chooses
            creating = (metrics.SANDBOXES_CREATING.labels("init", engine).track_inprogress() if engine
                        else contextlib.nullcontext())
            with creating, metrics.SANDBOX_CREATE_SECONDS.labels("init").time():
                sandbox = await self.s.sandboxes.create(self.s.taskset.sandbox_spec(task), name)
            metrics.SANDBOXES_CREATED.labels("init", sandbox.handle.get("engine") or "local").inc()
        except BaseException:
            await self._discard(name)  # a half-built sandbox (or one whose creation was cancelled)
            raise
        try:
            return [await self._first_step(msg, task, sandbox)]
        except BaseException:
            await self._discard(name, sandbox)
            raise

    async def _discard(self, name: str, sandbox=None) -> None:
        """Remove this attempt's sandbox: nothing hands it on (the request is retried or re-issued
        with a sandbox of its own). Cancellation is held off meanwhile, so a cancelled handler
        still finishes the removal before it stops."""
        from rollway.sandboxes.reaper import remove_named

        cleanup = sandbox.destroy() if sandbox is not None else remove_named(self.s.sandboxes, name)
        task = asyncio.ensure_future(cleanup)
        try:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                await task  # cancelled again while removing: finish the removal, then stop
                raise
        except Exception as err:  # noqa: BLE001 - the init's own error is the one to report
            log.warning("sandbox of a failed init not removed; the run's reaper will", sandbox=name,
                        error=f"{type(err).__name__}: {err}")
            return
        log.info("sandbox of a failed init removed", sandbox=name)

    async def _first_step(self, msg: InitRequest, task, sandbox) -> Output:
        ready_at = time.time()
        env = self.s.environment(task, sandbox)
        messages = await env.start(self.s.cfg.agent.system_prompt)
        tools = [t.spec() for t in env.tools.values()] if self.s.taskset.describe_tools else []
        step = AgentStep(
            episode=msg.episode, turn=0, sandbox=sandbox.handle,
            prompt_ids=self.s.chat.initial(messages, tools), messages=messages, tools=tools,
            deadline=msg.deadline, ready_at=ready_at, final_wave=msg.final_wave)
        return Output(AGENT_STEPS, msg.episode_id, step)

    def on_error(self, msg: InitRequest, error: BaseException) -> list[Output]:
        return [failure_output(msg, self.name, error)]
