"""Does a seeded request replay through the built-in engine (policies/batching.py) on this device?

    python scripts/engine-replay-gpu.py FOLDER [--device cuda] [--dtype bfloat16] [--tokens 64] [--deterministic]

FOLDER holds a Hugging Face causal LM; when it has none, a Qwen3-0.6B shape initialised at random is written
there (no weights are downloaded). The same requests (512-token prompts, temperature 0.7, top_p 1 and 0.9,
one seed each) go through the engine twice in a row, 1 and then 32 at a time; it prints tokens/s and how many
of them drew the same tokens both times. `--deterministic` calls torch.use_deterministic_algorithms(True) at
the start; set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment with it (docs/benchmarks.md, "The learner")."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    from rollway.policies.base import SamplingParams
    from rollway.policies.batching import BatchEngine, EngineRequest
    from rollway.policies.model_loading import load_causal_lm

    if not os.path.exists(os.path.join(args.folder, "config.json")):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, num_hidden_layers=28, num_attention_heads=16,
                                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, hidden_size=1024,
                                     intermediate_size=3072, eos_token_id=2)).save_pretrained(args.folder)
    lm = load_causal_lm(args.folder, dtype=args.dtype, device=args.device)
    engine = BatchEngine(lm, (2,), max_batch=32, max_model_len=2048).start()
    vocab = lm.config.vocab_size

    async def once(top_p: float, n: int, tokens: int) -> tuple[list, float]:
        requests = [EngineRequest([3 + (i * 7 + j) % (vocab - 3) for j in range(512)],
                                  SamplingParams(temperature=0.7, top_p=top_p, max_tokens=tokens, seed=100 + i,
                                                 ignore_eos=True), ignore_eos=True) for i in range(n)]
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(r) for r in requests))
        return outs, time.perf_counter() - start

    async def run() -> None:
        await once(1.0, 2, 4)  # warm-up
        for top_p in (1.0, 0.9):
            for n in (1, 32):
                outs, seconds = await once(top_p, n, args.tokens)
                again, _ = await once(top_p, n, args.tokens)
                made = sum(len(o.token_ids) for o in outs)
                same = sum(a.token_ids == b.token_ids for a, b in zip(outs, again, strict=True))
                finite = all(math.isfinite(x) and x <= 1e-6 for o in outs for x in o.logprobs)
                print(f"top_p {top_p} clients {n}: {made / seconds:.1f} tokens/s, replayed {same} of {n}, "
                      f"logprobs finite and <= 0: {finite}", flush=True)

    try:
        asyncio.run(run())
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
