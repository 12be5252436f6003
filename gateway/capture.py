"""One episode's token stream as the gateway keeps it: incremental rendering, segments, retries."""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollway.gateway.protocol import Reply
from rollway.policies.base import ChatFormat
from rollway.schemas.messages import CapturedCall


@dataclass(frozen=True)
class _SegmentCall:
    index: int
    n_messages: int
    """Request messages the call answered (chat) - its position in the conversation."""
    prompt_end: int
    """Length of the segment's stream at the end of the call's prompt (its output starts there)."""
    output_ids: list[int] = field(default_factory=list)
    assistant: dict[str, Any] | None = None
    """The answer returned (chat), so an answer a retry superseded can be taken back."""


@dataclass
class Plan:
    """Where a request goes in the episode's stream, computed before the engine runs and applied by
    `commit` only after the call is recorded (a call that fails to record leaves no trace)."""

    prompt_ids: Sequence[int]
    """The whole prompt the engine receives (an `array`, see `ids`)."""
    delta: Sequence[int]
    """The tokens this call adds at `prompt_start` (the whole prompt when a segment opens)."""
    prompt_start: int
    segment_reason: str | None
    retry_of: int | None
    new_messages: list[dict[str, Any]]
    keep_messages: int
    """Messages of the recorded conversation kept before `new_messages`."""
    tools: list[dict[str, Any]]
    side: str | None = None
    """A side call (gateway/side.py): a full render of its own, leaving the episode's stream as it was."""
    continues: int | None = None
    """The call whose answer (superseded by a retry) this request goes on from: that answer is put back
    in the stream at its place before `delta` (the program kept it, not the retry's)."""


