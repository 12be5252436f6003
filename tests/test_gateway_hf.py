"""The gateway with a real tokenizer and chat template (SmolLM2's): sampled ids that re-tokenise
differently stay exactly as sampled, and the drift is recorded. The scripted policy
(policies/scripted.py) is the only fake part: it stands in for the model."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from conftest import run
from test_gateway import SCRIPT, SHELL, LoggedEngine, _DictProgram, check_against_engine, key, tool_episode
from test_gateway import Program as _Program

from rollway.gateway import Gateway, MemoryRecorder, rebuild_segments
from rollway.policies.base import Generation, SamplingParams
from rollway.policies.hf_chat import HFChatFormat


@pytest.fixture(scope="module")
def chat() -> HFChatFormat:
    from rollway.policies.model_loading import load_tokenizer

    return HFChatFormat(load_tokenizer())


class SplittingEngine(LoggedEngine):
    """Samples the first turn one character per token: ids a tokenizer would never produce for that
    text, as a real model may (the token-drift case)."""

    def __init__(self, chat: HFChatFormat):
        super().__init__(SCRIPT)
        self.inner.chat = chat

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        generation = await self.inner.generate(prompt_ids, params)
        if not self.log:
            chat = self.inner.chat
            text = chat.decode(generation.token_ids)
            ids = [t for ch in text for t in chat.encode(ch)] + list(chat.stop_token_ids)
            generation = Generation(ids, [-0.25] * len(ids), generation.finish_reason, generation.policy_version)
        self.log.append((list(prompt_ids), generation))
        return generation


@contextlib.asynccontextmanager
async def served(chat: HFChatFormat) -> AsyncIterator[tuple[LoggedEngine, Gateway, openai.AsyncOpenAI]]:
    """The scripted engine in `chat`, a gateway over it with one episode open, and that episode's client."""
    engine = LoggedEngine(SCRIPT)
    engine.inner.chat = chat
    gateway = Gateway(engine, chat, MemoryRecorder())
    await gateway.start()
    handle = gateway.open_episode(key())
    try:
        yield engine, gateway, openai.AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)
    finally:
        await gateway.stop()


def test_sampled_ids_stay_as_sampled_with_a_real_tokenizer(chat):
    async def scenario():
        engine = SplittingEngine(chat)
        gateway = Gateway(engine, chat, MemoryRecorder())
        await gateway.start()
        handle = gateway.open_episode(key())
        program = _DictProgram(_Program(openai.AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)))
        try:
            await tool_episode(program)
        finally:
            await gateway.stop()
        return engine, gateway.recorder.calls

    engine, calls = run(scenario())
    split = engine.log[0][1].token_ids
    assert chat.encode(chat.decode(split)) != split[:-1]  # re-tokenising would change them
    check_against_engine(calls, engine)
    [segment] = rebuild_segments(calls)
    start, end = segment.turn_spans[0]
    assert segment.token_ids[start:end] == split  # never re-tokenised, in every later prompt too
    assert engine.log[2][0][start:end] == split
    # The first call is a full render; the later ones hold the split turn, so a fresh render differs.
    assert [c.template_drift for c in calls] == [False, True, True]


def test_canonical_ids_re_render_exactly_with_the_template(chat):
    """With the model's own tokenisation the append-only SmolLM2 template reproduces every prompt."""

    async def scenario():
        engine = LoggedEngine(SCRIPT)
        engine.inner.chat = chat
        gateway = Gateway(engine, chat, MemoryRecorder())
        await gateway.start()
        handle = gateway.open_episode(key())
        program = _DictProgram(_Program(openai.AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)))
        try:
            messages: Any = await tool_episode(program)
        finally:
            await gateway.stop()
        return engine, gateway.recorder.calls, messages

    engine, calls, messages = run(scenario())
    check_against_engine(calls, engine)
    assert not any(c.template_drift for c in calls)
    rendered = [{"role": m["role"], "content": calls[(i - 2) // 2].raw_text if m["role"] == "assistant"
                 else m["content"]} for i, m in enumerate(messages)]
    assert chat.initial(rendered, [SHELL]) == engine.log[-1][0]


def test_a_completions_prompt_written_in_the_template_gets_its_special_tokens(chat):
    """A program that writes the chat template itself (raw /v1/completions) gets the special tokens the
    engine would parse, not the characters of '<|im_start|>'."""

    async def scenario():
        async with served(chat) as (engine, gateway, client):
            await client.completions.create(model="m", prompt="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                            max_tokens=4)
        return gateway.recorder.calls

    [call] = run(scenario())
    start = chat.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert call.prompt_ids[0] == start and call.prompt_ids.count(start) == 2
    assert call.prompt_ids[-len(chat.assistant_header_ids):] == list(chat.assistant_header_ids)


def test_messages_the_template_refuses_get_400_with_the_templates_reason():
    """A chat template with its own checks (raise_exception), as many models' templates have."""
    from rollway.policies.model_loading import load_tokenizer

    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not "
                "supported by this model') }}{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    strict = HFChatFormat(load_tokenizer(), chat_template=template)

    async def scenario():
        engine = LoggedEngine(SCRIPT)
        engine.inner.chat = strict
        gateway = Gateway(engine, strict, MemoryRecorder())
        await gateway.start()
        handle = gateway.open_episode(key())
        client = openai.AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="m", messages=[
                    {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "out"}])
        finally:
            await gateway.stop()
        return refused.value, gateway.recorder.calls, engine.log

    refused, calls, engine_log = run(scenario())
    assert "not supported by this model" in str(refused) and refused.body["param"] == "messages"
    assert calls == [] and engine_log == []


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to tokenise (the measurement, not a fake)."""

    def __init__(self, inner: Any):
        self.inner, self.chars = inner, 0

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        self.chars += len(text)
        return self.inner.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_continued_call_tokenises_its_new_text_not_the_whole_history():
    """With the model's tokenizer, a program extends a 40,000-character conversation call after call: each
    continued call, drift check included, tokenises about its new text (a reply and a short tool output), not
    the history again. Before keeping tokenised pieces the drift check re-tokenised all of it on every call
    (25-33 ms of CPU a call at 16k tokens; seconds of queueing at 64 episodes). The drift is still checked:
    no call is flagged on this append-only template."""
    from rollway.policies.model_loading import load_tokenizer

    counting = CountingTokenizer(load_tokenizer())
    chat = HFChatFormat(counting)
    long = "Traceback (most recent call last): File 'app.py', line 12, in main\n" * 600

    async def scenario() -> tuple[list[int], list[Any]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": long}]
        tokenised = []
        async with served(chat) as (_engine, gateway, client):
            for i in range(4):
                before = counting.chars
                reply = await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
                tokenised.append(counting.chars - before)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                             {"role": "user", "content": f"output {i}: ok"}]
        return tokenised, gateway.recorder.calls

    tokenised, calls = run(scenario())
    assert tokenised[0] >= len(long)  # the first call renders in full
    assert all(n < 2_000 for n in tokenised[1:]), tokenised
    assert len(calls) == 4 and not any(c.template_drift for c in calls)
