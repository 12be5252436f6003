"""The Responses API and the Anthropic Messages API, driven by the real `openai` and `anthropic` client
SDKs: each episode must be captured exactly as the same conversation over chat completions is (same
prompt ids to the engine, same segments), and what the gateway cannot serve is refused by name.

The scripted policy (policies/scripted.py) is the only fake part: it stands in for the model."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from conftest import run
from test_gateway import (
    SHELL,
    LoggedEngine,
    Program,
    check_against_engine,
    client_for,
    key,
    serve,
    tool_episode,
)

from rollway.gateway import rebuild_segments

FLAT_SHELL = {"type": "function", **SHELL["function"]}
HOSTED = [{"type": "web_search"}, {"type": "local_shell"}]
"""Non-function tools a Codex-like program declares: dropped from what the model sees."""
ANTHROPIC_SHELL = {"name": "shell", "description": SHELL["function"]["description"],
                   "input_schema": SHELL["function"]["parameters"]}


async def chat_reference() -> list[list[int]]:
    """The prompts the engine receives when the episode is played over chat completions."""
    engine = LoggedEngine()
    gateway, _ = await serve(engine)
    handle = gateway.open_episode(key())
    try:
        await tool_episode(_Plain(Program(client_for(gateway, handle))))
    finally:
        await gateway.stop()
    return [prompt for prompt, _ in engine.log]


class _Plain:
    def __init__(self, program: Program):
        self.inner = program

    async def call(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        return (await self.inner.call(messages, tools)).model_dump(exclude_none=True)


async def responses_episode(client: openai.AsyncOpenAI, stream: bool) -> None:
    """The tool episode as Codex plays it: stateless, the whole history re-sent as input items (the
    output items echoed back as received), flat function tools beside hosted ones."""
    items: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                         "text": "What does a.txt say?"}]}]
    kw = {"model": "policy", "instructions": "Be brief.", "tools": [FLAT_SHELL, *HOSTED], "store": False}
    for output in ("a.txt", "hello", None):
        if stream:
            async with client.responses.stream(input=items, **kw) as events:
                response = await events.get_final_response()
        else:
            response = await client.responses.create(input=items, **kw)
        assert response.status == "completed" and response.usage.output_tokens > 0
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if output is None:
            assert not calls and response.output_text == "The file says hello. Done."
            return
        assert calls[0].name == "shell"
        items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": output})


async def messages_episode(client: anthropic.AsyncAnthropic, stream: bool) -> None:
    """The tool episode as a program on the Anthropic SDK plays it."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does a.txt say?"}]
    kw = {"model": "policy", "max_tokens": 512, "system": "Be brief.",
          "tools": [ANTHROPIC_SHELL, {"type": "web_search_20250305", "name": "web_search"}]}
    for output in ("a.txt", "hello", None):
        if stream:
            async with client.messages.stream(messages=messages, **kw) as events:
                message = await events.get_final_message()
        else:
            message = await client.messages.create(messages=messages, **kw)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        uses = [b for b in message.content if b.type == "tool_use"]
        if output is None:
            assert message.stop_reason == "end_turn" and not uses
            assert message.content[0].text == "The file says hello. Done."
            return
        assert message.stop_reason == "tool_use" and uses[0].name == "shell" and uses[0].input["command"]
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                      "content": output}]})


@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_episode_over_each_api_is_captured_as_over_chat_completions(api, stream):
    async def scenario():
        reference = await chat_reference()
        engine = LoggedEngine()
        gateway, recorder = await serve(engine)
        handle = gateway.open_episode(key())
        try:
            if api == "responses":
                await responses_episode(client_for(gateway, handle), stream)
            else:
                client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=handle.api_key, max_retries=0)
                await messages_episode(client, stream)
        finally:
            await gateway.stop()
        return reference, engine, recorder.of("ep-1"), handle

    reference, engine, calls, handle = run(scenario())
    assert [prompt for prompt, _ in engine.log] == reference  # token for token what chat completions renders
    assert [c.api for c in calls] == [api] * 3 and handle.unsupported is None
    assert [c.segment_reason for c in calls] == ["start", None, None]
    assert [t["function"]["name"] for t in calls[0].tools] == ["shell"]  # the hosted tools never reach the model
    check_against_engine(calls, engine)
    [segment] = rebuild_segments(calls)
    assert segment.token_ids == engine.log[-1][0] + engine.log[-1][1].token_ids


def test_a_stop_sequence_is_reported_as_the_messages_api_names_it():
    async def scenario():
        gateway, recorder = await serve(LoggedEngine())
        handle = gateway.open_episode(key())
        client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=handle.api_key, max_retries=0)
        try:
            return await client.messages.create(model="m", max_tokens=64, stop_sequences=["shell"],
                                                messages=[{"role": "user", "content": "go"}]), recorder.calls
        finally:
            await gateway.stop()

    message, calls = run(scenario())
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "shell"
    assert "shell" not in message.content[0].text and "shell" in calls[0].raw_text


