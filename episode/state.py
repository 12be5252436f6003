"""An episode's state as the agent rebuilds it from its event-sourced turn messages (its token stream:
episode/stream.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollway.episode.stream import TokenStream
from rollway.schemas.messages import AgentStep, TurnRecord


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

    @classmethod
    def start(cls, msg: AgentStep, offset: int) -> EpisodeState:
        if msg.turn != 0 or msg.prompt_ids is None or msg.messages is None:
            raise ValueError(f"episode {msg.episode_id}: turn-0 message without prompt_ids/messages")
        return cls(first=msg, start_offset=offset, stream=TokenStream.start(msg.prompt_ids),
                   messages=list(msg.messages))

    @property
    def next_turn(self) -> int:
        """The turn this state is ready to run."""
        return len(self.turns)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.first.tools or []

    def apply(self, record: TurnRecord, new_messages: list[dict[str, Any]]) -> None:
        """Append one finished turn: its completion, then the observation tokens."""
        if record.turn != self.next_turn:
            raise ValueError(f"episode {self.first.episode_id}: turn {record.turn} applied at {self.next_turn}")
        self.turns.append(record)
        if record.state is not None:
            self.store = dict(record.state)
        self.stream.append(record, self.first.episode_id)
        self.messages.append({"role": "assistant", "content": record.assistant_text})
        self.messages += new_messages

    @property
    def token_ids(self) -> list[int]:
        """The next prompt: every token so far."""
        return self.stream.token_ids

    @property
    def tokens_used(self) -> int:
        return len(self.token_ids)
