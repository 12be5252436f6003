"""An episode's token stream, built in one place from its prompt and turn records (the agent's next
prompt, the reward stage's trajectory arrays), and the chat messages each turn adds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollway.schemas.messages import TurnRecord


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
    segment_starts: list[int] = field(default_factory=list)
    """Where each later segment (a turn with `segment_prompt_ids`) begins."""

    @classmethod
    def start(cls, prompt_ids: list[int]) -> TokenStream:
        return cls(list(prompt_ids), [0] * len(prompt_ids), [None] * len(prompt_ids))

    def append(self, record: TurnRecord, episode_id: str = "") -> None:
        """One turn: its completion (mask 1), then its observation tokens (mask 0)."""
        if len(record.logprobs) != len(record.completion_ids):
            raise ValueError(f"episode {episode_id} turn {record.turn}: {len(record.logprobs)} logprobs for "
                             f"{len(record.completion_ids)} tokens")
        if record.segment_prompt_ids is not None:  # a harness call that opened a new stream
            self.segment_starts.append(len(self.token_ids))
            self.token_ids += record.segment_prompt_ids
            self.loss_mask += [0] * len(record.segment_prompt_ids)
            self.logprobs += [None] * len(record.segment_prompt_ids)
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
