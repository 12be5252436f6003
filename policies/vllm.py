"""Launching vLLM for RL rollouts and reloading its weights: command and HTTP calls, built and tested here.

vLLM pins its own torch, so it lives in its own environment on a CUDA machine:

    python -m venv .venv-vllm && .venv-vllm/bin/pip install -e '.[vllm]'

Then `vllm_serve_command(...)` gives the server command (run it with `vllm_serve_env()` added to the
environment) and `policy.type: openai`, `policy.base_url: http://HOST:PORT/v1` points rollway at it.

Flags that matter for RL:
- `--return-tokens-as-token-ids`: logprob tokens come back as "token_id:N" (exact ids, never text).
- `--logprobs-mode processed_logprobs`: logprobs of the distribution sampled from (after temperature
  and top-p), i.e. behaviour-policy logprobs; the default `raw_logprobs` ignores temperature.
- `--generation-config vllm`: do not let the model's generation_config.json change sampling
  defaults (a silent repetition penalty would make behaviour logprobs disagree with the learner).
- `--max-logprobs`: how many alternatives a request may ask for.
- `VLLM_SERVER_DEV_MODE=1`: enables `/collective_rpc`, `/reset_prefix_cache`, `/sleep`, `/wake_up`,
  the control endpoints RL frameworks use to update weights in a running OpenAI server.

Weight update from a checkpoint folder (what `OpenAICompletionsClient.load_weights` sends, and what
the built-in engine mirrors): `POST /collective_rpc {"method": "update_config", "args":
[{"model_config": {"model": FOLDER}}]}` re-points the model config at the new safetensors folder,
`POST /collective_rpc {"method": "reload_weights"}` loads it in place (vLLM's documented sleep-mode
recipe calls the same RPC), and `POST /reset_prefix_cache` drops KV computed with the old weights.
vLLM knows no policy version: the client keeps the one it loaded (our engine also reports it).
For weights streamed from a trainer's GPU instead of disk, vLLM >= 0.16 has the NCCL/IPC weight
transfer routes (`/init_weight_transfer_engine`, `/update_weights`); not used here yet.
"""

from __future__ import annotations

import shlex
from typing import Any


def vllm_serve_command(model: str, port: int = 8000, host: str = "127.0.0.1", served_model_name: str | None = None,
                       max_model_len: int | None = None, dtype: str = "bfloat16", max_logprobs: int = 20,
                       gpu_memory_utilization: float | None = None, enable_sleep_mode: bool = False,
                       extra_args: tuple[str, ...] = ()) -> list[str]:
    """argv of `vllm serve` for rollway (token-id prompts, behaviour logprobs, weight reloads)."""
    cmd = ["vllm", "serve", model, "--host", host, "--port", str(port), "--dtype", dtype,
           "--return-tokens-as-token-ids", "--logprobs-mode", "processed_logprobs",
           "--max-logprobs", str(max_logprobs), "--generation-config", "vllm"]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if enable_sleep_mode:
        cmd.append("--enable-sleep-mode")  # frees GPU memory between rollouts when trainer and vLLM share it
    return cmd + list(extra_args)


def vllm_serve_env() -> dict[str, str]:
    """Environment additions: the dev-mode endpoints (`/collective_rpc`) the weight update needs."""
    return {"VLLM_SERVER_DEV_MODE": "1"}


def vllm_serve_shell(model: str, **kwargs: Any) -> str:
    """One shell line, for docs and logs."""
    env = " ".join(f"{k}={v}" for k, v in vllm_serve_env().items())
    return f"{env} {shlex.join(vllm_serve_command(model, **kwargs))}"


def weight_update_calls(checkpoint: str, version: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(HTTP method, route from the server root, JSON body) calls that load `checkpoint` as `version`."""
    return [
        ("POST", "/collective_rpc", {"method": "update_config", "args": [{"model_config": {"model": checkpoint}}]}),
        # `policy_version` is read by rollway's engine and ignored by vLLM.
        ("POST", "/collective_rpc", {"method": "reload_weights", "policy_version": version}),
        ("POST", "/reset_prefix_cache", {}),
    ]
