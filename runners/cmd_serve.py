"""`rollway serve [MODEL]`: the built-in CPU/GPU inference engine behind an OpenAI-compatible API, or
(`--engine vllm`) vLLM's server from .venv-vllm with the flags rollway needs."""

from __future__ import annotations

import argparse
import asyncio

NAME = "serve"
HELP = "serve a model over vLLM's OpenAI-compatible API (built-in batching engine, or vLLM itself)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="'smollm2' (default, the bundled GGUF), a .gguf file or a Hugging Face folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default; 1 is faster on shared cores)")
    parser.add_argument("--served-model-name", default=None, help="name in /v1/models (default: MODEL)")
    parser.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                        help="vllm: run vLLM (scripts/setup-vllm.sh) with rollway's flags (token route, "
                        "weight versions, RL routes); the model is converted to a Hugging Face folder first")
    parser.add_argument("--enforce-eager", action="store_true", help="vllm: skip the compile warm-up")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0,
                        help="vllm on CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE; without it vLLM wants 92%% of RAM)")


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return _run_vllm(args)
    from rollway.policies.cpu_engine import build_engine, serve_forever  # loads torch: keep it late

    server = build_engine(args.model, dtype=args.dtype, device=args.device, max_batch=args.max_batch,
                          max_model_len=args.max_model_len, threads=args.threads,
                          served_model=args.served_model_name)
    try:
        asyncio.run(serve_forever(server, args.host, args.port))
    except KeyboardInterrupt:
        pass
    finally:
        server.engine.stop()
    return 0


def _run_vllm(args: argparse.Namespace) -> int:
    import os

    from rollway.policies.cpu_engine import ENGINE_KEY_ENV
    from rollway.policies.model_loading import resolve_model_folder
    from rollway.policies.vllm import INSTALL_HINT, vllm_python, vllm_serve_command, vllm_serve_env

    python = vllm_python()
    if python is None:
        print(f"rollway serve: {INSTALL_HINT}")
        return 2
    # The same key as the built-in engine's (environment only); with it every route, dev routes included, wants it.
    key = os.environ.get(ENGINE_KEY_ENV) or os.environ.get("VLLM_API_KEY") or None
    argv = vllm_serve_command(str(resolve_model_folder(args.model)), port=args.port, host=args.host,
                              served_model_name=args.served_model_name, max_model_len=args.max_model_len,
                              dtype=args.dtype, python=str(python), enforce_eager=args.enforce_eager,
                              guarded=key is not None)
    os.execve(str(python), argv, {**os.environ, **vllm_serve_env(args.kv_cache_gib, api_key=key)})
    return 0  # not reached
