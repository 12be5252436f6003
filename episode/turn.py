"""The rules of a turn over an episode's state: budget and agent time, sampling, the environment's view,
stop rules, hints and the next prompt's observation tokens (actors/turn.py calls them; a test can too)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import structlog

from rollway.base.blame import AGENT_FAILURE, failure_details, failure_reason
from rollway.envs.base import Episode, Step
from rollway.episode.deadline import AGENT_TIMEOUT, DeadlineSandbox
from rollway.episode.hints import HintEngine
from rollway.episode.state import EpisodeState
from rollway.episode.stream import observation_messages
from rollway.policies.base import ChatFormat, Generation, SamplingParams, episode_seed
from rollway.sandboxes.base import Sandbox
from rollway.schemas.messages import TurnRecord
from rollway.tools.config import HintsConfig

log = structlog.get_logger()


class Turn(NamedTuple):
    record: TurnRecord
    stop_reason: str | None
    """Why the episode ends after this turn; None: it goes on."""
    failure: dict[str, str] | None = None
    """Grade details of a failure after the tool calls started (the agent's: the episode is graded 0)."""


@dataclass
class TurnRules:
    """An episode's limits and what its turns add besides the environment's answer (one per worker)."""

    agent: Any
    """The run's agent section: `max_turns`, `max_total_tokens`, `max_tokens_per_turn`, `temperature`, `top_p`."""
    hints: HintsConfig
    chat: ChatFormat
    exec_timeout_s: float
    """sandbox.exec_timeout_s: a command's limit when it names none (cut to the agent time left)."""
    agent_time_s: float | None = None
    """scheduler.agent_time_s: the longest an issued episode's agent phase runs from its sandbox being ready."""
    drift_count: int = 0
    context: int | None = None
    """The engine's context (`InferenceClient.context_tokens`; None: it does not say): an episode's tokens
    stay within it as within agent.max_total_tokens, so a prompt the engine would refuse is never sent."""

    @property
    def budget(self) -> int:
        """Tokens an episode may hold: agent.max_total_tokens, or the engine's context when smaller."""
        total = self.agent.max_total_tokens
        return total if self.context is None else min(total, self.context)

    def ended(self, state: EpisodeState) -> Turn | None:
        """The episode ends before the model call: its prompt fills agent.max_total_tokens or the engine's
        context (`prompt_too_long`, never a silent reward-0 `max_tokens`, graded as it stands like the agent's
        time being up), or the task's agent time is up."""
        if self.budget - state.tokens_used <= 0:
            log.warning("prompt as long as agent.max_total_tokens or the engine's context; episode ended without a "
                        "model call", episode_id=state.first.episode_id, turn=state.next_turn,
                        prompt_tokens=state.tokens_used)
            return self.without_output(state, "prompt_too_long")
        if state.deadline is not None and time.time() >= state.deadline:
            return self.timed_out(state)
        return None

    def timed_out(self, state: EpisodeState) -> Turn:
        """The episode's end when its agent time is up before this turn's model answered (or was asked)."""
        log.info("task's agent time is up; episode ends", episode_id=state.first.episode_id, turn=state.next_turn,
                 prompt_tokens=state.tokens_used)
        return self.without_output(state, AGENT_TIMEOUT)

    def tools_timed_out(self, state: EpisodeState, record: TurnRecord, view: Episode, tools: list[str]) -> Turn:
        """The turn's end when the agent's time ran out while its tool calls ran (they were cut): the model's
        message kept, no observations, `agent_timeout` whatever the wall clock says to the microsecond."""
        return self.record(state, record, Step(calls=[], observations=[], done=AGENT_TIMEOUT), view, tools)

    def without_output(self, state: EpisodeState, reason: str) -> Turn:
        return Turn(TurnRecord(turn=state.next_turn, completion_ids=[], logprobs=[], policy_version=0,
                               finish_reason=reason, assistant_text=""), reason)

    def sampling(self, state: EpisodeState) -> SamplingParams:
        """This turn's sampling: seeded by episode, attempt and turn; at most the budget left."""
        f, agent, turn = state.first, self.agent, state.next_turn
        return SamplingParams(temperature=agent.temperature, top_p=agent.top_p, stop_token_ids=self.chat.stop_token_ids,
                              max_tokens=max(1, min(agent.max_tokens_per_turn, self.budget - state.tokens_used)),
                              seed=episode_seed(f.episode_id, f.attempt) + turn, task_id=f.task_id, turn=turn)

    def completion(self, state: EpisodeState, gen: Generation, started_at: float, seconds: float) -> TurnRecord:
        """The turn's record so far. Ids that decode to lone surrogates (invalid UTF-8 from a byte-level model)
        become U+FFFD in the text, so the record encodes; the ids stay exactly as sampled."""
        text = self.chat.decode(gen.token_ids).encode("utf-8", "replace").decode("utf-8")
        return TurnRecord(turn=state.next_turn, completion_ids=list(gen.token_ids), logprobs=list(gen.logprobs),
                          policy_version=gen.policy_version, finish_reason=gen.finish_reason, assistant_text=text,
                          gen_seconds=seconds, gen_started_at=started_at, gen_ended_at=time.time())

    def guard(self, state: EpisodeState, sandbox: Sandbox) -> Sandbox:
        """The sandbox as the episode's tools see it: with an agent time limit, each command cut to what is left."""
        return sandbox if state.deadline is None else DeadlineSandbox(sandbox, state.deadline, self.exec_timeout_s)

    def view(self, state: EpisodeState, record: TurnRecord) -> Episode:
        """The episode as `Environment.step` sees it: a copy of the state store (kept if the turn is recorded),
        and the end the limits set after this turn whatever the step says."""
        f, used = state.first, state.tokens_used + len(record.completion_ids)
        ends = ("max_turns" if record.turn + 1 >= self.agent.max_turns else
                "max_tokens" if used >= self.agent.max_total_tokens else None)
        return Episode(f.episode_id, f.attempt, state.task, list(state.messages), list(state.turns),
                       dict(state.store), ends)

    def record(self, state: EpisodeState, record: TurnRecord, step: Step, view: Episode, tools: list[str]) -> Turn:
        """The turn's end. Stop rules, first that applies: `finish`, the limits, the agent time, the user's end.
        Going on, the turn keeps the user's message and hints and gets the next prompt's observation tokens."""
        stop = "finish" if step.done == "finish" else view.stop_reason
        if stop is None and state.deadline is not None and time.time() >= state.deadline:
            stop = AGENT_TIMEOUT
        stop, ended_at, used = stop or step.done, time.time(), state.tokens_used + len(record.completion_ids)
        out = msgspec.structs.replace(
            record, observations=step.observations, tool_ended_at=ended_at, tool_seconds=ended_at - record.gen_ended_at,
            user_message=step.user_message if stop in (None, "user_done") else None,
            hints=[] if stop else [*self._hints(state, step, record.turn, used, tools), *step.hints],
            state=dict(view.state) if view.state != state.store else None)
        if stop is None:
            out.observation_ids = self._observation_ids(state, out)
            if used + len(out.observation_ids) >= self.agent.max_total_tokens:
                out.observation_ids, stop = [], "max_tokens"
        return Turn(out, stop)

    def failed(self, state: EpisodeState, record: TurnRecord, err: Exception) -> Turn:
        """The turn failed after its tool calls started, the agent's failure: the episode ends here, graded 0."""
        log.warning("turn failed after its tool calls started; the episode is graded 0",
                    episode_id=state.first.episode_id, turn=record.turn, error=failure_reason(err)[:300])
        return Turn(record, AGENT_FAILURE, failure_details(err, "agent"))

    def _observation_ids(self, state: EpisodeState, record: TurnRecord) -> list[int]:
        chat, completion = self.chat, record.completion_ids
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

    def _hints(self, state: EpisodeState, step: Step, turn: int, used: int, tools: list[str]) -> list[str]:
        previous = state.turns[-1] if state.turns else None
        prev_calls = [(o.tool, o.arguments) for o in previous.observations if o.tool] if previous else []
        return HintEngine(self.hints).hints(
            turn=turn, max_turns=self.agent.max_turns, tokens_used=used, max_tokens=self.agent.max_total_tokens,
            calls=step.calls, previous_calls=prev_calls, errors=step.errors, tools=tools)
