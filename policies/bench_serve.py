"""`rollway bench serve`: generated tokens/s of the engine with 1 and with N concurrent clients;
`--engine both` runs the built-in engine and vLLM side by side at 1, 8 and 32 clients, with the
pause-to-resume latency of a weight update on each."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from rollway.base.figures import dumps

TARGET_RATIO = 4.0
"""Batching should make N=8 concurrent clients at least this many times faster than one."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="prompt tokens per request (short: measures decoding, not prefill)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients of the second run")
    parser.add_argument("--rounds", type=int, default=2, help="sequential requests per client")
    parser.add_argument("--url", default=None, help="benchmark a running server (e.g. vLLM) at this /v1 URL "
                        "instead of starting the built-in engine")
    parser.add_argument("--model", default=None, help="model for the built-in engine (default: smollm2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--engine", choices=("builtin", "vllm", "both"), default="builtin",
                        help="engines to start and compare (vllm: from .venv-vllm); `both` measures 1, 8 and "
                        "32 clients (--client-counts) and the weight-update latency of each")
    parser.add_argument("--client-counts", default="1,8,32", help="with --engine: concurrent clients to measure")


def run(args: argparse.Namespace) -> int:
    if args.engine != "builtin" and args.url is None:
        result = compare_engines(args)
        print(dumps(result) if args.json else dumps(result, indent=1))
        return 0
    server = None
    url = args.url
    if url is None:
        from rollway.policies.cpu_engine import BackgroundServer, build_engine  # loads torch: keep it late

        engine = build_engine(args.model, dtype=args.dtype, max_batch=args.max_batch, threads=args.threads)
        server = BackgroundServer(engine).start()
        url = server.base_url
    try:
        result = asyncio.run(measure(url, args))
    finally:
        if server is not None:
            server.stop()
    print(dumps(result) if args.json else report(result))
    return 0


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        model = (await _post_or_get(http, f"{url}/models"))["data"][0]["id"]
        await _complete(http, url, model, _prompt(0, args.prompt_len), 4)  # warm-up: first-call costs
        (single, cpu_single), (many, cpu_many) = [await _rate(http, url, model, c, args) for c in (1, args.clients)]
    result = {"url": url, "model": model, "tokens": args.tokens, "prompt_len": args.prompt_len,
              "rounds": args.rounds, "clients": args.clients, "tokens_per_s_1": round(single, 1),
              f"tokens_per_s_{args.clients}": round(many, 1), "ratio": round(many / single, 2),
              "target_ratio": TARGET_RATIO, "target_met": many / single >= TARGET_RATIO}
    if args.url is None:  # the engine runs in this process: its CPU time is measurable
        result |= {"cpu_tokens_per_s_1": round(cpu_single, 1), f"cpu_tokens_per_s_{args.clients}": round(cpu_many, 1),
                   "cpu_ratio": round(cpu_many / cpu_single, 2)}
    return result


async def _rate(http: Any, url: str, model: str, clients: int, args: argparse.Namespace) -> tuple[float, float]:
    """Generated tokens per wall-clock second and per CPU second of this process. On shared, busy
    cores the wall-clock rate mostly measures the neighbours; the CPU-time rate stays comparable."""
    async def client(k: int) -> int:
        n = 0
        for r in range(args.rounds):
            n += await _complete(http, url, model, _prompt(1000 * k + r + 1, args.prompt_len), args.tokens)
        return n

    start, cpu_start = time.perf_counter(), time.process_time()
    total = sum(await asyncio.gather(*(client(k) for k in range(clients))))
    return total / (time.perf_counter() - start), total / (time.process_time() - cpu_start)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)  # same length for every request; content varies so nothing can be shared
    return [rng.randrange(100, 30000) for _ in range(length)]


