"""An episode's state as the agent rebuilds it from its event-sourced turn messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollway.schemas.messages import AgentStep, TurnRecord


@dataclass
class TokenStream:
    """The episode's tokens as the model saw and produced them, built in one place, turn by turn: the
    agent extends it after every turn (its next prompt) and the reward actor builds the trajectory's
    arrays with it. Invariants: `loss_mask` and `logprobs` have the length of `token_ids`; the mask is
    1 exactly on model tokens, where `logprobs` holds the behaviour logprob (None elsewhere);
    `turn_spans` holds each turn's [start, end) completion span."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def start(cls, prompt_ids: list[int]) -> TokenStream:
        return cls(list(prompt_ids), [0] * len(prompt_ids), [None] * len(prompt_ids))

    def append(self, record: TurnRecord, episode_id: str = "") -> None:
        """One turn: its completion (mask 1), then its observation tokens (mask 0)."""
        if len(record.logprobs) != len(record.completion_ids):
            raise ValueError(f"episode {episode_id} turn {record.turn}: {len(record.logprobs)} logprobs for "
                             f"{len(record.completion_ids)} tokens")
        start = len(self.token_ids)
        self.token_ids += record.completion_ids
        self.loss_mask += [1] * len(record.completion_ids)
        self.logprobs += record.logprobs
        self.turn_spans.append((start, len(self.token_ids)))
        self.token_ids += record.observation_ids
        self.loss_mask += [0] * len(record.observation_ids)
        self.logprobs += [None] * len(record.observation_ids)

    @classmethod
    def of(cls, prompt_ids: list[int], turns: list[TurnRecord], episode_id: str = "") -> TokenStream:
        stream = cls.start(prompt_ids)
        for record in turns:
            stream.append(record, episode_id)
        return stream


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


def observation_messages(record: TurnRecord) -> list[dict[str, Any]]:
    """Chat messages that a turn's observations (and hints) add after the assistant message."""
    msgs = [{"role": "tool" if o.tool else "user", "content": o.content} for o in record.observations]
    if record.hints:
        hint_text = "\n".join(record.hints)
        if msgs:
            msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"] + "\n\n" + hint_text}
        else:
            msgs.append({"role": "user", "content": hint_text})
    if record.user_message is not None:
        msgs.append({"role": "user", "content": record.user_message})
    return msgs


def transcript(messages: list[dict[str, Any]], turns: list[TurnRecord]) -> list[dict[str, Any]]:
    """The whole chat: the initial messages, then each turn's assistant message and what followed it."""
    out = list(messages)
    for record in turns:
        out.append({"role": "assistant", "content": record.assistant_text})
        out += observation_messages(record)
    return out


def final_state(turns: list[TurnRecord]) -> dict[str, Any]:
    """The state store after the last turn (the last non-None `state`)."""
    return next((dict(t.state) for t in reversed(turns) if t.state is not None), {})
