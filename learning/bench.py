"""Learner speed: training tokens/s (forward + backward + AdamW step) through the real Trainer."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from rollway.learning.config import LearnerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder, .gguf file or 'smollm2' (default)")
    parser.add_argument("--batch", type=int, default=4, help="episodes per update (one group)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per episode")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (no loss) per episode")
    parser.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up update")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weight dtype")
    parser.add_argument("--autocast-bf16", action="store_true", help="bf16 autocast for forward/backward")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the whole batch")
    parser.add_argument("--compare-raw", action="store_true",
                        help="also time a bare forward/backward/AdamW step (cross-entropy) at the same shape")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run 1 + `steps` updates on synthetic groups; tokens/s counts real tokens through
    forward+backward (the prompt included: it is computed too) over update wall time."""
    from rollway.learning.trainer import Trainer

    cfg = LearnerConfig(type="ppo", model_path=args.model, group_size=args.batch, dtype=args.dtype,
                        autocast_bf16=args.autocast_bf16, device=args.device, tensorboard=False,
                        micro_batch_tokens=args.micro_batch_tokens or args.batch * args.seq_len,
                        checkpoint_every=10**9, lr=1e-6)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp))
        load_start = time.perf_counter()
        trainer._ensure_model()  # load outside the timed updates
        load_s = time.perf_counter() - load_start
        vocab = trainer.model.config.vocab_size
        cpu_start = _cpu_seconds()
        results = [_one_update(trainer, f"g{i}", args, vocab) for i in range(args.steps + 1)]
        cpu_s = _cpu_seconds() - cpu_start
        raw = _raw_tokens_per_second(trainer, args, vocab) if args.compare_raw else None
    timed = results[1:]
    tokens = sum(r["train_tokens"] for r in timed)
    seconds = sum(r["train_seconds"] for r in timed)
    return {"model": args.model or "smollm2", "device": str(trainer.device), "dtype": args.dtype,
            "autocast_bf16": args.autocast_bf16, "batch": args.batch, "seq_len": args.seq_len,
            "steps": args.steps, "seconds_per_update": seconds / len(timed),
            "tokens_per_second": tokens / seconds, "cpu_seconds_per_update": cpu_s / len(results),
            "raw_tokens_per_second": raw, "load_seconds": load_s, "peak_rss_gb": _peak_rss_gb()}


def _one_update(trainer: Any, group: str, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    from rollway.learning.testing import make_trajectory

    rng = random.Random(group)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    results = []
    for i in range(args.batch):
        completion = [rng.randrange(vocab) for _ in range(args.seq_len - args.prompt_len)]
        traj = make_trajectory(f"{group}-{i}", group, prompt, completion, float(i % 2), sample_index=i)
        results += trainer.add(traj)
    return results[0].metrics


def _raw_tokens_per_second(trainer: Any, args: argparse.Namespace, vocab: int) -> float:
    """The same shape through model(labels=...) + AdamW: the floor the Trainer's loss path adds to."""
    import torch

    ids = torch.randint(0, vocab, (args.batch, args.seq_len), device=trainer.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.optimizer.zero_grad()
        trainer.model(input_ids=ids, labels=ids).loss.backward()
        trainer.optimizer.step()
    return args.batch * args.seq_len * args.steps / (time.perf_counter() - start)


def _cpu_seconds() -> float:
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def run(args: argparse.Namespace) -> int:
    print(json.dumps(measure(args)))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