async def _complete(http: Any, url: str, model: str, prompt: list[int], tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    answer = await _post_or_get(http, f"{url}/completions", body)
    return answer["usage"]["completion_tokens"]


async def _post_or_get(http: Any, url: str, body: dict | None = None) -> dict:
    request = http.post(url, json=body) if body is not None else http.get(url)
    async with request as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        return await resp.json()


def report(r: dict[str, Any]) -> str:
    n = r["clients"]
    verdict = "met" if r["target_met"] else "NOT met"
    lines = [f"bench serve: {r['model']} at {r['url']} ({r['prompt_len']}-token prompts, {r['tokens']} tokens, "
             f"{r['rounds']} requests per client)",
             f"  1 client:  {r['tokens_per_s_1']:8.1f} tokens/s",
             f"  {n} clients: {r[f'tokens_per_s_{n}']:8.1f} tokens/s",
             f"  ratio {r['ratio']:.2f}x (target >= {TARGET_RATIO:.0f}x: {verdict})"]
    if "cpu_ratio" in r:
        lines.append(f"  per CPU second of this process: {r['cpu_tokens_per_s_1']:.1f} and "
                     f"{r[f'cpu_tokens_per_s_{n}']:.1f} tokens, ratio {r['cpu_ratio']:.2f}x")
    return "\n".join(lines)


def compare_engines(args: argparse.Namespace) -> dict[str, Any]:
    """Each engine in turn (never both at once: they would share the cores): tokens/s at each client
    count, then the latency of loading the same weights as a new version."""
    from pathlib import Path
    from tempfile import mkdtemp

    from rollway.policies.config import PolicyConfig
    from rollway.policies.launch import launch_engine

    counts = [int(c) for c in args.client_counts.split(",")]
    result: dict[str, Any] = {"tokens": args.tokens, "prompt_len": args.prompt_len, "rounds": args.rounds,
                              "client_counts": counts}
    for engine in (["builtin", "vllm"] if args.engine == "both" else [args.engine]):
        cfg = PolicyConfig(type="openai", launch=True, engine=engine, model=args.model or "smollm2",
                           dtype=args.dtype, max_batch=max(counts), threads=args.threads)
        t0 = time.perf_counter()
        launched = launch_engine(cfg, Path(mkdtemp(prefix=f"bench-serve-{engine}-")))
        try:
            start_s = time.perf_counter() - t0
            result[engine] = asyncio.run(_engine_figures(launched.servers[0].base_url, engine, counts, args,
                                                         launched.api_key))
            result[engine]["start_s"] = round(start_s, 1)
        finally:
            launched.stop()
    if "builtin" in result and "vllm" in result:
        result["vllm_over_builtin"] = {str(c): round(result["vllm"][f"tokens_per_s_{c}"]
                                                     / result["builtin"][f"tokens_per_s_{c}"], 2) for c in counts}
    return result


async def _engine_figures(url: str, engine: str, counts: list[int], args: argparse.Namespace,
                          api_key: str | None = None) -> dict[str, Any]:
    import aiohttp

    from rollway.policies.model_loading import resolve_model_folder

    figures: dict[str, Any] = {}
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # a launched vLLM wants its key
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), headers=auth) as http:
        model = (await _post_or_get(http, f"{url}/models"))["data"][0]["id"]
        await _complete(http, url, model, _prompt(0, args.prompt_len), 4)
        for c in counts:
            figures[f"tokens_per_s_{c}"] = round((await _rate(http, url, model, c, args))[0], 1)
    if engine == "vllm":
        from rollway.policies.vllm import VLLMClient

        client = VLLMClient([url], api_key=api_key)
    else:
        from rollway.policies.openai_client import OpenAICompletionsClient

        client = OpenAICompletionsClient(url)
    try:
        folder = str(resolve_model_folder(args.model))
        latencies = []
        for version in (1, 2, 3):
            t0 = time.perf_counter()
            await client.load_weights(folder, version)
            latencies.append(round(time.perf_counter() - t0, 3))
        figures["weight_sync_s"] = latencies
    finally:
        await client.close()
    return figures
