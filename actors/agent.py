"""Agent actor: one message = one turn. Generate, run tools in the sandbox, emit the next turn or
the finished episode."""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from rollway.actors.agent_time import AGENT_TIMEOUT, DeadlineSandbox, agent_deadline
from rollway.actors.base import Actor, MessageMeta, Output, StaleMessage, failure_output
from rollway.actors.episode import EpisodeState, observation_messages
from rollway.actors.gate import RankedGate
from rollway.actors.services import Services
from rollway.base.faults import fault_point
from rollway.policies.base import SamplingParams, episode_seed
from rollway.sandboxes.base import SandboxGone
from rollway.schemas.messages import AgentStep, RewardRequest, TurnRecord

if TYPE_CHECKING:
    from rollway.tools.registry import ToolTurn
from rollway.topics import AGENT_STEPS, REWARD_REQUESTS

log = structlog.get_logger()

LogReader = Callable[[str, int, int, str], Awaitable[list[tuple[int, AgentStep]]]]
"""(topic, partition, from_offset, episode_id) -> [(offset, message)] of that episode, from
`from_offset` to the current end of the partition."""

MAX_CACHED_EPISODES = 4096


class AgentActor(Actor):
    name = "agent"
    inputs = (AGENT_STEPS,)

    def __init__(self, services: Services, read_log: LogReader | None = None):
        self.s = services
        self.cfg = services.cfg.agent
        self.read_log = read_log
        self.cache: OrderedDict[tuple[str, int], EpisodeState] = OrderedDict()
        self.drift_count = 0
        self.final_wave = False
        """Set by the first final-wave message this worker sees: the run is draining."""
        self.model_slots = RankedGate(self.cfg.concurrency) if self.cfg.tool_overlap else None
        """With tool_overlap, the model-call slots turns take in `priority` order (else the stage's
        own concurrency bounds the calls)."""

    async def setup(self) -> None:
        # Build now, task set first (it imports the module that defines its tools): fail fast on bad config.
        _ = self.s.taskset, self.s.tools, self.s.inference, self.s.sandboxes

    async def _handle_turn(self, msg: AgentStep, meta: MessageMeta) -> list[Output]:
        state = await self._state_for(msg, meta)
        if state is None:
            return []  # duplicate delivery of a turn that was already run
        record, stop_reason = await self._run_turn(state, lambda: self._rank(msg.turn))
        new_messages = observation_messages(record)
        state.apply(record, new_messages)
        if stop_reason is None:
            return [Output(AGENT_STEPS, msg.episode_id, self._next_step(state))]
        self.cache.pop((msg.episode_id, msg.attempt), None)
        return [Output(REWARD_REQUESTS, msg.episode_id, self._reward_request(state, stop_reason))]

    def priority(self, msg: AgentStep) -> float:
        """With a backlog, later turns first: finish running episodes (and free their sandboxes)
        before starting new ones. Once the run drains (the first final-wave message), earliest turn
        first, for every episode: nothing is left to issue, the run ends when its longest remaining
        episode does, and the episodes with the fewest turns done have the most left. Episodes
        issued just before the final wave are no different from those in it: ranking only marked
        messages first left their first turns waiting seconds behind the wave."""
        if msg.final_wave and not self.final_wave:
            self.final_wave = True
            self.priority_epoch += 1  # the runtime re-ranks what it already queued
        return self._rank(msg.turn)

    def _rank(self, turn: int) -> float:
        return -float(turn) if self.final_wave else float(turn)

    async def handle(self, msg: AgentStep, meta: MessageMeta) -> list[Output]:
        try:
            return await self._handle_turn(msg, meta)
        except TurnReplayed as err:
            log.warning("turn re-run detected; attempt failed for a fresh sandbox", episode_id=msg.episode_id,
                        turn=msg.turn, attempt=msg.attempt)
            self.cache.pop((msg.episode_id, msg.attempt), None)
            return [failure_output(msg, self.name, err)]
        except SandboxGone as err:
            # Only an ended attempt's sandbox is destroyed: this turn is a redelivery (say, the last
            # turn, graded and torn down before its offset was committed). Nothing needs a person.
            self.cache.pop((msg.episode_id, msg.attempt), None)
            raise StaleMessage(f"turn {msg.turn} of attempt {msg.attempt}: {err}") from None

    def on_error(self, msg: AgentStep, error: BaseException) -> list[Output]:
        self.cache.pop((msg.episode_id, msg.attempt), None)
        return [failure_output(msg, self.name, error)]

    # -- state ------------------------------------------------------------------------------
    async def _state_for(self, msg: AgentStep, meta: MessageMeta) -> EpisodeState | None:
        key = (msg.episode_id, msg.attempt)
        state = self.cache.get(key)
        if msg.turn == 0 and state is None:
            state = EpisodeState.start(msg, meta.offset)
            if self.read_log is not None and await self._already_advanced(msg, meta, meta.offset):
                await self._discard_duplicate_sandbox(msg, None)
                return None
        elif state is None or state.next_turn != msg.turn:
            if state is not None and state.next_turn > msg.turn:
                await self._discard_duplicate_sandbox(msg, state)
                return None
            state = await self._rebuild(msg, meta)
            if state is None:
                return None
        self.cache[key] = state
        self.cache.move_to_end(key)
        while len(self.cache) > MAX_CACHED_EPISODES:
            self.cache.popitem(last=False)
        return state

    async def _discard_duplicate_sandbox(self, msg: AgentStep, state: EpisodeState | None) -> None:
        """A second turn-0 of one attempt (init redelivered after a crash) came with its own sandbox;
        the episode goes on in the first one, so this one would leak."""
        if msg.turn == 0 and (state is None or msg.sandbox != state.first.sandbox):
            await (await self.s.sandboxes.attach(msg.sandbox)).destroy()
            log.info("duplicate turn 0 dropped", episode_id=msg.episode_id, attempt=msg.attempt)

    async def _already_advanced(self, msg: AgentStep, meta: MessageMeta, start: int) -> bool:
        """True when the log already holds a later turn of this attempt (we crashed after producing
        it but before committing): running the turn again would repeat its tool calls."""
        later = await self.read_log(meta.topic, meta.partition, start, msg.episode_id)
        return any(m.attempt == msg.attempt and m.turn > msg.turn for _, m in later)

    async def _rebuild(self, msg: AgentStep, meta: MessageMeta) -> EpisodeState | None:
        """Replay this attempt's turn messages from its turn-0 offset (another worker ran them)."""
        if self.read_log is None or msg.start_offset is None:
            raise RuntimeError(f"episode {msg.episode_id} turn {msg.turn} arrived without its history "
                               "and this worker cannot read the log to rebuild it")
        events = [(o, m) for o, m in await self.read_log(meta.topic, meta.partition, msg.start_offset,
                                                          msg.episode_id) if m.attempt == msg.attempt]
        if any(m.turn > msg.turn for _, m in events):
            return None
        by_turn = {m.turn: (o, m) for o, m in events if m.turn <= msg.turn}
        if 0 not in by_turn:
            raise RuntimeError(f"episode {msg.episode_id}: turn-0 message not found at offset {msg.start_offset}")
        state = EpisodeState.start(by_turn[0][1], by_turn[0][0])
        for turn in range(1, msg.turn + 1):
            step = by_turn[turn][1]
            state.apply(step.last, observation_messages(step.last))
        log.info("episode rebuilt from log", episode_id=msg.episode_id, turn=msg.turn)
        return state

    # -- one turn ---------------------------------------------------------------------------
    async def _run_turn(self, state: EpisodeState, rank: Callable[[], float]) -> tuple[TurnRecord, str | None]:
        chat, turn = self.s.chat, state.next_turn
        budget = self.cfg.max_total_tokens - state.tokens_used
        f = state.first
        if budget <= 0:
            return self._prompt_too_long(state), "prompt_too_long"
        deadline = agent_deadline(self._task(state).metadata, f.ready_at)
        if deadline is not None and time.time() >= deadline:
            return self._out_of_time(state), AGENT_TIMEOUT
        params = SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                max_tokens=max(1, min(self.cfg.max_tokens_per_turn, budget)),
                                stop_token_ids=chat.stop_token_ids,
                                seed=episode_seed(f.episode_id, f.attempt) + turn, task_id=f.task_id, turn=turn)
        async with self._model_slot(rank):
            t0, gen_started_at = time.perf_counter(), time.time()
            gen = await self.s.inference.generate(state.token_ids, params)
            gen_s = time.perf_counter() - t0
        text = chat.decode(gen.token_ids)
        t1 = time.perf_counter()
        sandbox = await self.s.sandboxes.attach(state.first.sandbox)
        if not await sandbox.claim_turn(f"a{state.first.attempt}-t{turn}"):
            await sandbox.destroy()
            raise TurnReplayed(f"episode {state.first.episode_id} attempt {state.first.attempt} turn {turn} already "
                               "ran its tool calls once (a crash or rebalance before its produce); the sandbox was "
                               "destroyed and the attempt fails so the scheduler re-issues it in a fresh sandbox")
        context = self._tool_context(state, turn)
        if deadline is not None:
            sandbox = DeadlineSandbox(sandbox, deadline, self.s.cfg.sandbox.exec_timeout_s)
        outcome = await self._act(text, state, sandbox, context)
        fault_point("agent.after_tools")
        used = state.tokens_used + len(gen.token_ids)
        stop_reason = self._stop_reason(outcome.ends_episode, turn, used)
        if stop_reason is None and deadline is not None and time.time() >= deadline:
            stop_reason = AGENT_TIMEOUT
        user_message = None
        if stop_reason is None:
            user_message, user_done = await self._next_user_message(state, context, text, outcome)
            stop_reason = "user_done" if user_done else None
        tool_s = time.perf_counter() - t1
        hints = [] if stop_reason else self._hints(state, outcome, turn, used)
        record = TurnRecord(
            turn=turn, completion_ids=list(gen.token_ids), logprobs=list(gen.logprobs),
            policy_version=gen.policy_version, finish_reason=gen.finish_reason, assistant_text=text,
            observations=outcome.observations, hints=hints, gen_seconds=gen_s, tool_seconds=tool_s,
            gen_started_at=gen_started_at, gen_ended_at=gen_started_at + gen_s,
            tool_ended_at=gen_started_at + (t1 - t0) + tool_s, user_message=user_message,
            state=dict(context.state) if context.state != state.store else None)
        if stop_reason is None:
            record.observation_ids = self._observation_ids(state, record, gen.token_ids)
            if state.tokens_used + len(record.completion_ids) + len(record.observation_ids) >= self.cfg.max_total_tokens:
                record.observation_ids, stop_reason = [], "max_tokens"
        return record, stop_reason

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
        if turn + 1 >= self.cfg.max_turns:
            return "max_turns"
        if used >= self.cfg.max_total_tokens:
            return "max_tokens"
        return None

    def _observation_ids(self, state: EpisodeState, record: TurnRecord, completion: list[int]) -> list[int]:
        chat = self.s.chat
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

    def _task(self, state: EpisodeState):
        return self.s.taskset.get(state.first.task_id)

    def _tool_context(self, state: EpisodeState, turn: int):
        from rollway.tools.base import ToolContext

        f = state.first
        return ToolContext(task=self._task(state), episode_id=f.episode_id, attempt=f.attempt, turn=turn,
                           state=dict(state.store))

    async def _next_user_message(self, state: EpisodeState, context, text: str,
                                 outcome: ToolTurn) -> tuple[str | None, bool]:
        """The task set's `next_user_message` hook, seeing the episode with this turn in it."""
        from rollway.envs.base import Episode, UserTurn

        pending = [{"role": "tool" if o.tool else "user", "content": o.content} for o in outcome.observations]
        messages = [*state.messages, {"role": "assistant", "content": text}, *pending]
        episode = Episode(episode_id=context.episode_id, attempt=context.attempt, task=context.task,
                          messages=messages, turns=list(state.turns), state=context.state)
        reply = await self.s.taskset.next_user_message(context.task, episode)
        if isinstance(reply, UserTurn):
            return reply.content, reply.ends_episode
        return reply, False

    def _prompt_too_long(self, state: EpisodeState) -> TurnRecord:
        """The prompt alone fills agent.max_total_tokens: the episode ends before any model call, with a
        stop reason that says so (never a silent reward-0 `max_tokens`)."""
        log.warning("prompt longer than agent.max_total_tokens; episode ended without a model call",
                    episode_id=state.first.episode_id, prompt_tokens=state.tokens_used,
                    max_total_tokens=self.cfg.max_total_tokens)
        return TurnRecord(turn=state.next_turn, completion_ids=[], logprobs=[], policy_version=0,
                          finish_reason="prompt_too_long", assistant_text="")

    def _out_of_time(self, state: EpisodeState) -> TurnRecord:
        """The task's agent time ran out before this turn's model call: the episode ends (graded as it
        stands) with an empty turn."""
        log.info("task's agent time is up; episode ends", episode_id=state.first.episode_id, turn=state.next_turn)
        return TurnRecord(turn=state.next_turn, completion_ids=[], logprobs=[], policy_version=0,
                          finish_reason=AGENT_TIMEOUT, assistant_text="")

    async def _act(self, text: str, state: EpisodeState, sandbox, context=None) -> ToolTurn:
        from rollway.tools.registry import run_tool_calls

        tools = self.s.tools_for(self._task(state))
        return await run_tool_calls(text, tools, sandbox, self.s.cfg.tools, context)

    def _hints(self, state: EpisodeState, outcome: ToolTurn, turn: int, used: int) -> list[str]:
        from rollway.tools.hints import HintEngine

        previous = state.turns[-1] if state.turns else None
        prev_calls = [(o.tool, o.arguments) for o in previous.observations if o.tool] if previous else []
        return HintEngine(self.s.cfg.hints).hints(
            turn=turn, max_turns=self.cfg.max_turns, tokens_used=used, max_tokens=self.cfg.max_total_tokens,
            calls=outcome.call_pairs, previous_calls=prev_calls, errors=outcome.errors)

    # -- outputs ----------------------------------------------------------------------------
    def _next_step(self, state: EpisodeState) -> AgentStep:
        f = state.first
        return AgentStep(episode=f.episode, turn=state.next_turn, sandbox=f.sandbox,
                         start_offset=state.start_offset, last=state.turns[-1], deadline=f.deadline,
                         final_wave=f.final_wave)

    def _reward_request(self, state: EpisodeState, stop_reason: str) -> RewardRequest:
        f = state.first
        return RewardRequest(episode=f.episode, sandbox=f.sandbox, prompt_ids=list(f.prompt_ids or []),
                             messages=list(f.messages or []), turns=state.turns, stop_reason=stop_reason,
                             deadline=f.deadline)


class TurnReplayed(RuntimeError):
    """A turn's tool calls already started once in this sandbox: running them again could apply them
    twice (a non-idempotent edit, a second `git commit`)."""
