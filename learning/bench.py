"""Learner speed: training tokens/s (forward + backward + AdamW step) through the real Trainer."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollway.base.figures import dumps
from rollway.learning.config import LearnerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder, .gguf file or 'smollm2' (default)")
    parser.add_argument("--batch", type=int, default=4, help="episodes per update (one group; at least 2: "
                        "a group of one has no advantage and trains nothing)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per episode")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (no loss) per episode")
    parser.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up update")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weight dtype")
    parser.add_argument("--autocast-bf16", action="store_true", help="bf16 autocast for forward/backward")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the whole batch")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    parser.add_argument("--ranks", type=int, default=1, help="sharded learner ranks (FSDP2; gloo on CPU)")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 even with one rank")
    parser.add_argument("--pack", action="store_true", help="pack episodes into rows of --micro-batch-tokens")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (rank --lora-r) instead of all weights")
    parser.add_argument("--lora-r", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate")
    parser.add_argument("--compare-raw", action="store_true",
                        help="also time a bare forward/backward/AdamW step (cross-entropy) at the same shape")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run 1 + `steps` updates on synthetic groups; tokens/s counts real tokens through
    forward+backward (the prompt included: it is computed too) over update wall time."""
    from rollway.learning.distributed import build_trainer, peak_memory_gb

    cfg = config_of(args)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp))
        load_start = time.perf_counter()
        trainer._ensure_model()  # load outside the timed updates
        load_s = time.perf_counter() - load_start
        vocab = trainer.model.config.vocab_size
        cpu_start = _cpu_seconds()
        results = [_one_update(trainer, f"g{i}", args, vocab) for i in range(args.steps + 1)]
        cpu_s = _cpu_seconds() - cpu_start
        raw = _raw_tokens_per_second(trainer, args, vocab) if args.compare_raw and args.ranks == 1 else None
        ranks_memory = (trainer.peak_memory_per_rank() if hasattr(trainer, "peak_memory_per_rank")
                        else [peak_memory_gb(trainer.device)])
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        trainer.close()
    timed = results[1:]
    tokens = sum(r["train_tokens"] for r in timed)
    seconds = sum(r["train_seconds"] for r in timed)
    return {"model": args.model or "smollm2", "device": str(trainer.device), "dtype": args.dtype,
            "autocast_bf16": args.autocast_bf16, "batch": args.batch, "seq_len": args.seq_len,
            "steps": args.steps, "seconds_per_update": seconds / len(timed),
            "tokens_per_second": tokens / seconds, "cpu_seconds_per_update": cpu_s / len(results),
            "raw_tokens_per_second": raw, "load_seconds": load_s, "peak_rss_gb": _peak_rss_gb(),
            "ranks": args.ranks, "peak_memory_gb_per_rank": ranks_memory,
            "pack_sequences": args.pack, "gradient_checkpointing": args.gradient_checkpointing,
            "lora": args.lora, "trainable_parameters": trainable}


def config_of(args: argparse.Namespace) -> LearnerConfig:
    return LearnerConfig(type="ppo", model_path=args.model, group_size=args.batch, dtype=args.dtype,
                         autocast_bf16=args.autocast_bf16, device=args.device, tensorboard=False,
                         micro_batch_tokens=args.micro_batch_tokens or args.batch * args.seq_len,
                         checkpoint_every=10**9, lr=args.lr, pack_sequences=args.pack,
                         gradient_checkpointing=args.gradient_checkpointing,
                         dist={"ranks": args.ranks, "fsdp": args.fsdp},
                         lora={"enabled": args.lora, "r": args.lora_r})


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
    import os

    if args.batch < 2:
        print("rollway bench learner: --batch must be at least 2 (a group of one episode has no advantage, so "
              "no update would run to time)", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) > 0:  # a rank the bench's rank 0 started: follow it
        from rollway.learning.distributed import run_follower

        with tempfile.TemporaryDirectory() as tmp:
            return run_follower(config_of(args), Path(tmp), args.batch)
    print(dumps(measure(args)))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
