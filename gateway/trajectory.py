"""An episode's trainable pieces rebuilt from its captured calls alone (the log is the record)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rollway.schemas.messages import CapturedCall


class CallLogError(ValueError):
    """Captured calls that do not make one episode's stream (a gap, or a call out of place)."""


@dataclass
class Segment:
    """One token stream of an episode. Invariants: `token_ids`, `loss_mask` and `logprobs` have equal
    length; `loss_mask` is 1 exactly on sampled tokens, where `logprobs` holds the behaviour logprob
    (None elsewhere); `turn_spans[k]` is [start, end) of the k-th kept call's output."""

    index: int
    reason: str
    """Why the segment opened (start, history_rewritten, system_changed, tools_changed, prompt_changed)."""
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_policy_versions: list[int] = field(default_factory=list)
    call_indices: list[int] = field(default_factory=list)
    """The calls whose outputs the segment keeps (a retried call's is replaced by its retry's)."""
    retries: int = 0

    def trajectory_fields(self) -> dict[str, Any]:
        """The segment under the token fields of a `Trajectory` (schemas/messages.py), for the learner:
        one segment trains like one episode whose prompt is everything before its first output."""
        return {"token_ids": list(self.token_ids), "loss_mask": list(self.loss_mask), "logprobs": list(self.logprobs),
                "turn_policy_versions": list(self.turn_policy_versions), "turn_spans": list(self.turn_spans),
                "num_turns": len(self.turn_spans),
                "prompt_length": self.turn_spans[0][0] if self.turn_spans else len(self.token_ids)}

    def _cut(self, at: int) -> None:
        del self.token_ids[at:], self.loss_mask[at:], self.logprobs[at:]
        keep = [i for i, (start, _) in enumerate(self.turn_spans) if start < at]
        self.turn_spans = [self.turn_spans[i] for i in keep]
        self.turn_policy_versions = [self.turn_policy_versions[i] for i in keep]
        self.call_indices = [self.call_indices[i] for i in keep]

    def add(self, call: CapturedCall, kept: CapturedCall | None = None) -> None:
        """Append `call`; `kept`: the call whose answer it goes on from (`continues_call`), put back first."""
        if kept is not None:
            self._cut(kept.prompt_start + len(kept.prompt_ids))
            self._output(kept)
        if call.prompt_start > len(self.token_ids):
            raise CallLogError(f"episode {call.episode_id}: call {call.call_index} starts at token "
                               f"{call.prompt_start} of segment {self.index}, which has {len(self.token_ids)}")
        self._cut(call.prompt_start)
        self.retries += call.retry_of is not None
        self.token_ids += call.prompt_ids
        self.loss_mask += [0] * len(call.prompt_ids)
        self.logprobs += [None] * len(call.prompt_ids)
        self._output(call)

    def _output(self, call: CapturedCall) -> None:
        start = len(self.token_ids)
        self.token_ids += call.output_ids
        self.loss_mask += [1] * len(call.output_ids)
        self.logprobs += call.logprobs
        self.turn_spans.append((start, len(self.token_ids)))
        self.turn_policy_versions.append(call.policy_version)
        self.call_indices.append(call.call_index)


def rebuild_segments(calls: Iterable[CapturedCall]) -> list[Segment]:
    """The segments of one episode attempt from its call records, in any order and with duplicates
    (an at-least-once log): each call index counts once; the indices must run 0..n-1 without gaps."""
    by_index: dict[int, CapturedCall] = {}
    for call in calls:
        by_index.setdefault(call.call_index, call)
    ordered = [by_index[i] for i in sorted(by_index)]
    attempts = {(c.episode_id, c.attempt) for c in ordered}
    if len(attempts) > 1:
        raise CallLogError(f"calls of several episode attempts given together: {sorted(attempts)}")
    segments: list[Segment] = []
    for expected, call in enumerate(ordered):
        if call.call_index != expected:
            raise CallLogError(f"episode {call.episode_id}: call {expected} is missing from the record")
        if call.side_call is not None:
            continue  # a side conversation: recorded, not part of any segment
        if call.segment_reason is not None:
            if call.segment != len(segments):
                raise CallLogError(f"episode {call.episode_id}: call {call.call_index} opens segment "
                                   f"{call.segment}, expected {len(segments)}")
            segments.append(Segment(call.segment, call.segment_reason))
        elif not segments or call.segment != segments[-1].index:
            raise CallLogError(f"episode {call.episode_id}: call {call.call_index} continues segment "
                               f"{call.segment}, which no earlier call opened")
        kept = by_index.get(call.continues_call) if call.continues_call is not None else None
        if call.continues_call is not None and (kept is None or kept.segment != call.segment):
            raise CallLogError(f"episode {call.episode_id}: call {call.call_index} goes on from call "
                               f"{call.continues_call}, which is not in its segment")
        segments[-1].add(call, kept)
    return segments
