"""`rollway bench weight-sync`: the learner's weight broadcast to several vLLM replicas, measured.

Starts `--replicas` vLLM servers (or uses running ones, `--url`), then pushes `--updates` full
checkpoints (float32 safetensors, as the learner writes them) and as many LoRA adapters (adapter files
only) to every replica through rollway's own client (`VLLMClient.load_weights`: pause -> reload or
load adapter -> reset prefix cache -> set version -> resume, all replicas at once), and reports per
update the bytes each replica read, the pause-to-resume time of each replica and the total time.
Ends with a full reload of the base model (version 0), so running servers are left as found."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollway.base.figures import dumps
from rollway.base.run_dir import RunDir
from rollway.bench.bench_dir import BenchDir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="vLLM servers to start (ignored with --url)")
    parser.add_argument("--updates", type=int, default=3, help="full checkpoints pushed, then as many LoRA adapters")
    parser.add_argument("--model", default="smollm2", help="served base model: 'smollm2', a .gguf or an HF folder")
    parser.add_argument("--lora-r", type=int, default=8, help="adapter rank (q/k/v/o projections)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache per replica (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--url", default=None,
                        help="comma-separated /v1 URLs of running vLLM servers started with --enable-lora "
                             "--max-lora-rank >= --lora-r and VLLM_SERVER_DEV_MODE=1 (default: start --replicas)")
    parser.add_argument("--out", default=None, help="folder for the checkpoints and server logs (default: a temp folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    if args.updates < 1 or args.replicas < 1:
        print("rollway bench weight-sync: --updates and --replicas must be at least 1", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    made = time.perf_counter()
    full, adapters = write_checkpoints(args.model, out, args.updates, args.lora_r)
    result: dict[str, Any] = {"model": args.model, "cores": os.cpu_count(), "load_average_start": round(load_start, 2),
                              "checkpoints_written_s": round(time.perf_counter() - made, 1)}
    launched = None
    api_key = os.environ.get("OPENAI_API_KEY")  # a server given by --url: its key, if it has one
    if args.url:
        urls = [u.strip() for u in args.url.split(",") if u.strip()]
    else:
        launched, result["start_s"] = _launch(args, out)
        urls, api_key = [s.base_url for s in launched.servers], launched.api_key
    try:
        result.update(asyncio.run(push_all(urls, args.model, full, adapters, api_key)))
    finally:
        if launched is not None:
            launched.stop()
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    BenchDir(out).result.write_text(dumps(result, indent=1))
    print(dumps(result) if args.json else report(result))
    return 0


def _launch(args: argparse.Namespace, out: Path) -> tuple[Any, float]:
    from rollway.policies.config import PolicyConfig
    from rollway.policies.launch import launch_engine

    cfg = PolicyConfig(type="openai", launch=True, engine="vllm", model=args.model, replicas=args.replicas,
                       kv_cache_gib=args.kv_cache_gib, vllm_args=["--enable-lora", "--max-lora-rank", str(args.lora_r)])
    start = time.perf_counter()
    launched = launch_engine(cfg, RunDir(out).logs)
    return launched, round(time.perf_counter() - start, 1)


def write_checkpoints(model: str, out: Path, updates: int, lora_r: int) -> tuple[list[Path], list[Path]]:
    """`updates` full checkpoints (the base, float32, each with its final norm scaled a little: distinct
    weights) written as the learner writes them (`save_pretrained`), and as many LoRA adapters (fresh
    peft adapters with non-zero B) written as the learner's LoRA checkpoints are."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollway.learning.lora import attach_lora
    from rollway.learning.scale_config import LoraConfig
    from rollway.policies.model_loading import resolve_model_folder

    base = resolve_model_folder(model)
    tokenizer = AutoTokenizer.from_pretrained(base)
    full = []
    net = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for k in range(1, updates + 1):
        with torch.no_grad():
            net.model.norm.weight.mul_(1.01)
        folder = out / "full" / f"step_{k:06d}"
        net.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        full.append(folder)
    adapters = []
    torch.manual_seed(0)
    peft = attach_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(r=lora_r))
    for k in range(1, updates + 1):
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 1e-3)
        folder = out / "lora" / f"step_{k:06d}"
        peft.save_pretrained(folder)
        adapters.append(folder)
    return full, adapters


def weight_bytes(folder: Path) -> int:
    """Bytes a replica reads for this update: the folder's safetensors files."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


async def push_all(urls: list[str], model: str, full: list[Path], adapters: list[Path],
                   api_key: str | None = None) -> dict[str, Any]:
    """Every full checkpoint, then every adapter, then the base again, to all replicas; per update its
    kind, version, bytes per replica and in all, each replica's pause-to-resume and the total time."""
    from rollway.policies.model_loading import resolve_model_folder
    from rollway.policies.vllm import VLLMClient

    client = VLLMClient(urls, api_key=api_key)
    updates = []
    try:
        version = 0
        for kind, folders in (("full", full), ("lora", adapters)):
            for folder in folders:
                version += 1
                updates.append(await _push(client, kind, folder, version))
        updates.append(await _push(client, "full-base", resolve_model_folder(model), 0))
    finally:
        await client.close()
    summary = {kind: _summary([u for u in updates if u["kind"] == kind]) for kind in ("full", "lora")}
    return {"replicas": len(urls), "updates": updates, "summary": summary}


async def _push(client: Any, kind: str, folder: Path, version: int) -> dict[str, Any]:
    start = time.perf_counter()
    await client.load_weights(str(folder), version)
    total = time.perf_counter() - start
    served = await client.served_version()
    if served != version:
        raise RuntimeError(f"after pushing version {version} the replicas serve {served}")
    for root in client.roots:  # every replica generates under the name turns now use (the adapter's or the base's)
        await client._request("POST", f"{root}/v1/completions", {"model": await client.model_name(),
                                                                 "prompt": [1, 2, 3], "max_tokens": 1})
    per_replica = [round(client.last_update_s[root], 3) for root in client.roots]
    size = weight_bytes(folder)
    return {"kind": kind, "version": version, "bytes_per_replica": size, "bytes_total": size * len(client.roots),
            "pause_to_resume_s": per_replica, "total_s": round(total, 3)}


def _summary(updates: list[dict[str, Any]]) -> dict[str, Any]:
    totals = [u["total_s"] for u in updates]
    replicas = [s for u in updates for s in u["pause_to_resume_s"]]
    return {"updates": len(updates), "bytes_per_replica": updates[0]["bytes_per_replica"],
            "bytes_total_per_update": updates[0]["bytes_total"],
            "total_s_median": round(statistics.median(totals), 3), "total_s_max": round(max(totals), 3),
            "pause_to_resume_s_median": round(statistics.median(replicas), 3),
            "pause_to_resume_s_max": round(max(replicas), 3)}


def report(r: dict[str, Any]) -> str:
    lines = [f"weight sync of {r['model']} to {r['replicas']} vLLM replica(s) ({r['cores']} cores, load average "
             f"{r['load_average_start']} -> {r['load_average_end']})"]
    for kind, s in r["summary"].items():
        lines.append(f"  {kind}: {s['bytes_per_replica'] / 1e6:.1f} MB per replica, {s['bytes_total_per_update'] / 1e6:.1f} "
                     f"MB per update; total {s['total_s_median']:.3f} s median ({s['total_s_max']:.3f} max), "
                     f"pause-to-resume per replica {s['pause_to_resume_s_median']:.3f} s median "
                     f"({s['pause_to_resume_s_max']:.3f} max)")
    return "\n".join(lines)