@dataclass
class EpisodeCapture:
    """The current segment of one episode: the recorded conversation (the program's messages and each
    sampled assistant turn), its render form, and its token stream (prompts then sampled ids).

    A request whose messages extend the conversation - the same messages, each assistant turn equal
    to what was returned for it - is rendered from the new messages only (`ChatFormat.continuation`),
    so sampled turns keep their sampled ids. The same request again is a retry of its position. Any
    other request opens a segment from a full render, with the reason recorded."""

    chat: ChatFormat
    segment: int = -1
    api: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    conversation: list[dict[str, Any]] = field(default_factory=list)
    rendered: list[dict[str, Any]] = field(default_factory=list)
    stream: array = field(default_factory=lambda: ids(()))
    calls: list[_SegmentCall] = field(default_factory=list)
    next_index: int = 0
    superseded: list[_SegmentCall] = field(default_factory=list)
    """Answers that a retry of the same request replaced, until the program's next call says which it
    kept: that call extends one of them (`Plan.continues`) or the last answer (they are dropped)."""
    raw_texts: dict[str, str] = field(default_factory=dict)
    """Sampled text of each assistant turn returned in this episode (by its comparison key), so a full
    render after a rewrite shows the model's turn as it wrote it."""

    # -- chat ---------------------------------------------------------------------------------------

    def plan_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  render_limit: int | None = None) -> Plan | None:
        """Where the request goes. With `render_limit`, None instead of a plan that would tokenise more
        than about that many characters of the request (the caller plans it again off its event loop)."""
        if self.api == "chat" and tools == self.tools:
            retried = self._retried(messages)
            if retried is not None:
                return self._retry_plan(retried, [])
            if len(messages) > len(self.conversation) and _same_prefix(self.conversation, messages):
                new = messages[len(self.conversation):]
                return None if _over(render_limit, new) else self._extension_plan(new, tools)
            for answer in reversed(self.superseded):
                head = [*self.conversation[: answer.n_messages], answer.assistant]
                if len(messages) > len(head) and _same_prefix(head, messages):
                    new = messages[len(head):]
                    return None if _over(render_limit, [answer.assistant, *new]) \
                        else self._continuation_of(answer, new, tools)
        if _over(render_limit, messages, tools):
            return None
        prompt = ids(self.chat.initial(self._render(messages), tools))
        return Plan(prompt, prompt, 0, self._reason(messages, tools), None, list(messages), 0, tools)

    def plan_side(self, name: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  render_limit: int | None = None) -> Plan | None:
        if _over(render_limit, messages, tools):
            return None
        prompt = ids(self.chat.initial(self._render(messages), tools))
        return Plan(prompt, prompt, 0, None, None, list(messages), 0, tools, side=name)

    def _retried(self, messages: list[dict[str, Any]]) -> _SegmentCall | None:
        for call in reversed(self.calls):
            if call.n_messages == len(messages):
                return call if _same_prefix(self.conversation[: call.n_messages], messages) else None
        return None

    def _retry_plan(self, call: _SegmentCall, new: list[dict[str, Any]]) -> Plan:
        return Plan(self.stream[: call.prompt_end], [], call.prompt_end, None, call.index, new,
                    call.n_messages, self.tools)

    def _extension_plan(self, new: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Plan:
        delta = self.chat.continuation(self.rendered, self._render(new), tools)
        if not self.stream or self.stream[-1] not in self.chat.stop_token_ids:
            delta = [self.chat.stop_token_ids[0], *delta]  # a cut turn is closed (not a model token)
        return Plan(self.stream + ids(delta), delta, len(self.stream), None, None, new, len(self.conversation), tools)

    def _continuation_of(self, answer: _SegmentCall, new: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Plan:
        """The request goes on from `answer`, which a retry superseded: the stream up to its prompt, its
        output ids again, then the new messages."""
        base = self.stream[: answer.prompt_end]
        base.extend(answer.output_ids)
        rendered = [*self.rendered[: answer.n_messages], *self._render([answer.assistant])]
        delta = self.chat.continuation(rendered, self._render(new), tools)
        if not base or base[-1] not in self.chat.stop_token_ids:
            delta = [self.chat.stop_token_ids[0], *delta]
        return Plan(base + ids(delta), delta, len(base), None, None, new, answer.n_messages + 1, tools,
                    continues=answer.index)

    def _reason(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        if self.segment < 0:
            return "start"
        if self.api == "chat" and tools != self.tools:
            return "tools_changed"
        old = self.conversation
        if self.api == "chat" and old and (old[0]["role"] == "system" or messages[0]["role"] == "system") \
                and old[0] != messages[0]:
            return "system_changed"
        return "history_rewritten"

    def _render(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the chat format renders them: role and text; an assistant turn as the
        model wrote it when it was sampled here, else its content with tool calls in Hermes tags."""
        out = []
        for m in messages:
            if m["role"] == "assistant":
                text = self.raw_texts.get(_key(m))
                if text is None:
                    blocks = [json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in m["tool_calls"]]
                    text = "".join([m["content"], *(f"\n<tool_call>\n{b}\n</tool_call>" for b in blocks)])
                out.append({"role": "assistant", "content": text})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return out

    def drifted(self, plan: Plan) -> bool:
        """Whether a from-scratch render of the plan's conversation differs from its prompt ids (never
        for a call that opens a segment: that prompt is a from-scratch render). Costs a full render."""
        if plan.segment_reason is not None or plan.side is not None or self.api != "chat":
            return False
        head = self.rendered[: plan.keep_messages]
        if plan.continues is not None:  # the kept answer, not the retry's now in `rendered`
            answer = next(c for c in self.superseded if c.index == plan.continues)
            head = [*self.rendered[: answer.n_messages], *self._render([answer.assistant])]
        history = [*head, *self._render(plan.new_messages)]
        return self.chat.drift(history, plan.tools, plan.prompt_ids)

    # -- completions --------------------------------------------------------------------------------

    def plan_completion(self, tokens: list[int]) -> Plan:
        prompt = ids(tokens)
        if self.api == "completions":
            for call in reversed(self.calls):
                if call.prompt_end == len(prompt) and self.stream[: call.prompt_end] == prompt:
                    return self._retry_plan(call, [])
            if prompt[: len(self.stream)] == self.stream:
                delta = prompt[len(self.stream):]
                return Plan(prompt, delta, len(self.stream), None, None, [], 0, [])
        reason = "start" if self.segment < 0 else "prompt_changed"
        return Plan(prompt, prompt, 0, reason, None, [], 0, [])

    # -- rebuilt from the record ---------------------------------------------------------------------

    @classmethod
    def restore(cls, chat: ChatFormat, calls: list[CapturedCall]) -> EpisodeCapture:
        """The capture as it stood after `calls` (an episode's records, any order, duplicates allowed),
        so a gateway started after a crash continues the episode: the program's retried call is a
        retry, its next call an extension, and call indices go on from the last recorded one."""
        from rollway.gateway.trajectory import rebuild_segments

        rebuild_segments(calls)  # refuses gaps and misplaced calls, naming them
        capture = cls(chat)
        for call in sorted({c.call_index: c for c in calls}.values(), key=lambda c: c.call_index):
            capture.commit(capture._replayed(call), call.api, call.output_ids,
                           Reply(call.content, call.tool_calls, call.finish_reason, call.raw_text))
        return capture

    def _replayed(self, call: CapturedCall) -> Plan:
        if call.side_call is not None:
            return Plan([], call.prompt_ids, 0, None, None, call.new_messages, 0, call.tools or [], side=call.side_call)
        if call.segment_reason is not None:
            keep = 0
        elif call.continues_call is not None:
            keep = next(c.n_messages for c in self.superseded if c.index == call.continues_call) + 1
        elif call.retry_of is not None:
            keep = next(c.n_messages for c in self.calls if c.index == call.retry_of) - len(call.new_messages)
        else:
            keep = len(self.conversation)
        tools = call.tools if call.segment_reason is not None else self.tools
        return Plan([], call.prompt_ids, call.prompt_start, call.segment_reason, call.retry_of,
                    call.new_messages, keep, tools or [], continues=call.continues_call)

    # -- after the call is recorded -----------------------------------------------------------------

    def commit(self, plan: Plan, api: str, output_ids: list[int], reply: Reply) -> int:
        """Apply a recorded call; returns its call index."""
        if plan.side is not None:  # the episode's stream and conversation stay as they were
            self.next_index += 1
            return self.next_index - 1
        api = "completions" if api == "completions" else "chat"  # the conversation APIs share one form
        if plan.segment_reason is not None:
            self.segment += 1
            self.api, self.tools = api, plan.tools
            self.conversation, self.rendered, self.stream, self.calls = [], [], ids(()), []
        superseded, self.superseded = self.superseded, []  # the program's next call decides
        if plan.continues is not None:  # put the kept answer back; the retry's answer is dropped
            answer = next(c for c in superseded if c.index == plan.continues)
            del self.stream[answer.prompt_end:]
            self.stream.extend(answer.output_ids)
            self.calls = [*(c for c in self.calls if c.prompt_end < answer.prompt_end), answer]
            self.conversation = [*self.conversation[: answer.n_messages], answer.assistant]
            self.rendered = [*self.rendered[: answer.n_messages], *self._render([answer.assistant])]
        prompt_end = plan.prompt_start + len(plan.delta)
        # In place: the stream of a long history is not copied per call.
        del self.stream[plan.prompt_start:]
        self.stream.extend(plan.delta)
        self.stream.extend(output_ids)
        if plan.retry_of is not None:  # the answers it repeats stay until the next call decides
            self.superseded = [*superseded, *(c for c in self.calls if c.prompt_end == prompt_end
                                              and c.assistant is not None)]
        self.calls = [c for c in self.calls if c.prompt_end < prompt_end]
        index = self.next_index
        self.next_index += 1
        n_messages = plan.keep_messages + len(plan.new_messages)
        assistant = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
        self.calls.append(_SegmentCall(index, n_messages, prompt_end, list(output_ids),
                                       assistant if api == "chat" else None))
        if api == "chat":
            self.raw_texts[_key(assistant)] = reply.raw_text
            kept = plan.keep_messages
            self.conversation = [*self.conversation[:kept], *plan.new_messages, assistant]
            self.rendered = [*self.rendered[:kept], *self._render([*plan.new_messages, assistant])]
        return index


def ids(tokens: Sequence[int]) -> array:
    """Token ids as a C array: a long prompt held while the engine samples is one object the garbage
    collector does not walk (a list of 16k ids is walked item by item on every young-generation pass,
    about 1 ms per pass with 64 such prompts in flight). Ids are below `MAX_TOKEN_ID` (2**31)."""
    return array("i", tokens)


def _same(recorded: dict[str, Any], sent: dict[str, Any]) -> bool:
    """Whether the program's message is the recorded one; an assistant turn by its content (surrounding
    whitespace aside) and its tool calls' names and arguments (ids are not rendered)."""
    if recorded["role"] != "assistant" or sent["role"] != "assistant":
        return recorded == sent
    return (recorded["content"].strip() == sent["content"].strip()
            and [(c["name"], c["arguments"]) for c in recorded["tool_calls"]]
            == [(c["name"], c["arguments"]) for c in sent["tool_calls"]])


def _over(limit: int | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> bool:
    """Whether rendering `messages` (and `tools`) tokenises more than about `limit` characters (None: no limit):
    their text, tool calls and tool specs as the request gave them."""
    if limit is None:
        return False
    size = len(json.dumps(tools)) if tools else 0
    for m in messages:
        size += len(m["content"]) + sum(len(c["name"]) + len(str(c["arguments"])) for c in m.get("tool_calls") or ())
        if size > limit:
            return True
    return size > limit


def _same_prefix(recorded: list[dict[str, Any]], sent: list[dict[str, Any]]) -> bool:
    return len(sent) >= len(recorded) and all(_same(a, b) for a, b in zip(recorded, sent, strict=False))


def _key(assistant: dict[str, Any]) -> str:
    calls = [(c["name"], c["arguments"]) for c in assistant["tool_calls"]]
    return json.dumps([assistant["content"].strip(), calls], sort_keys=True, default=str)
