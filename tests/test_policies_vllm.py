"""vLLM launch command, weight-update calls, request/response mapping and policy config (no GPU needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollway.policies.base import SamplingParams
from rollway.policies.config import PolicyConfig
from rollway.policies.factory import build_inference
from rollway.policies.openai_client import OpenAICompletionsClient, completion_payload, parse_completion
from rollway.policies.vllm import vllm_serve_command, vllm_serve_env, vllm_serve_shell, weight_update_calls


def test_vllm_command_has_the_rl_flags():
    cmd = vllm_serve_command("Qwen/Qwen3-0.6B", port=8001, served_model_name="policy", max_model_len=8192,
                             enable_sleep_mode=True)
    assert cmd[:3] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]
    flags = " ".join(cmd)
    for flag in ("--port 8001", "--return-tokens-as-token-ids", "--logprobs-mode processed_logprobs",
                 "--generation-config vllm", "--served-model-name policy", "--max-model-len 8192",
                 "--enable-sleep-mode"):
        assert flag in flags
    assert vllm_serve_env() == {"VLLM_SERVER_DEV_MODE": "1"}
    assert vllm_serve_shell("m").startswith("VLLM_SERVER_DEV_MODE=1 vllm serve m ")


def test_weight_update_calls_follow_vllm_dev_endpoints():
    calls = weight_update_calls("/ckpt/step_5", 5)
    assert calls[0] == ("POST", "/collective_rpc",
                        {"method": "update_config", "args": [{"model_config": {"model": "/ckpt/step_5"}}]})
    assert calls[1][1] == "/collective_rpc" and calls[1][2]["method"] == "reload_weights"
    assert calls[1][2]["policy_version"] == 5 and calls[2][1] == "/reset_prefix_cache"


def test_completion_payload_asks_for_token_ids_and_logprobs():
    body = completion_payload("m", [1, 2, 3], SamplingParams(0.8, 0.9, 32, (2,), seed=4))
    assert body["prompt"] == [1, 2, 3] and body["logprobs"] == 0 and body["stop_token_ids"] == [2]
    assert body["return_tokens_as_token_ids"] and body["return_token_ids"] and body["seed"] == 4
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.8, 0.9, 32)


def test_parse_completion_reads_vllm_shapes():
    old_vllm = {"choices": [{"text": "hi", "finish_reason": "stop",
                             "logprobs": {"tokens": ["token_id:5", "token_id:2"], "token_logprobs": [-0.5, -0.1]}}]}
    gen = parse_completion(old_vllm, fallback_version=3)
    assert gen.token_ids == [5, 2] and gen.logprobs == [-0.5, -0.1] and gen.policy_version == 3
    new_vllm = {"choices": [{"token_ids": [7], "finish_reason": "length",
                             "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0]}}], "policy_version": 9}
    gen = parse_completion(new_vllm, fallback_version=3)
    assert (gen.token_ids, gen.finish_reason, gen.policy_version) == ([7], "length", 9)
    with pytest.raises(ValueError, match="logprobs"):
        parse_completion({"choices": [{"token_ids": [1], "logprobs": None}]}, 0)


def test_policy_config_builds_the_openai_client():
    cfg = PolicyConfig(type="openai", base_url="http://127.0.0.1:8000/v1/", model="m", request_timeout_s=5)
    client = build_inference(cfg, chat=None)
    assert isinstance(client, OpenAICompletionsClient)
    assert client.base_url == "http://127.0.0.1:8000/v1" and client.root_url == "http://127.0.0.1:8000"
    with pytest.raises(ValidationError, match="base_url"):
        PolicyConfig(type="openai")
    with pytest.raises(ValidationError):
        PolicyConfig(type="openai", base_url="http://x/v1", temperature=1.0)  # unknown keys are errors


def test_policy_config_builds_the_hf_chat_format():
    from rollway.policies.factory import build_chat_format
    from rollway.policies.hf_chat import HFChatFormat

    chat = build_chat_format(PolicyConfig(type="openai", base_url="http://x/v1", model="served-name",
                                          chat_format="hf"))
    assert isinstance(chat, HFChatFormat) and chat.stop_token_ids == (2,)  # default: the bundled SmolLM2
