"""What a program is told, and who is blamed, when the inference engine cannot serve a call the program shaped.

The real built-in engine (`rollway serve`'s batching engine over HTTP, SmolLM2, a 512-token context) behind
the real gateway, called by the real `openai` and `anthropic` SDKs; nothing is faked. A history longer than
the engine's context must come back as the error programs compact on (OpenAI's `context_length_exceeded`,
Anthropic's "prompt is too long"), not as a 500 that they retry; a request the engine refuses for what the
program sent is the program's 400 (graded, not retried); a refusal of the gateway's own settings (a model the
engine does not serve) is the infrastructure's. The same against the real vLLM is in test_vllm_server.py."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from rollway.gateway import Gateway, MemoryRecorder
from rollway.policies.hf_chat import HFChatFormat
from rollway.policies.model_loading import load_tokenizer
from rollway.policies.openai_client import OpenAICompletionsClient
from rollway.schemas.messages import EpisodeKey

pytestmark = pytest.mark.slow
CONTEXT = 512


@pytest.fixture(scope="module")
def engine_url():
    import torch

    from rollway.policies.cpu_engine import BackgroundServer, build_engine

    threads = torch.get_num_threads()
    srv = BackgroundServer(build_engine(dtype="float32", max_batch=4, max_model_len=CONTEXT, threads=1)).start()
    yield srv.base_url
    srv.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def chat():
    return HFChatFormat(load_tokenizer("smollm2"))


async def gateway_on(url: str, chat: HFChatFormat, model: str | None = None) -> Gateway:
    gateway = Gateway(OpenAICompletionsClient(url, model=model, timeout=120, max_retries=0), chat, MemoryRecorder())
    await gateway.start()
    return gateway


def words(n: int) -> str:
    return " ".join(["apple"] * n)


def test_a_history_past_the_engines_context_is_refused_as_programs_expect_and_blamed_on_the_program(engine_url, chat):
    async def go():
        gateway = await gateway_on(engine_url, chat)
        try:
            assert await gateway.engine.context_tokens() == CONTEXT  # read from the engine's /v1/models
            oa = gateway.open_episode(EpisodeKey(episode_id="oa", group_id="g", task_id="t"))
            program = openai.AsyncOpenAI(base_url=oa.base_url, api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as caught:
                await program.chat.completions.create(model="m", messages=[{"role": "user", "content": words(600)}])
            error = caught.value.body
            assert caught.value.status_code == 400 and error["code"] == "context_length_exceeded", error
            assert f"maximum context length is {CONTEXT} tokens" in error["message"], error
            # Responses (Codex) get the same code
            with pytest.raises(openai.BadRequestError) as caught:
                await program.responses.create(model="m", input=words(600), store=False)
            assert caught.value.body["code"] == "context_length_exceeded", caught.value.body
            # A prompt that fits, with room for fewer tokens than the program asked for: served, cut to the room
            # left (the engine itself refuses prompt + max_tokens beyond its context).
            fits = await program.chat.completions.create(model="m", max_tokens=400, temperature=0,
                                                         messages=[{"role": "user", "content": words(440)}])
            assert fits.usage.prompt_tokens + fits.usage.completion_tokens <= CONTEXT
            assert fits.usage.prompt_tokens > CONTEXT - 400

            an = gateway.open_episode(EpisodeKey(episode_id="an", group_id="g", task_id="t"))
            claude = anthropic.AsyncAnthropic(base_url=an.base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
            with pytest.raises(anthropic.BadRequestError) as refused:
                await claude.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": words(600)}])
            assert refused.value.body["error"]["type"] == "invalid_request_error", refused.value.body
            assert "prompt is too long" in refused.value.body["error"]["message"], refused.value.body

            for handle in (oa, an):  # the program's doing: graded, not retried, and not "unsupported"
                assert handle.infrastructure_failure is None and handle.unsupported is None
            assert [c.episode_id for c in gateway.recorder.calls] == ["oa"]  # only the call that fitted
        finally:
            await gateway.stop()

    asyncio.run(go())


def test_what_the_engine_refuses_is_the_programs_400_and_what_it_refuses_of_the_gateway_is_infrastructure(
        engine_url, chat):
    async def go():
        gateway = await gateway_on(engine_url, chat)
        try:
            handle = gateway.open_episode(EpisodeKey(episode_id="oov", group_id="g", task_id="t"))
            program = openai.AsyncOpenAI(base_url=handle.base_url, api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError, match="out of vocabulary") as caught:
                await program.completions.create(model="m", prompt=[1, 10**7, 2], max_tokens=4)
            assert caught.value.status_code == 400
            assert handle.infrastructure_failure is None and handle.unsupported is None
            ok = await program.completions.create(model="m", prompt=[1, 2, 3], max_tokens=2)
            assert ok.usage.completion_tokens >= 1  # the episode goes on after a refused call
        finally:
            await gateway.stop()
        # The engine refusing the gateway's own request (a model it does not serve: the operator's setting,
        # which no program chooses) is the infrastructure's: the attempt is retried, not graded 0.
        misconfigured = await gateway_on(engine_url, chat, model="no-such-model")
        try:
            handle = misconfigured.open_episode(EpisodeKey(episode_id="cfg", group_id="g", task_id="t"))
            program = openai.AsyncOpenAI(base_url=handle.base_url, api_key="unused", max_retries=0)
            with pytest.raises(openai.APIStatusError) as caught:
                await program.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert caught.value.status_code == 502, caught.value
            assert "no-such-model" in (handle.infrastructure_failure or ""), handle.infrastructure_failure
        finally:
            await misconfigured.stop()

    asyncio.run(go())


def test_a_server_that_cannot_say_its_context_leaves_it_unknown_and_calls_go_to_the_engine(chat):
    """No context (a server that is down, one whose /v1/models has no `max_model_len`, here the gateway's
    own) is not an error: the gateway then relies on the engine's refusal, said to the program as a 400."""
    from rollway.policies.base import InferenceClient

    async def go():
        down = OpenAICompletionsClient("http://127.0.0.1:9/v1", timeout=5, max_retries=0)
        assert await down.context_tokens() is None
        assert await InferenceClient.context_tokens(down) is None  # the interface's default
        gateway = await gateway_on("http://127.0.0.1:9/v1", chat)
        handle = gateway.open_episode(EpisodeKey(episode_id="m", group_id="g", task_id="t"))
        silent = OpenAICompletionsClient(handle.base_url, timeout=5, max_retries=0)
        try:
            body, _ = await silent._request("GET", silent._models_url())
            assert body["data"] and "max_model_len" not in body["data"][0]  # it answers, without a context
            assert await silent.context_tokens() is None
        finally:
            await gateway.stop()
            await silent.close()
            await down.close()

    asyncio.run(go())


