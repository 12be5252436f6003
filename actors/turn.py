"""The built-in agent loop, one turn at a time, free of any transport: over (episode state, task, policy,
tools, sandbox) it generates, runs the tool calls, applies the stop rules, hints and simulated users,
and returns the turn's record. The agent actor wraps it with delivery (caching, rebuilding from the log,
duplicate detection); a test or another driver can call it directly."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog

from rollway.actors.gate import RankedGate
from rollway.base.blame import AGENT_FAILURE, InferenceUnreachable, blame, failure_details, failure_reason
from rollway.base.faults import fault_point
from rollway.envs.base import Episode
from rollway.episode.deadline import AGENT_TIMEOUT, DeadlineSandbox, agent_deadline
from rollway.episode.state import EpisodeState
from rollway.episode.stream import observation_messages
from rollway.policies.base import ChatFormat, InferenceClient, SamplingParams, episode_seed
from rollway.runtime import metrics
from rollway.sandboxes.base import Sandbox
from rollway.schemas.messages import TurnRecord

if TYPE_CHECKING:
    from rollway.actors.services import Services
    from rollway.config.run import AgentConfig
    from rollway.envs.base import Environment, Step, TaskSet
    from rollway.tools.config import HintsConfig

log = structlog.get_logger()

SandboxForTurn = Callable[[int], Awaitable[Sandbox]]
"""turn -> the episode's sandbox, ready for that turn's tool calls. Called once per turn, after the
model answered and before any tool runs: the agent actor attaches and claims the turn there, so a
redelivered turn never runs its tool calls twice."""


class Turn(NamedTuple):
    record: TurnRecord
    stop_reason: str | None
    """Why the episode ends after this turn; None: it goes on."""
    failure: dict[str, str] | None = None
    """The turn failed after its tool calls started (base/blame.py: the agent's): grade details of the
    failure; the episode ends here (stop reason agent_failure) and is graded 0."""


@dataclass
class TurnRunner:
    """Runs one turn of an episode. Built once per worker (`from_services`) or from its parts."""

    agent: AgentConfig
    chat: ChatFormat
    inference: InferenceClient
    taskset: TaskSet
    environment: Callable[[Any, Sandbox], Environment]
    """(task, sandbox) -> the episode's environment (TaskSet.environment with the worker's tools)."""
    hints_cfg: HintsConfig
    exec_timeout_s: float
    drift_count: int = 0

    def __post_init__(self) -> None:
        self.model_slots = RankedGate(self.agent.concurrency) if self.agent.tool_overlap else None
        """With tool_overlap, the model-call slots turns take in rank order (else the caller's own
        concurrency bounds the calls)."""

    @classmethod
    def from_services(cls, s: Services) -> TurnRunner:
        return cls(s.cfg.agent, s.chat, s.inference, s.taskset, s.environment, s.cfg.hints,
                   s.cfg.sandbox.exec_timeout_s)

    async def run(self, state: EpisodeState, sandbox_for_turn: SandboxForTurn,
                  rank: Callable[[], float] = lambda: 0.0) -> Turn:
        """Turn `state.next_turn`: generate, act in the sandbox, decide whether the episode stops."""
        chat, turn, f = self.chat, state.next_turn, state.first
        budget = self.agent.max_total_tokens - state.tokens_used
        if budget <= 0:
            return Turn(self._prompt_too_long(state), "prompt_too_long")
        task = self.taskset.get(f.task_id)
        deadline = agent_deadline(task.metadata, f.ready_at)
        if deadline is not None and time.time() >= deadline:
            return Turn(self._out_of_time(state), AGENT_TIMEOUT)
        params = SamplingParams(temperature=self.agent.temperature, top_p=self.agent.top_p,
                                max_tokens=max(1, min(self.agent.max_tokens_per_turn, budget)),
                                stop_token_ids=chat.stop_token_ids,
                                seed=episode_seed(f.episode_id, f.attempt) + turn, task_id=f.task_id, turn=turn)
        async with self._model_slot(rank):
            t0, gen_started_at = time.perf_counter(), time.time()
            try:
                gen = await metrics.generate(self.inference, state.token_ids, params, "agent")
            except OSError as err:  # no connection, a timeout: the engine, never the agent
                raise InferenceUnreachable(f"the inference engine did not answer: {err}") from err
            gen_s, gen_ended_at = time.perf_counter() - t0, time.time()
        # What the record carries must encode: ids that decode to lone surrogates (invalid UTF-8 from a
        # byte-level model) become U+FFFD in the text; the token ids stay exactly as sampled.
        text = chat.decode(gen.token_ids).encode("utf-8", "replace").decode("utf-8")
        t1 = time.perf_counter()
        sandbox = await sandbox_for_turn(turn)
        try:
            return await self._after_claim(state, task, turn, text, gen, sandbox, deadline,
                                           (t1, gen_s, gen_started_at, gen_ended_at))
        except Exception as err:
            if blame(err, agent_ran=True) == "infrastructure":
                raise
            log.warning("turn failed after its tool calls started; the episode is graded 0", episode_id=f.episode_id,
                        turn=turn, error=failure_reason(err)[:300])
            record = TurnRecord(turn=turn, completion_ids=list(gen.token_ids), logprobs=list(gen.logprobs),
                                policy_version=gen.policy_version, finish_reason=gen.finish_reason,
                                assistant_text=text, gen_seconds=gen_s, gen_started_at=gen_started_at,
                                gen_ended_at=gen_ended_at)
            return Turn(record, AGENT_FAILURE, failure_details(err, "agent"))

    async def _after_claim(self, state: EpisodeState, task: Any, turn: int, text: str, gen: Any, sandbox: Sandbox,
                           deadline: float | None, times: tuple[float, float, float, float]) -> Turn:
        """The turn once its tool calls may start: act, stop rules, user message, hints, observation ids."""
        t1, gen_s, gen_started_at, gen_ended_at = times
        if deadline is not None:
            sandbox = DeadlineSandbox(sandbox, deadline, self.exec_timeout_s)
        env, f = self.environment(task, sandbox), state.first
        used = state.tokens_used + len(gen.token_ids)
        ends = self._stop_reason(False, turn, used)  # the framework's own end, whatever the environment says
        episode = Episode(f.episode_id, f.attempt, task, list(state.messages), list(state.turns), dict(state.store), ends)
        step = await env.step(text, episode)
        fault_point("agent.after_tools")
        stop_reason = "finish" if step.done == "finish" else ends
        if stop_reason is None and deadline is not None and time.time() >= deadline:
            stop_reason = AGENT_TIMEOUT
        stop_reason = stop_reason or step.done
        record = TurnRecord(
            turn=turn, completion_ids=list(gen.token_ids), logprobs=list(gen.logprobs),
            policy_version=gen.policy_version, finish_reason=gen.finish_reason, assistant_text=text,
            observations=step.observations, gen_seconds=gen_s, gen_started_at=gen_started_at,
            gen_ended_at=gen_ended_at, user_message=step.user_message if stop_reason in (None, "user_done") else None)
        record.tool_seconds = time.perf_counter() - t1
        # Timestamps are read from the wall clock, never a wall start plus perf_counter durations: the two
        # clocks drift apart while the system clock is being slewed, and a computed end fell after the
        # stage's own record of the turn's end (8 ms in a suite run on a machine minutes after boot).
        record.tool_ended_at = time.time()
        record.hints = [] if stop_reason else [*self._hints(state, step, turn, used, env.tools), *step.hints]
        record.state = dict(episode.state) if episode.state != state.store else None
        if stop_reason is None:
            record.observation_ids = self._observation_ids(state, record, gen.token_ids)
            if used + len(record.observation_ids) >= self.agent.max_total_tokens:
                record.observation_ids, stop_reason = [], "max_tokens"
        return Turn(record, stop_reason)

    @contextlib.asynccontextmanager
    async def _model_slot(self, rank: Callable[[], float]) -> AsyncIterator[None]:
        """Holds a model-call slot (with tool_overlap)."""
        if self.model_slots is None:
            yield
            return
        async with self.model_slots.slot(rank):
            yield

    def _stop_reason(self, finished: bool, turn: int, used: int) -> str | None:
        if finished:
            return "finish"
        if turn + 1 >= self.agent.max_turns:
            return "max_turns"
        if used >= self.agent.max_total_tokens:
            return "max_tokens"
        return None

    def _observation_ids(self, state: EpisodeState, record: TurnRecord, completion: list[int]) -> list[int]:
        chat = self.chat
        history = [*state.messages, {"role": "assistant", "content": record.assistant_text}]
        ids = chat.continuation(history, observation_messages(record), state.tools)
        if not completion or completion[-1] not in chat.stop_token_ids:
            ids = [chat.stop_token_ids[0], *ids]  # truncated turn: close it (not a model token)
        if chat.drift(history, state.tools, state.token_ids + completion):
            record.template_drift = True
            self.drift_count += 1
            log.warning("chat template drift: history re-renders differently", episode_id=state.first.episode_id,
                        turn=record.turn, drift_count=self.drift_count)
        return ids

    def _prompt_too_long(self, state: EpisodeState) -> TurnRecord:
        """The prompt alone fills agent.max_total_tokens: the episode ends before any model call, with a
        stop reason that says so (never a silent reward-0 `max_tokens`)."""
        log.warning("prompt longer than agent.max_total_tokens; episode ended without a model call",
                    episode_id=state.first.episode_id, prompt_tokens=state.tokens_used,
                    max_total_tokens=self.agent.max_total_tokens)
        return TurnRecord(turn=state.next_turn, completion_ids=[], logprobs=[], policy_version=0,
                          finish_reason="prompt_too_long", assistant_text="")

    def _out_of_time(self, state: EpisodeState) -> TurnRecord:
        """The task's agent time ran out before this turn's model call: the episode ends (graded as it
        stands) with an empty turn."""
        log.info("task's agent time is up; episode ends", episode_id=state.first.episode_id, turn=state.next_turn)
        return TurnRecord(turn=state.next_turn, completion_ids=[], logprobs=[], policy_version=0,
                          finish_reason=AGENT_TIMEOUT, assistant_text="")

    def _hints(self, state: EpisodeState, step: Step, turn: int, used: int, tools: Mapping[str, Any]) -> list[str]:
        from rollway.episode.hints import HintEngine

        previous = state.turns[-1] if state.turns else None
        prev_calls = [(o.tool, o.arguments) for o in previous.observations if o.tool] if previous else []
        return HintEngine(self.hints_cfg).hints(
            turn=turn, max_turns=self.agent.max_turns, tokens_used=used, max_tokens=self.agent.max_total_tokens,
            calls=step.calls, previous_calls=prev_calls, errors=sum(o.is_error for o in step.observations),
            tools=list(tools))
