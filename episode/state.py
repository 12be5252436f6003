"""An episode's state as the agent rebuilds it from its event-sourced turn messages (its token stream:
episode/stream.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rollway.episode.deadline import agent_deadline
from rollway.episode.stream import TokenStream, observation_messages
from rollway.schemas.messages import AgentStep, RewardRequest, TurnRecord


@dataclass
class EpisodeState:
    """Everything the agent needs for the next turn. Built from the turn-0 message, then one
    `TurnRecord` per later message (`apply`)."""

    first: AgentStep
    """The turn-0 message: identity, sandbox, prompt, messages, tools."""
    start_offset: int
    """Offset of the turn-0 message in its partition."""
    turns: list[TurnRecord] = field(default_factory=list)
    stream: TokenStream = field(default_factory=TokenStream)
    messages: list[dict[str, Any]] = field(default_factory=list)
    store: dict[str, Any] = field(default_factory=dict)
    """The episode's state store (ToolContext.state) after the last applied turn."""
    task: Any = None
    """The episode's task (`begin`: on its first turn on this worker)."""
    deadline: float | None = None
    """When the agent phase ends (unix seconds): the task's agent time or the scheduler's agent time
    (scheduler.agent_time_s), from the sandbox being ready; None: no limit."""

    @classmethod
    def start(cls, msg: AgentStep, offset: int) -> EpisodeState:
        if msg.turn != 0 or msg.prompt_ids is None or msg.messages is None:
            raise ValueError(f"episode {msg.episode_id}: turn-0 message without prompt_ids/messages")
        return cls(first=msg, start_offset=offset, stream=TokenStream.start(msg.prompt_ids),
                   messages=list(msg.messages))

    def begin(self, task: Any, agent_time_s: float | None = None) -> None:
        """Start the episode on this worker: its task, and when its agent phase ends (episode/deadline.py;
        `agent_time_s`, scheduler.agent_time_s, bounds an episode the scheduler issued with a deadline)."""
        self.task = task
        self.deadline = agent_deadline(task.metadata, self.first.ready_at, agent_time_s if self.first.deadline else None)

    def agent_time_left(self) -> float | None:
        """Seconds until `deadline` (negative once past it); None: no limit."""
        return None if self.deadline is None else self.deadline - time.time()

    @property
    def next_turn(self) -> int:
        """The turn this state is ready to run."""
        return len(self.turns)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.first.tools or []

    def apply(self, record: TurnRecord, new_messages: list[dict[str, Any]] | None = None) -> None:
        """Append one finished turn: its completion, then the observation tokens (`new_messages`: the chat
        messages the turn adds after the assistant's, by default those of its observations)."""
        if record.turn != self.next_turn:
            raise ValueError(f"episode {self.first.episode_id}: turn {record.turn} applied at {self.next_turn}")
        self.turns.append(record)
        if record.state is not None:
            self.store = dict(record.state)
        self.stream.append(record, self.first.episode_id)
        self.messages.append({"role": "assistant", "content": record.assistant_text})
        self.messages += observation_messages(record) if new_messages is None else new_messages

    def next_step(self) -> AgentStep:
        """The next turn's message: the last turn's record (a delta), and where turn 0 lies in the log."""
        f = self.first
        return AgentStep(episode=f.episode, turn=self.next_turn, sandbox=f.sandbox, start_offset=self.start_offset,
                         last=self.turns[-1], deadline=f.deadline, final_wave=f.final_wave)

    def reward_request(self, stop_reason: str, failure: dict[str, str] | None = None) -> RewardRequest:
        """The finished episode, for the reward stage."""
        f = self.first
        return RewardRequest(episode=f.episode, sandbox=f.sandbox, prompt_ids=list(f.prompt_ids or []),
                             messages=list(f.messages or []), turns=list(self.turns), stop_reason=stop_reason,
                             deadline=f.deadline, failure=failure)

    @property
    def token_ids(self) -> list[int]:
        """The next prompt: every token so far."""
        return self.stream.token_ids

    @property
    def tokens_used(self) -> int:
        return len(self.token_ids)