def test_a_long_generation_on_a_live_engine_is_waited_for_and_a_silent_engine_is_infrastructure(engine_url):
    """A call is not the engine's failure because it is long: the program (or the model, rambling to its
    max_tokens) decides how long a generation runs, so a timeout on the whole call would let a policy turn its
    own episode into a retried "infrastructure failure" and never be graded 0 (base/blame.py). A call past
    `policy.request_timeout_s` is given up only when the engine also stops answering /v1/models. Real parts:
    the built-in engine generating 300 tokens with a 0.5 s timeout; a socket that accepts and never answers
    stands in for a hung engine."""
    import socket

    from rollway.policies.base import SamplingParams

    hung = socket.create_server(("127.0.0.1", 0))

    async def go():
        live = OpenAICompletionsClient(engine_url, timeout=0.5, max_retries=0)
        silent = OpenAICompletionsClient(f"http://127.0.0.1:{hung.getsockname()[1]}/v1", model="m", timeout=0.5,
                                         max_retries=0)
        try:
            long = SamplingParams(temperature=1.0, max_tokens=300, ignore_eos=True, seed=1)
            gen = await live.generate([1, 2, 3, 4], long)
            assert len(gen.token_ids) == 300 and gen.finish_reason == "length"
            with pytest.raises(ConnectionError, match="did not answer"):
                await asyncio.wait_for(silent.generate([1, 2, 3], long), timeout=60)
        finally:
            await live.close()
            await silent.close()

    try:
        asyncio.run(go())
    finally:
        hung.close()
