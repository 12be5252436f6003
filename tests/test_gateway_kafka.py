"""The gateway recording to the real embedded broker: each call is in the log before its response
returns. The scripted policy (policies/scripted.py) is the only fake part (it stands in for the model)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from conftest import run
from test_gateway import SHELL, LoggedEngine, check_against_engine, key

from rollway.base.broker import BrokerConfig, TopicsConfig
from rollway.gateway import Gateway, KafkaRecorder, rebuild_segments
from rollway.policies.chat import BytesChatML
from rollway.schemas import decode
from rollway.schemas.messages import CapturedCall

pytestmark = pytest.mark.broker


async def read_calls(bootstrap: str, topics: TopicsConfig) -> list[CapturedCall]:
    """Every record of the gateway-calls topic, read by a fresh consumer from the log's start."""
    from aiokafka import TopicPartition

    from rollway.runtime.kafka import make_consumer, partitions_for, read_to_end, topic_name
    from rollway.topics import GATEWAY_CALLS

    name = topic_name(GATEWAY_CALLS, topics)
    tps = [TopicPartition(name, p) for p in range(partitions_for(GATEWAY_CALLS, topics))]
    consumer = await make_consumer(BrokerConfig(), bootstrap, group_id=None)
    try:
        ends = await consumer.end_offsets(tps)
        return [decode(r.value, CapturedCall) async for _, r in read_to_end(consumer, dict.fromkeys(tps), ends,
                                                                            timeout_s=30)]
    finally:
        await consumer.stop()


def test_each_call_is_in_the_log_before_its_response_returns(broker, topic_prefix):
    topics = TopicsConfig(prefix=topic_prefix)

    async def scenario():
        engine = LoggedEngine()
        recorder = await KafkaRecorder.connect(BrokerConfig(), topics, broker.bootstrap)
        gateway = Gateway(engine, BytesChatML(), recorder)
        await gateway.start()
        handle = gateway.open_episode(key("kafka-ep"))
        client = openai.AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What does a.txt say?"}]
        seen_after_each = []
        try:
            for output in ("a.txt", "hello", None):
                reply = (await client.chat.completions.create(model="m", messages=messages, tools=[SHELL])
                         ).choices[0].message
                # The response has returned: the call must already be acknowledged by the log.
                seen_after_each.append([c.call_index for c in await read_calls(broker.bootstrap, topics)])
                if output is not None:
                    messages += [reply.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": output}]
        finally:
            await gateway.stop()
            await recorder.close()
        return seen_after_each, await read_calls(broker.bootstrap, topics), engine

    seen_after_each, logged, engine = run(scenario())
    assert seen_after_each == [[0], [0, 1], [0, 1, 2]]
    assert {c.episode_id for c in logged} == {"kafka-ep"}
    check_against_engine(logged, engine)
    [segment] = rebuild_segments(logged)
    assert segment.token_ids == engine.log[-1][0] + engine.log[-1][1].token_ids


def test_a_call_over_the_message_size_limit_is_refused_not_lost(broker, topic_prefix):
    """A prompt whose record would exceed broker.max_message_bytes gets 413 naming the setting, and
    nothing is written; the episode goes on with smaller calls."""
    topics = TopicsConfig(prefix=topic_prefix)
    cfg = BrokerConfig(max_message_bytes=64 * 1024)

    async def scenario():
        recorder = await KafkaRecorder.connect(cfg, topics, broker.bootstrap)
        gateway = Gateway(LoggedEngine(), BytesChatML(), recorder)
        await gateway.start()
        handle = gateway.open_episode(key("big"))
        client = openai.AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)
        try:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 70_000}])
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "small"}])
        finally:
            await gateway.stop()
            await recorder.close()
        return refused.value, await read_calls(broker.bootstrap, topics)

    refused, logged = run(scenario())
    assert refused.status_code == 413 and "broker.max_message_bytes" in str(refused)
    assert [(c.call_index, c.segment_reason) for c in logged] == [(0, "start")]


SERVE = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
from test_gateway import SCRIPT, LoggedEngine, key
from test_gateway_kafka import read_calls
from rollway.base.broker import BrokerConfig, TopicsConfig
from rollway.gateway import Gateway, KafkaRecorder
from rollway.policies.chat import BytesChatML

async def main(bootstrap, prefix, port, token, resume):
    topics = TopicsConfig(prefix=prefix)
    recorder = await KafkaRecorder.connect(BrokerConfig(), topics, bootstrap)
    gateway = Gateway(LoggedEngine(SCRIPT), BytesChatML(), recorder, port=port)
    await gateway.start()
    recorded = await read_calls(bootstrap, topics) if resume else None
    handle = gateway.open_episode(key("crash"), token=token or None, recorded=recorded)
    print("READY", json.dumps({{"base_url": handle.base_url, "port": gateway.port, "token": handle.token}}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:5], sys.argv[5] == "resume"))
"""


def test_a_killed_gateway_loses_no_answered_call_and_the_retry_is_not_a_duplicate(broker, topic_prefix):
    """The gateway runs in its own process and is killed (SIGKILL) after answering two calls; a new
    process reopens the episode from the log with the same credential. The program retries its second
    call (as one whose read timed out would): the record holds each position once."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    from rollway.policies.chat import BytesChatML

    topics = TopicsConfig(prefix=topic_prefix)
    code = SERVE.format(tests=str(ROOT / "tests"))

    def start(port: int, token: str, mode: str) -> tuple[subprocess.Popen, dict]:
        proc = subprocess.Popen([sys.executable, "-c", code, broker.bootstrap, topic_prefix, str(port), token, mode],
                                stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:  # the process logs to stdout too
            if line.startswith("READY "):
                return proc, json.loads(line.removeprefix("READY "))
        raise AssertionError(f"the gateway process exited with {proc.wait()} before it was ready")

    first, info = start(0, "", "fresh")
    try:
        client = openai.OpenAI(base_url=info["base_url"], api_key="x", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What does a.txt say?"}]
        reply = client.chat.completions.create(model="m", messages=messages, tools=[SHELL]).choices[0].message
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "a.txt"}]
        client.chat.completions.create(model="m", messages=messages, tools=[SHELL])
    finally:
        first.kill()
        first.wait()
    second, _ = start(info["port"], info["token"], "resume")
    try:
        retried = client.chat.completions.create(model="m", messages=messages, tools=[SHELL]).choices[0].message
        messages += [retried.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": retried.tool_calls[0].id, "content": "hello"}]
        final = client.chat.completions.create(model="m", messages=messages, tools=[SHELL]).choices[0].message
    finally:
        second.kill()
        second.wait()

    logged = run(read_calls(broker.bootstrap, topics))
    assert final.content == "The file says hello. Done."
    assert [(c.call_index, c.retry_of, c.segment_reason) for c in logged] == [
        (0, None, "start"), (1, None, None), (2, 1, None), (3, None, None)]
    [segment] = rebuild_segments(logged)
    assert segment.call_indices == [0, 2, 3]
    # Independently of the gateway: the final prompt is a fresh render of what the program sent.
    raw = {c.call_index: c.raw_text for c in logged}
    sent = [{"role": m["role"], "content": m.get("content", "")} for m in messages]
    sent[1]["content"], sent[3]["content"] = raw[0], raw[2]
    final_prompt = BytesChatML().initial(sent, [SHELL])
    assert segment.token_ids == final_prompt + logged[-1].output_ids
