"""A harness episode's turn records, made from its program's captured calls: one TurnRecord per kept call,
with what the program sent back after it (tool results, user messages) for viewers and graders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollway.gateway.trajectory import Segment, rebuild_segments
from rollway.schemas.messages import CapturedCall, Observation, TurnRecord


@dataclass
class HarnessOutcome:
    """What the agent stage emits for a harness episode (as a RewardRequest)."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    turns: list[TurnRecord]
    stop_reason: str
    side_calls: list[dict[str, Any]]
    failure: dict[str, str] | None = None
    """The program's run failed after it started (base/blame.py: the agent's): grade details of the failure."""


SIDE_CALL_CHARS = 500
"""Characters of a side call's system prompt and text kept for viewers."""


def outcome_of(calls: list[CapturedCall], stop_reason: str, fallback_prompt: list[int]) -> HarnessOutcome:
    """The episode's turns from its captured calls: one TurnRecord per kept call; observation ids are
    the tokens the next call of the same segment added; a call that opened a later segment carries
    that segment's prompt (`segment_prompt_ids`). No calls: one empty turn on `fallback_prompt`."""
    side = [{"call_index": c.call_index, "name": c.side_call, "output_tokens": len(c.output_ids),
             "system": next((str(m.get("content")) for m in c.new_messages if m.get("role") == "system"), "")[
                 :SIDE_CALL_CHARS], "text": c.raw_text[:SIDE_CALL_CHARS]}
            for c in sorted({c.call_index: c for c in calls}.values(), key=lambda c: c.call_index)
            if c.side_call is not None]
    segments = rebuild_segments(calls) if calls else []
    if not segments:  # no call, or side calls only
        empty = TurnRecord(turn=0, completion_ids=[], logprobs=[], policy_version=0, finish_reason=stop_reason,
                           assistant_text="")
        return HarnessOutcome(list(fallback_prompt), [], [empty], stop_reason, side)
    by_index = {c.call_index: c for c in calls}
    turns: list[TurnRecord] = []
    for segment in segments:
        turns += _segment_turns(segment, by_index, first_turn=len(turns), opens=segment.index > 0)
    first = segments[0]
    messages = list(by_index[first.call_indices[0]].new_messages)
    return HarnessOutcome(first.token_ids[: first.turn_spans[0][0]], messages, turns, stop_reason, side)


def _segment_turns(segment: Segment, by_index: dict[int, CapturedCall], first_turn: int, opens: bool) -> list[TurnRecord]:
    ids, spans = segment.token_ids, segment.turn_spans
    turns = []
    for k, (start, end) in enumerate(spans):
        call = by_index[segment.call_indices[k]]
        nxt = spans[k + 1][0] if k + 1 < len(spans) else len(ids)
        following = by_index[segment.call_indices[k + 1]] if k + 1 < len(spans) else None
        observations, user_message = program_reply(call, following, by_index)  # for viewers and graders
        turns.append(TurnRecord(
            turn=first_turn + k, completion_ids=ids[start:end], logprobs=[float(x) for x in segment.logprobs[start:end]],
            policy_version=segment.turn_policy_versions[k], finish_reason=call.finish_reason,
            assistant_text=call.raw_text, observation_ids=ids[end:nxt], template_drift=call.template_drift,
            segment_prompt_ids=ids[:start] if opens and k == 0 else None,
            segment_reason=segment.reason if opens and k == 0 else None, call_index=call.call_index,
            temperature=call.temperature, top_p=call.top_p,
            call_attempt=call.episode.attempt,
            segment_messages=list(call.new_messages) if opens and k == 0 else None,
            observations=observations, user_message=user_message))
    return turns


def program_reply(call: CapturedCall, following: CapturedCall | None,
                  by_index: dict[int, CapturedCall]) -> tuple[list[Observation], str | None]:
    """What the program sent back after `call`'s reply, as a turn's observations and user message: the
    tool results and user messages that `following` (the next kept call of the same segment) added. A
    retry adds nothing of its own: the messages are on the call it repeats. Tool results are named by
    the tool call of `call` they answer."""
    source = following
    while source is not None and source.retry_of is not None and not source.new_messages:
        source = by_index.get(source.retry_of)
    if source is None:
        return [], None
    asked = {c.get("id"): c for c in call.tool_calls}
    observations, users = [], []
    for message in source.new_messages:
        if message.get("role") == "tool":
            tool_call = asked.get(message.get("tool_call_id"), {})
            arguments = tool_call.get("arguments")
            observations.append(Observation(tool=tool_call.get("name") or message.get("name") or "tool",
                                            arguments=arguments if isinstance(arguments, dict) else {},
                                            content=str(message.get("content") or ""),
                                            call_id=message.get("tool_call_id")))
        elif message.get("role") == "user":
            users.append(str(message.get("content") or ""))
    return observations, "\n\n".join(users) if users else None
