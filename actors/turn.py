"""The built-in agent loop, one turn at a time, free of any transport: generate (the engine), step (the
episode's environment), record (episode/turn.py). The agent actor wraps it with delivery; a test can call it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollway.actors.gate import RankedGate
from rollway.base.blame import InferenceUnreachable, blame
from rollway.base.faults import fault_point
from rollway.episode.state import EpisodeState
from rollway.episode.turn import Turn, TurnRules
from rollway.runtime import metrics
from rollway.schemas.messages import TurnRecord

if TYPE_CHECKING:
    from rollway.actors.services import Services
    from rollway.config.run import AgentConfig
    from rollway.envs.base import Environment, TaskSet
    from rollway.policies.base import InferenceClient
    from rollway.sandboxes.base import Sandbox

SandboxForTurn = Callable[[int], Awaitable["Sandbox"]]
"""turn -> the episode's sandbox, claimed for that turn (after the model answered, before any tool runs), so a
redelivered turn never runs its tool calls twice."""


@dataclass
class TurnRunner:
    """Runs one turn of an episode. Built once per worker (`from_services`) or from its parts."""

    agent: AgentConfig
    inference: InferenceClient
    taskset: TaskSet
    environment: Callable[[Any, Sandbox], Environment]
    """(task, sandbox) -> the episode's environment (`Services.environment`)."""
    rules: TurnRules

    def __post_init__(self) -> None:
        self.model_slots = RankedGate(self.agent.concurrency) if self.agent.tool_overlap else None
        """With tool_overlap, the model-call slots turns take in rank order (else the caller's own
        concurrency bounds the calls)."""

    @classmethod
    def from_services(cls, s: Services) -> TurnRunner:
        rules = TurnRules(s.cfg.agent, s.cfg.hints, s.chat, s.cfg.sandbox.exec_timeout_s, s.cfg.scheduler.agent_time_s)
        return cls(s.cfg.agent, s.inference, s.taskset, s.environment, rules)

    async def run(self, state: EpisodeState, sandbox_for_turn: SandboxForTurn,
                  rank: Callable[[], float] = lambda: 0.0) -> Turn:
        """Turn `state.next_turn`: generate, step, record (none when the budget or the agent time is spent)."""
        if state.task is None:  # the episode's first turn on this worker
            state.begin(self.taskset.get(state.first.task_id), self.rules.agent_time_s)
        self.rules.context = await self.inference.context_tokens()  # read once by the client, then kept
        if (ended := self.rules.ended(state)) is not None:
            return ended
        record = await self.generate(state, rank)
        if record is None:
            return self.rules.timed_out(state)
        sandbox = await sandbox_for_turn(record.turn)
        # The tools end with the agent's time too, not only their commands: a tool can take long on the host
        # over what the agent made (a search over a workspace it filled), and a step past the deadline would
        # be re-issued, ungraded. Cut, the turn keeps the model's message and ends `agent_timeout`.
        limit = asyncio.timeout(state.agent_time_left())
        try:
            env, view = self.environment(state.task, self.rules.guard(state, sandbox)), self.rules.view(state, record)
            async with limit:
                step = await env.step(record.assistant_text, view)
            fault_point("agent.after_tools")
            return self.rules.record(state, record, step, view, list(env.tools))
        except Exception as err:
            if limit.expired():
                return self.rules.tools_timed_out(state, record, view, list(env.tools))
            if blame(err, agent_ran=True) == "infrastructure":
                raise
            return self.rules.failed(state, record, err)

    async def generate(self, state: EpisodeState, rank: Callable[[], float]) -> TurnRecord | None:
        """The engine's answer to the episode's prompt, as the turn's record so far; None when the episode's
        agent time ran out first (the request is cancelled): how long a generation runs is the model's doing
        (it rambles to max_tokens), and one that ran past the episode's deadline would be re-issued, ungraded."""
        limit = asyncio.timeout(state.agent_time_left())
        try:
            async with limit, self.model_slots.slot(rank) if self.model_slots else contextlib.nullcontext():
                t0, started_at = time.perf_counter(), time.time()
                gen = await metrics.generate(self.inference, state.token_ids, self.rules.sampling(state), "agent")
                seconds = time.perf_counter() - t0
        except OSError as err:  # no connection, an answer it cannot read: the engine, never the agent
            if limit.expired():
                return None
            raise InferenceUnreachable(f"the inference engine failed: {err}") from err
        return self.rules.completion(state, gen, started_at, seconds)
