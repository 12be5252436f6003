"""The built-in engine over HTTP on a loopback port: batching, sampling, errors, client, weight updates."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest

from rollway.policies.base import SamplingParams
from rollway.policies.openai_client import InferenceRequestError, OpenAICompletionsClient

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+2?", "Name three colors.", "Write a haiku about the sea, please, with many words.", "hi"]


@pytest.fixture(scope="module")
def server():
    """One fp32 engine for the module (fp32: batched and single decoding agree bit-for-bit in argmax)."""
    import torch

    from rollway.policies.cpu_engine import BackgroundServer, build_engine

    threads = torch.get_num_threads()
    srv = BackgroundServer(build_engine(dtype="float32", max_batch=8, max_model_len=512, threads=1)).start()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(server):
    tok = server.server.renderer.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=False) for q in QUESTIONS]


def ids_of(server, text: str) -> list[int]:
    return server.server.renderer.tokenizer.encode(text, add_special_tokens=False)


async def post(server, body, route: str = "/v1/completions") -> tuple[int, dict]:
    url = server.base_url.removesuffix("/v1") + route
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        return resp.status, await resp.json()


def complete(server, prompt_ids, **fields) -> dict:
    status, body = asyncio.run(post(server, {"prompt": prompt_ids, "logprobs": 0, "return_token_ids": True,
                                             "return_tokens_as_token_ids": True, **fields}))
    assert status == 200, body
    return body


def test_concurrent_requests_match_single_requests(server, prompts):
    ids = [ids_of(server, p) for p in prompts]
    fields = {"temperature": 0, "max_tokens": 10}
    singles = [complete(server, p, **fields)["choices"][0] for p in ids]

    async def staggered():  # later requests join a batch that is already decoding
        async def one(i, p):
            await asyncio.sleep(0.3 * i)
            return await post(server, {"prompt": p, "logprobs": 0, "return_token_ids": True,
                                       "return_tokens_as_token_ids": True, **fields})
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(ids)))

    for single, (status, body) in zip(singles, asyncio.run(staggered()), strict=True):
        choice = body["choices"][0]
        assert status == 200 and choice["token_ids"] == single["token_ids"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(single["logprobs"]["token_logprobs"], abs=2e-3)
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) == body["usage"]["completion_tokens"]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_stop_token_ends_with_stop_and_max_tokens_with_length(server, prompts):
    prompt = ids_of(server, prompts[2])
    free = complete(server, prompt, temperature=0, max_tokens=6)["choices"][0]
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 6
    stop = free["token_ids"][3]
    cut = free["token_ids"][: free["token_ids"].index(stop) + 1]
    stopped = complete(server, prompt, temperature=0, max_tokens=6, stop_token_ids=[stop])["choices"][0]
    assert stopped["token_ids"] == cut and stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop


def test_logprobs_are_those_of_the_tempered_sampling_distribution(server, prompts):
    import torch

    prompt = ids_of(server, prompts[1])
    first = complete(server, prompt, temperature=0.7, max_tokens=6, seed=3)["choices"][0]
    again = complete(server, prompt, temperature=0.7, max_tokens=6, seed=3)["choices"][0]
    assert first["token_ids"] == again["token_ids"]  # a seed makes sampling reproducible
    model = server.server.engine.model
    with torch.inference_mode():  # teacher-force prompt + completion, score under logits / T
        logits = model(torch.tensor([prompt + first["token_ids"]])).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(first["token_ids"])[:, None])
    assert first["logprobs"]["token_logprobs"] == pytest.approx(expected[:, 0].tolist(), abs=2e-3)


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"max_tokens": 4}, 400, "`prompt` is required"),
    ({"prompt": "hello"}, 400, "list of token ids"),
    ({"prompt": [1, 2.5]}, 400, "list of token ids"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [1, 10**7]}, 400, "out of vocabulary"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "`temperature` must be"),
    ({"prompt": [1, 2], "temperature": "hot"}, 400, "`temperature` must be"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "`top_p` must be"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "`max_tokens` must be"),
    ({"prompt": [1] * 500, "max_tokens": 100}, 400, "exceeds the engine's max_model_len"),
    ({"prompt": [1, 2], "n": 2}, 400, "n=1"),
    ({"prompt": [1, 2], "model": "gpt-9"}, 404, "does not exist"),
    ([1, 2, 3], 400, "JSON object"),
])
def test_malformed_requests_get_a_clear_4xx(server, body, status, message):
    got, answer = asyncio.run(post(server, body))
    assert got == status and message in answer["error"]["message"], answer
    assert answer["error"]["code"] == status


def test_models_and_health_report_the_policy_version(server):
    async def get(route):
        url = server.base_url.removesuffix("/v1") + route
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return resp.status, await resp.json(), resp.headers["X-Policy-Version"]

    status, models, header = asyncio.run(get("/v1/models"))
    card = models["data"][0]
    assert status == 200 and card["id"] == "smollm2" and card["policy_version"] == int(header)
    assert card["max_model_len"] == 512
    assert asyncio.run(get("/health"))[0] == 200


def test_client_generates_against_the_live_engine(server, prompts):
    prompt = ids_of(server, prompts[0])
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(2,))
    expected = complete(server, prompt, temperature=0, max_tokens=10, stop_token_ids=[2])["choices"][0]

    async def go():
        client = OpenAICompletionsClient(server.base_url, timeout=60)
        try:
            return await client.generate(prompt, params), client.model
        finally:
            await client.close()

    gen, model = asyncio.run(go())
    assert model == "smollm2" and gen.token_ids == expected["token_ids"]
    assert len(gen.logprobs) == len(gen.token_ids) and gen.finish_reason == expected["finish_reason"]
    assert gen.policy_version == server.server.engine.policy_version


def test_client_errors_are_clear(server):
    async def go():
        bad = OpenAICompletionsClient(server.base_url, model="smollm2", timeout=60)
        down = OpenAICompletionsClient("http://127.0.0.1:9/v1", model="m", timeout=5, max_retries=1, backoff_s=0.01)
        try:
            with pytest.raises(InferenceRequestError, match="out of vocabulary"):
                await bad.generate([10**7], SamplingParams(max_tokens=2))
            with pytest.raises(ConnectionError, match="is the inference server running"):
                await down.generate([1], SamplingParams(max_tokens=2))
        finally:
            await bad.close()
            await down.close()

    asyncio.run(go())


def test_weight_update_changes_version_and_logprobs(server, prompts, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    original = server.server.model_path
    tensors = load_file(f"{original}/model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5  # sharper next-token distribution
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(f"{original}/config.json", tmp_path / "config.json")
    prompt = ids_of(server, prompts[3])

    async def go():
        client = OpenAICompletionsClient(server.base_url, timeout=120)
        params = SamplingParams(temperature=0, max_tokens=3)
        try:
            before = await client.generate(prompt, params)
            assert await client.load_weights(str(tmp_path), 7) == 7
            after = await client.generate(prompt, params)
            with pytest.raises(InferenceRequestError, match="does not exist"):
                await client.load_weights(str(tmp_path / "missing"), 8)
            await client.load_weights(original, before.policy_version)  # leave the module's engine as found
            return before, after
        finally:
            await client.close()

    before, after = asyncio.run(go())
    assert after.policy_version == 7 and before.policy_version != 7
    assert not math.isclose(before.logprobs[0], after.logprobs[0], abs_tol=1e-3)
    assert server.server.engine.policy_version == before.policy_version


def test_local_client_shares_the_engine(server, prompts):
    from rollway.policies.local import LocalEngineClient

    prompt = ids_of(server, prompts[0])
    expected = complete(server, prompt, temperature=0, max_tokens=4)["choices"][0]
    gen = asyncio.run(LocalEngineClient(server.server.engine).generate(prompt, SamplingParams(0, max_tokens=4)))
    assert gen.token_ids == expected["token_ids"] and len(gen.logprobs) == 4


def test_with_a_key_every_route_but_health_wants_it(server):
    """Attack: a process on the host (a task image build, a sandbox with network) reaches the launched
    engine's port and loads its own weights through /collective_rpc. `policy.launch` gives the engine a key
    (ROLLWAY_ENGINE_API_KEY); without it, or with a wrong one, every route but /health answers 401."""
    from aiohttp.test_utils import TestServer

    from rollway.policies.cpu_engine import EngineServer

    inner = server.server
    keyed = EngineServer(inner.engine, inner.renderer.tokenizer, inner.served_model, inner.model_path,
                         api_key="sk-engine-1")

    async def statuses() -> list[int]:
        site = TestServer(keyed.app(), host="127.0.0.1")
        await site.start_server()
        attack = {"method": "reload_weights", "kwargs": {"weights_path": "/tmp/attacker"}}
        try:
            async with aiohttp.ClientSession() as http:
                got = []
                for route, key in (("/collective_rpc", None), ("/collective_rpc", "wrong"), ("/v1/models", None),
                                   ("/reset_prefix_cache", None), ("/health", None), ("/v1/models", "sk-engine-1")):
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    method = http.get if route in ("/health", "/v1/models") else http.post
                    async with method(str(site.make_url(route)), json=attack, headers=headers) as resp:
                        got.append(resp.status)
                return got
        finally:
            await site.close()

    assert asyncio.run(statuses()) == [401, 401, 401, 401, 200, 200]
