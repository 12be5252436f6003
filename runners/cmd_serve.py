"""`rollway serve [MODEL]`: the built-in CPU/GPU inference engine behind an OpenAI-compatible API."""

from __future__ import annotations

import argparse
import asyncio

NAME = "serve"
HELP = "serve a model over vLLM's OpenAI-compatible completions API (built-in batching engine)"


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


def run(args: argparse.Namespace) -> int:
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