REFUSED = [
    ("responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {"store": True}, "store"),
    ("responses", {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image",
                                                                               "image_url": "x"}]}]},
     "input[0].content[0]"),
    ("responses", {"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ("responses", {"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ("messages", {"top_k": 5}, "top_k"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
]


@pytest.mark.parametrize(("api", "extra", "param"), REFUSED, ids=[p for _, _, p in REFUSED])
def test_what_the_gateway_does_not_serve_is_refused_by_name_and_marks_the_episode(api, extra, param):
    async def scenario():
        gateway, recorder = await serve(LoggedEngine())
        handle = gateway.open_episode(key())
        body: dict[str, Any] = ({"model": "m", "input": "hi"} if api == "responses" else
                                {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
        body.update(extra)
        headers = {"Authorization": f"Bearer {handle.api_key}"}
        try:
            async with aiohttp.ClientSession() as session, \
                    session.post(f"{gateway.url}/v1/{api}", json=body, headers=headers) as response:
                return response.status, await response.json(), recorder.calls, handle
        finally:
            await gateway.stop()

    status, body, calls, handle = run(scenario())
    assert status == 400 and not calls
    message = body["error"]["message"]
    assert param.split(".")[0].split("[")[0] in message or param in message
    if api == "responses":
        assert body["error"]["param"] == param and body["error"]["code"] == "unsupported_option"
    else:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert handle.unsupported == message  # the attempt cannot succeed here: it fails for good


def test_an_endpoint_the_gateway_does_not_serve_is_named_and_marks_the_episode():
    async def scenario():
        gateway, _ = await serve(LoggedEngine())
        handle = gateway.open_episode(key())
        client = client_for(gateway, handle)
        try:
            with pytest.raises(openai.NotFoundError) as caught:
                await client.embeddings.create(model="m", input="hi")
            return caught.value, handle
        finally:
            await gateway.stop()

    err, handle = run(scenario())
    assert "POST /v1/embeddings is not served" in str(err) and err.body["code"] == "unsupported_endpoint"
    assert handle.unsupported is not None and "/v1/embeddings" in handle.unsupported


# -- size bounds ------------------------------------------------------------------------------------


def test_a_segment_past_the_bound_is_refused_and_the_episode_keeps_what_it_has():
    async def scenario():
        engine = LoggedEngine()
        gateway, recorder = await serve(engine)
        handle = gateway.open_episode(key(), max_segments=1)
        program = _Plain(Program(client_for(gateway, handle)))
        try:
            messages = await tool_episode(program)
            compacted = [messages[0], {"role": "user", "content": "Summary: ls showed a.txt."}, *messages[4:]]
            with pytest.raises(openai.APIStatusError) as caught:
                await program.call(compacted, [SHELL])  # would open segment 1
            return caught.value, recorder.of("ep-1"), handle
        finally:
            await gateway.stop()

    err, calls, handle = run(scenario())
    assert err.status_code == 409 and err.body["code"] == "segment_limit_reached" and "1 segments" in str(err)
    assert handle.stop_reason == "segment_limit" and handle.unsupported is None
    assert [c.segment for c in calls] == [0, 0, 0] and len(rebuild_segments(calls)) == 1


def test_sampled_tokens_never_pass_the_bound_and_the_next_call_is_refused():
    async def scenario():
        gateway, recorder = await serve(LoggedEngine())
        handle = gateway.open_episode(key(), max_trained_tokens=100)
        client = client_for(gateway, handle)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Go."}]
        try:
            with pytest.raises(openai.APIStatusError) as caught:
                for _ in range(5):
                    reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
                    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "More."}]
            return caught.value, recorder.of("ep-1"), handle
        finally:
            await gateway.stop()

    err, calls, handle = run(scenario())
    assert err.status_code == 409 and err.body["code"] == "token_limit_reached"
    assert handle.stop_reason == "token_limit" and len(calls) == 2 and len(calls[0].output_ids) < 100
    [segment] = rebuild_segments(calls)
    # The call that reached the bound was cut to what was left (finish_reason length): exactly 100 trained.
    assert sum(segment.loss_mask) == 100 == handle.trained_tokens and calls[-1].finish_reason == "length"


# -- side conversations -----------------------------------------------------------------------------

TITLE = [{"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
         {"role": "user", "content": "What does a.txt say?"}]


class _WithTitles(_Plain):
    """An opencode-like program: a title call before its first call and after its second."""

    async def call(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        if len(messages) in (2, 4):
            await self.inner.client.chat.completions.create(model="m", messages=TITLE)
        return await super().call(messages, tools)


@pytest.mark.parametrize("rules", ["shipped", "none"])
def test_a_side_conversation_is_recorded_apart_and_the_episode_stream_goes_on(rules):
    from rollway.episode.calls import outcome_of
    from rollway.gateway.side import SHIPPED

    async def scenario():
        engine = LoggedEngine()
        gateway, recorder = await serve(engine, side_rules=SHIPPED["opencode"] if rules == "shipped" else ())
        handle = gateway.open_episode(key(), max_segments=None if rules == "none" else 1)
        try:
            await tool_episode(_WithTitles(Program(client_for(gateway, handle))))
        finally:
            await gateway.stop()
        return recorder.of("ep-1")

    calls = run(scenario())
    assert len(calls) == 5
    segments = rebuild_segments(calls)
    outcome = outcome_of(calls, "harness_exit", [])
    if rules == "none":  # before: each title call is a segment of the episode, trained with it
        assert [s.reason for s in segments] == ["start", "tools_changed", "tools_changed", "tools_changed"]
        assert outcome.side_calls == []
        return
    assert [c.side_call for c in calls] == ["opencode-title", None, "opencode-title", None, None]
    assert [c.segment for c in calls] == [-1, 0, -1, 0, 0]
    assert [c.segment_reason for c in calls] == [None, "start", None, None, None]
    [segment] = segments  # the main conversation is one stream: each call extends it
    assert segment.call_indices == [1, 3, 4] and len(outcome.turns) == 3
    assert [c["name"] for c in outcome.side_calls] == ["opencode-title"] * 2
    assert outcome.side_calls[0]["system"].startswith("You are a title generator")
    assert [t.call_index for t in outcome.turns] == [1, 3, 4]  # side calls are never turns (never trained)


# -- the answer the program kept --------------------------------------------------------------------


def test_of_two_answers_to_one_request_the_one_the_next_call_extends_is_trained():
    """Two identical requests sent concurrently (seeds differ, so the answers do): the second is recorded
    as a retry of the first. The program goes on from the FIRST answer: that one is trained, in the same
    segment, and the retry's answer is recorded and not trained."""
    from rollway.policies.config import ScriptRule

    rules = [ScriptRule(turns=["first answer", "done"], alternatives=[["second answer", "done"]])]

    async def scenario():
        engine = LoggedEngine(rules)
        gateway, recorder = await serve(engine)
        handle = gateway.open_episode(key())
        client = client_for(gateway, handle)
        ask = [{"role": "user", "content": "Say something."}]
        replies = [(await client.chat.completions.create(model="m", messages=ask, seed=seed)).choices[0].message
                   for seed in (0, 1)]  # one after the other: the order the gateway's lock gives them
        kept = replies[0]
        await client.chat.completions.create(model="m", messages=[
            *ask, {"role": "assistant", "content": kept.content}, {"role": "user", "content": "Go on."}])
        await gateway.stop()
        return engine, recorder.of("ep-1"), [r.content for r in replies]

    engine, calls, answers = run(scenario())
    assert answers == ["first answer", "second answer"]
    assert [(c.retry_of, c.continues_call, c.segment_reason) for c in calls] == [
        (None, None, "start"), (0, None, None), (None, 0, None)]
    assert [c.output_ids for c in calls] == [g.token_ids for _, g in engine.log]
    [segment] = rebuild_segments(calls)
    assert segment.call_indices == [0, 2]  # the retry's answer (call 1) is not trained
    start, end = segment.turn_spans[0]
    assert segment.token_ids[start:end] == calls[0].output_ids and set(segment.loss_mask[start:end]) == {1}
    assert segment.token_ids == engine.log[-1][0] + engine.log[-1][1].token_ids


MALFORMED = [
    ("responses", {"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "[" * 100000}]}),
    ("responses", {"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{"}]}),
    ("responses", {"input": 5}), ("responses", {"input": [7]}), ("responses", {"tools": [{"type": "function"}]}),
    ("responses", {"input": [{"role": "wizard", "content": "x"}]}), ("responses", {"temperature": "hot"}),
    ("messages", {"temperature": "hot"}), ("messages", {"temperature": 1.5}), ("messages", {"max_tokens": None}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}),
    ("messages", {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": 1}]}]}),
    ("messages", {"tool_choice": {"type": "magic"}}), ("messages", {"system": 5}),
]


@pytest.mark.parametrize(("api", "extra"), MALFORMED)
def test_malformed_requests_get_a_400_never_a_500_and_do_not_mark_the_episode(api, extra):
    async def scenario():
        gateway, recorder = await serve(LoggedEngine())
        handle = gateway.open_episode(key())
        body: dict[str, Any] = ({"model": "m", "input": "hi"} if api == "responses" else
                                {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
        body.update(extra)
        try:
            async with aiohttp.ClientSession() as session, session.post(
                    f"{gateway.url}/v1/{api}", json=body, headers={"x-api-key": handle.api_key}) as response:
                return response.status, recorder.calls, handle
        finally:
            await gateway.stop()

    status, calls, handle = run(scenario())
    assert status == 400 and not calls and handle.unsupported is None
