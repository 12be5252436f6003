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
