"""Sharded learner: N ranks train one model sharded with FSDP2 (`fully_shard`, gloo on CPU, NCCL on
CUDA). Rank 0 is the learner actor's trainer: it alone consumes, commits offsets and publishes; the
other ranks (`follow`) only run what rank 0 tells them, in the same order.

Protocol. Rank 0 writes each command ("model", "optimise", "save", "stop") to the rendezvous store
(control, waited on without a deadline while the stream is idle), then every rank runs the command's
collectives (data, each bounded by `dist.collective_timeout_s`). A command carries everything a rank
needs (the whole batch, or the checkpoint folder), so followers keep no state rank 0 does not send.

Exactly once. Nothing about offsets changes: rank 0's Trainer decides what is consumed and when a
checkpoint holds it. A checkpoint is durable only after every rank wrote its shards: rank 0 writes
the state file (the mark of a complete checkpoint) after `dcp.save`, a collective, returned.

LoRA and the KL penalty work the same way: the frozen base (and the reference model, kl_coef > 0) are
sharded like the policy; with LoRA the sharded checkpoint holds only the adapters and their optimizer
state, and rank 0 writes the adapter folder the engines load.

Trust. The channel carries no pickle: a command is MessagePack (tensors as dtype, shape and raw
bytes) signed with HMAC-SHA256 under a per-run token (`ROLLWAY_DIST_TOKEN`, made by rank 0 when it starts
the other ranks; set it on every rank under torchrun), and the per-step gathers use the same encoding.
Rank 0's store listens on MASTER_ADDR only (127.0.0.1 unless configured), and gloo on loopback then.
A command that does not verify ends the follower (RankDied) without being decoded.

Failure. A rank that dies makes its peers' next collective (or store read) fail: on rank 0 the update
raises, the trainer is `broken`, the actor ends the worker (FatalActorError) and the restarted learner
resumes from the last checkpoint with fresh ranks; followers exit when rank 0's store goes away."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from rollway.base.faults import fault_point
from rollway.base.process import Child, free_port
from rollway.base.redaction import register_secrets
from rollway.base.secret_pipe import peek_secret
from rollway.learning.batching import Sample
from rollway.learning.config import LearnerConfig
from rollway.learning.losses import TokenStats, sequence_loss_weights, token_logprobs
from rollway.learning.trainer import Trainer

log = logging.getLogger(__name__)

DCP_DIR = "dcp"
"""Sub-folder of a checkpoint holding the sharded model and optimizer (torch.distributed.checkpoint)."""
WEIGHTS_FILE = "model.safetensors"
_CMD = "rollway/cmd/"
DIST_TOKEN_ENV = "ROLLWAY_DIST_TOKEN"
"""The per-run secret every rank signs and checks commands with (environment only: never argv or a file)."""
_MAC_BYTES = hashlib.sha256().digest_size


class RankDied(RuntimeError):
    """A collective or the command channel failed: some rank died, stalled past the timeout, or rank 0 went away."""


def world_from_env() -> tuple[int, int]:
    """(rank, world size) set by torchrun or by rank 0's launcher; (0, 1) outside one."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def wants_sharding(cfg: LearnerConfig) -> bool:
    return cfg.dist.fsdp or cfg.dist.ranks > 1 or world_from_env()[1] > 1


class CommandRefused(RankDied):
    """A command in the store that this run's token does not verify (or that is not MessagePack)."""


def _pack(value: Any) -> Any:
    """Plain data for MessagePack: tensors as dtype/shape/bytes, Samples and TokenStats as tagged maps."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {"__t": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "data": t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""}
    if isinstance(value, Sample | TokenStats):
        return {"__t": type(value).__name__, **{f.name: _pack(getattr(value, f.name))
                                               for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        return {k: _pack(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_pack(v) for v in value]
    return value


_TYPES = {"Sample": Sample, "TokenStats": TokenStats}


def _unpack(value: Any) -> Any:
    """Inverse of `_pack` (tuples come back as lists). Only these known shapes are built: no code runs."""
    if isinstance(value, dict):
        tag = value.get("__t")
        if tag == "tensor":
            dtype = getattr(torch, value["dtype"])
            raw = torch.frombuffer(bytearray(value["data"]), dtype=torch.uint8) if value["data"] else \
                torch.empty(0, dtype=torch.uint8)
            return raw.view(dtype).reshape(value["shape"])
        if tag in _TYPES:
            return _TYPES[tag](**{k: _unpack(v) for k, v in value.items() if k != "__t"})
        return {k: _unpack(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpack(v) for v in value]
    return value


def encode_command(token: bytes, key: str, value: Any) -> bytes:
    """`value` as MessagePack, prefixed by its HMAC-SHA256 under `token` over (`key`, body): a command
    moved to another key (a replay) does not verify either."""
    body = msgpack.packb(_pack(value), use_bin_type=True)
    return hmac.new(token, key.encode() + body, hashlib.sha256).digest() + body


def decode_command(token: bytes, key: str, raw: bytes) -> Any:
    """The value of `encode_command`, after checking its MAC; anything else raises CommandRefused
    before a byte of it is decoded."""
    mac, body = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
    if len(raw) <= _MAC_BYTES or not hmac.compare_digest(mac, hmac.new(token, key.encode() + body,
                                                                            hashlib.sha256).digest()):
        raise CommandRefused(f"refused {key}: not signed with this run's {DIST_TOKEN_ENV} (another process "
                             "wrote into the learner's rendezvous store, or the ranks were started with "
                             "different tokens)")
    return _unpack(msgpack.unpackb(body, raw=False, strict_map_key=False))


def run_token(world: int) -> bytes:
    """This run's channel token: `DIST_TOKEN_ENV`, required with more than one rank."""
    token = _own_token or peek_secret(DIST_TOKEN_ENV)
    if token:
        register_secrets([token])
        return token.encode()
    if world > 1:
        raise RankDied(f"{DIST_TOKEN_ENV} is not set: set the same random secret on every learner rank "
                       "(rollway sets it when it starts the ranks itself; under torchrun export it first)")
    return secrets.token_bytes(32)  # one rank: nobody else needs to know it


def rendezvous_store(rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The TCPStore at MASTER_ADDR:MASTER_PORT. Rank 0 listens on MASTER_ADDR only (torch's own store
    listens on every interface), through a socket it binds itself."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout)
    listener = socket.create_server((host, port), backlog=128)
    port = listener.getsockname()[1]
    # detach: the store owns the descriptor now (Python closing it under the store's daemon aborts the process)
    return dist.TCPStore(host, port, world, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach(),
                         use_libuv=False)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class CommandChannel:
    """Rank 0's numbered commands in the store, signed and checked with the run's token."""

    def __init__(self, store: Any, token: bytes, rank: int) -> None:
        self.store, self.token, self.rank = store, token, rank
        self._seq = 0

    def send(self, name: str, payload: Any = None) -> None:
        """Rank 0: publish the next command. Earlier commands' keys are dropped (every rank read them:
        their collectives finished)."""
        self._seq += 1
        key = f"{_CMD}{self._seq}"
        self.store.set(key, encode_command(self.token, key, [name, payload]))
        if self._seq > 2:
            with contextlib.suppress(Exception):
                self.store.delete_key(f"{_CMD}{self._seq - 2}")

    def receive(self, poll_s: float = 5.0) -> tuple[str, Any]:
        """Followers: the next command, waiting as long as rank 0 lives (the store is rank 0's)."""
        self._seq += 1
        key = f"{_CMD}{self._seq}"
        while True:
            try:
                self.store.wait([key], timedelta(seconds=poll_s))
                raw = self.store.get(key)
                break
            except Exception as err:  # timeout: poll again; anything else: rank 0 is gone
                if "timeout" not in str(err).lower() and "timed out" not in str(err).lower():
                    raise RankDied(f"rank {self.rank}: lost rank 0's command channel ({err})") from err
        name, payload = decode_command(self.token, key, raw)
        return name, payload


class RankGroup:
    """The process group plus rank 0's command channel (keys in the rendezvous TCPStore)."""

    def __init__(self, cfg: LearnerConfig, device: torch.device):
        self.timeout = timedelta(seconds=cfg.dist.collective_timeout_s)
        backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a one-rank group (dist.fsdp on one process)
            os.environ["MASTER_PORT"] = str(free_port())
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        if _is_loopback(os.environ["MASTER_ADDR"]):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pair sockets on loopback too
        rank, world = world_from_env()
        token = run_token(world)
        if not dist.is_initialized():
            if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent owns the store (and its port)
                dist.init_process_group(backend, timeout=self.timeout)
            else:
                dist.init_process_group(backend, timeout=self.timeout, rank=rank, world_size=world,
                                        store=rendezvous_store(rank, world, self.timeout))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.channel = CommandChannel(self.store, token, self.rank)

    def send(self, name: str, payload: Any = None) -> None:
        self.channel.send(name, payload)

    def receive(self, poll_s: float = 5.0) -> tuple[str, Any]:
        return self.channel.receive(poll_s)

    def close(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class ShardedTrainer(Trainer):
    """A Trainer whose model is sharded over the ranks of `group`. On rank 0 it is the learner's
    trainer (same public API); on other ranks `follow()` runs rank 0's commands until "stop".

    Each optimizer step splits the mini-batch over ranks (balanced by tokens); each rank runs the same
    number of micro-batches (empty ranks run a zero-weight one, since FSDP's all-gathers need every
    rank), with the mini-batch's global loss weights, so the reduced gradient equals one process's."""

    def __init__(self, cfg: LearnerConfig, run_dir: Path, *, group_size: int | None = None,
                 model_factory: Any = None) -> None:
        rank, _ = world_from_env()
        kwargs = {"model_factory": model_factory} if model_factory else {}
        if rank == 0:  # read the checkpoint folder before the other ranks can look at it
            super().__init__(cfg, run_dir, group_size=group_size, **kwargs)
            self.group = RankGroup(cfg, self.device)
        else:
            device = _rank_device(cfg)
            self.group = RankGroup(cfg, device)
            super().__init__(cfg, run_dir, group_size=group_size, **kwargs)
        self.device = _rank_device(cfg)
        self._sharded_ckpt: Path | None = self.latest_checkpoint

    @property
    def rank(self) -> int:
        return self.group.rank

    # ---- rank 0: each collective step is announced first ------------------------------------------

    def _ensure_model(self) -> None:
        if self.model is not None:
            return
        self._lead("model", str(self.latest_checkpoint) if self.latest_checkpoint else None)
        self._build(self.latest_checkpoint)

    def _optimise(self, samples: list[Sample]) -> dict[str, float]:
        self._lead("optimise", samples)
        return self._guarded(super()._optimise, samples)

    def _weights_writer(self) -> Callable[[Path], None]:
        return self._write_lead

    def close(self) -> None:
        if self.rank == 0 and self.broken is None:
            with contextlib.suppress(Exception):
                self.group.send("stop")
        super().close()
        self.group.close()

    def peak_memory_per_rank(self) -> list[float]:
        """Rank 0: each rank's peak memory in GB (CUDA: allocated on its device; CPU: resident set)."""
        self._lead("memory", None)
        return self._gather(peak_memory_gb(self.device))

    def _lead(self, name: str, payload: Any) -> None:
        if self.rank == 0:
            self.group.send(name, payload)

    def _write_lead(self, folder: Path) -> None:
        """Rank 0's part of a save: every rank writes its shards, rank 0 also the full HF weights."""
        self._lead("save", str(folder))
        self._guarded(self._write_shards, folder)

    # ---- every rank --------------------------------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it says stop (or goes away: RankDied)."""
        while True:
            name, payload = self.group.receive()
            if name == "stop":
                return
            if name == "model":
                self._build(Path(payload) if payload else None)
            elif name == "optimise":
                self._guarded(super()._optimise, payload)
            elif name == "save":
                self._guarded(self._write_shards, Path(payload))
            elif name == "memory":
                self._gather(peak_memory_gb(self.device))
            else:
                raise RankDied(f"rank {self.rank}: unknown command {name!r} from rank 0")

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except RankDied:
            raise
        except RuntimeError as err:
            text = str(err)
            if any(w in text for w in ("Connection", "connection", "timed out", "Timeout", "closed", "peer",
                                       "NCCL", "Gloo", "gloo")):
                raise RankDied(f"rank {self.rank}: a collective failed (another rank died or stalled longer than "
                               f"learner.dist.collective_timeout_s={self.cfg.dist.collective_timeout_s:g}s): {text}; "
                               "restart the learner: it resumes from its last checkpoint") from err
            raise

    def _build(self, ckpt: Path | None) -> None:
        """Model from `ckpt` (full HF weights; with LoRA the initial model plus the adapters of `ckpt`)
        or the initial model, sharded; AdamW; the reference model (kl_coef > 0), sharded the same way;
        then the sharded model and optimizer state of `ckpt` when it has them (resharded to this rank
        count). Same order of random draws as Trainer._ensure_model: fresh adapters match one process's."""
        torch.manual_seed(self.cfg.seed)
        lora = self.cfg.lora.enabled  # LoRA checkpoints hold adapters only: the base is the initial model
        model, self.tokenizer = self._factory(str(ckpt) if ckpt and not lora else None)
        model.to(device=self.device, dtype=self.dtype)
        if lora:
            from rollway.learning.lora import attach_lora

            model = attach_lora(model, self.cfg.lora, ckpt)
        self._set_mode(model)
        self.model = self._shard(model)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay,
                                           betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))
        if self.cfg.kl_coef > 0:  # every rank holds its shard of the frozen initial policy
            ref = self._factory(None)[0].to(device=self.device, dtype=self.dtype).eval()
            self._ref_model = self._shard(ref.requires_grad_(False))
        if ckpt is not None and (ckpt / DCP_DIR).is_dir():
            self._guarded(self._load_shards, ckpt / DCP_DIR)

    def _shard(self, model: Any) -> Any:
        """`fully_shard` each transformer block, then the whole model (FSDP2; bf16 compute with fp32
        master weights and reduction under autocast_bf16). Frozen weights (LoRA's base, the reference
        model) are sharded too: they get no gradient and join no reduction."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.cfg.autocast_bf16 else MixedPrecisionPolicy()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        blocks = set(getattr(base, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model

    def _state_options(self, **kw: Any) -> Any:
        """Which weights the sharded checkpoint holds: all of them, or with LoRA the adapters only."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = self.cfg.lora.enabled
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora, **kw)

    def _load_shards(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        options = self._state_options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": model_sd}
        if (folder.parent / "has_optimizer").exists():
            state["optim"] = optim_sd
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", optim_sd), options=options)

    def _write_shards(self, folder: Path) -> None:
        """Every rank: its shards of the model (LoRA: the adapters only) and optimizer; rank 0 also the
        whole weights the engine loads (LoRA: the adapter folder, written once, by rank 0)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        state = {"model": model_sd}
        if self.cfg.save_optimizer:
            state["optim"] = optim_sd
        dcp.save(state, checkpoint_id=str(folder / DCP_DIR))
        full = get_model_state_dict(self.model, options=self._state_options(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            if self.cfg.save_optimizer:
                (folder / "has_optimizer").touch()
            if self.cfg.lora.enabled:
                from rollway.learning.lora import write_adapter

                write_adapter(folder, self.model, full, self.tokenizer)
            else:
                write_hf_weights(folder, full, self.model.config, self.tokenizer)

    def _autocast(self):
        # FSDP's MixedPrecisionPolicy already computes in bf16 (fp32 master weights, fp32 reduce).
        return contextlib.nullcontext()

    def _optimizer_step(self, samples: list[Sample], old: list[torch.Tensor] | None,
                        ref: list[torch.Tensor] | None, stats: TokenStats, totals: dict[str, float]) -> None:
        """This rank's share of one optimizer step; stats and totals come back summed over ranks."""
        assert self.optimizer is not None
        weights = sequence_loss_weights([s.loss_tokens for s in samples], [s.sample_weight for s in samples],
                                        self.cfg.effective_loss_agg, self.cfg.loss_norm_tokens,
                                        episode_ids=[s.episode_id for s in samples])
        plans = rank_plans(samples, self.group.world, self._plan)
        mine, steps = plans[self.rank], max(len(p) for p in plans)
        local_stats, local = TokenStats(), {"loss": 0.0, "tokens": 0.0, "padded_tokens": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for k in range(steps):
            if k < len(mine):
                rows = mine[k]
                mb = self._collate(samples, rows, weights)
                loss = self._micro_loss(mb, mb.place(old), mb.place(ref), local_stats)
                local["loss"] += float(loss.detach())
                local["tokens"] += mb.real_tokens
                local["padded_tokens"] += mb.input_ids_B_T.numel()
            else:
                loss = self._idle_loss(self.model)
            # FSDP averages gradients over ranks; the weights already normalise over the whole mini-batch.
            (loss * self.group.world).backward()
            if self.rank > 0:
                fault_point("learner.rank_step")  # chaos: a rank > 0 dies mid-step; rank 0's next collective fails
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.state.optimizer_steps += 1
        _merge(stats, totals, self._gather((local_stats, local)))
        totals["grad_norm"] += float(norm)

    def _idle_loss(self, model: Any) -> torch.Tensor:
        """A zero loss through the whole of `model`: a rank without rows still joins every collective."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        return model(input_ids=ids).logits.float().sum() * 0.0

    @torch.no_grad()
    def _logprobs_no_grad(self, model: Any, samples: list[Sample]) -> list[torch.Tensor]:
        """pi_old per sample: each rank computes its share, then all ranks get every sample's."""
        plans = rank_plans(samples, self.group.world, self._plan)
        mine, steps = plans[self.rank], max(len(p) for p in plans)
        out: dict[int, torch.Tensor] = {}
        for k in range(steps):
            if k >= len(mine):
                self._idle_loss(model)  # the policy's or the reference model's all-gathers
                continue
            mb = self._collate(samples, mine[k], [0.0] * len(samples))
            logits = model(**mb.model_inputs()).logits
            lp_B_T = token_logprobs(logits, mb.input_ids_B_T, self.cfg.temperature, mb.loss_mask_B_T).cpu()
            out.update(mb.extract(lp_B_T))
        merged: dict[int, torch.Tensor] = {}
        for part in self._gather(out):
            merged.update(part)
        return [merged[i] for i in range(len(samples))]

    def _gather(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in rank order: MessagePack bytes through two all_gathers (lengths, then
        padded bytes), not all_gather_object, which unpickles what peers send."""
        data = torch.frombuffer(bytearray(msgpack.packb(_pack(obj), use_bin_type=True)), dtype=torch.uint8)
        data = data.to(self.device)
        sizes = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(self.group.world)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.long, device=self.device))
        longest = max(int(n) for n in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        parts = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.group.world)]
        dist.all_gather(parts, padded)
        return [_unpack(msgpack.unpackb(p[:int(n)].cpu().numpy().tobytes(), raw=False, strict_map_key=False))
                for p, n in zip(parts, sizes, strict=True)]


def rank_plans(samples: list[Sample], world: int,
               plan: Callable[[list[int]], list[list[int]]]) -> list[list[list[int]]]:
    """Per rank, its micro-batches (lists of sample indices): samples go longest first to the rank
    with the fewest tokens so far, then each rank plans its micro-batches with `plan` (lengths ->
    micro-batches of local indices: padded rows within the token budget, or packed rows).
    Deterministic, so every rank computes the same plan from the same batch."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(samples)), key=lambda i: (-len(samples[i].token_ids), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += len(samples[i].token_ids)
    plans = []
    for share in shares:
        local = plan([len(samples[i].token_ids) for i in share])
        plans.append([[share[j] for j in mb] for mb in local])
    return plans


def _merge(stats: TokenStats, totals: dict[str, float], parts: list[tuple[TokenStats, dict[str, float]]]) -> None:
    for part_stats, part_totals in parts:
        stats.tokens += part_stats.tokens
        for k, v in part_stats.sums.items():
            stats.sums[k] = stats.sums.get(k, 0.0) + v
        for k, v in part_stats.maxs.items():
            stats.maxs[k] = max(stats.maxs.get(k, -float("inf")), v)
        for k, v in part_stats.mins.items():
            stats.mins[k] = min(stats.mins.get(k, float("inf")), v)
        for k, v in part_totals.items():
            totals[k] += v


def write_hf_weights(folder: Path, full_sd: dict[str, torch.Tensor], config: Any, tokenizer: Any | None) -> None:
    """A loadable HF folder (model.safetensors + config.json) from a full state dict: what the engine
    loads and what `from_pretrained` reads on resume. A tied lm_head is stored once (as HF does)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in full_sd.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _rank_device(cfg: LearnerConfig) -> torch.device:
    from rollway.learning.modeling import pick_device

    device = pick_device(cfg.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return device


def build_trainer(cfg: LearnerConfig, run_dir: Path, *, group_size: int | None = None,
                  model_factory: Any = None) -> Trainer:
    """The learner's trainer: the single-process Trainer, or rank 0 of a sharded group (starting
    ranks 1..N-1 first when `dist.ranks` > 1 and no launcher such as torchrun set WORLD_SIZE)."""
    kwargs = {"model_factory": model_factory} if model_factory else {}
    if not wants_sharding(cfg):
        return Trainer(cfg, run_dir, group_size=group_size, **kwargs)
    if world_from_env()[1] == 1 and cfg.dist.ranks > 1:
        start_followers(cfg.dist.ranks, cfg.dist.master_port)
    return ShardedTrainer(cfg, run_dir, group_size=group_size, **kwargs)


_children: list[Child] = []
_own_token: str | None = None
"""Rank 0's channel token when it started the followers itself (`start_followers`)."""


def start_followers(world: int, port: int | None, argv: list[str] | None = None) -> list[Child]:
    """Make this process rank 0 of `world` and start ranks 1..world-1 as copies of this command
    (`argv`, default this process's) with RANK/WORLD_SIZE/MASTER_* set; they are ended with it."""
    global _own_token
    # Signs rank 0's commands; handed to the followers over a pipe, never in an environment block.
    _own_token = peek_secret(DIST_TOKEN_ENV) or secrets.token_hex(32)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or free_port()), "WORLD_SIZE": str(world)}
    os.environ.update({**env, "RANK": "0", "LOCAL_RANK": "0"})
    command = argv or [sys.executable, *sys.orig_argv[1:]]
    for rank in range(1, world):
        # Sharing this process's output and group: a rank's traceback lands in the learner's own log.
        _children.append(Child(command, None, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                               name=f"learner rank {rank}", own_group=False,
                               secrets={DIST_TOKEN_ENV: _own_token}).start())
    atexit.register(stop_followers)
    return list(_children)


def stop_followers(grace_s: float = 10.0) -> None:
    """End the ranks this process started (they normally exit on "stop" or when rank 0's store closes)."""
    deadline = time.monotonic() + grace_s
    for child in _children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(max(0.0, deadline - time.monotonic()))
        child.kill()  # a no-op for a rank that exited
    _children.clear()


def run_follower(cfg: LearnerConfig, run_dir: Path, group_size: int | None) -> int:
    """Entry of ranks > 0 (`rollway stage learner` with RANK > 0): follow rank 0, then exit.
    Exit code 1 with a clear message when rank 0 or a peer went away."""
    trainer = ShardedTrainer(cfg, run_dir, group_size=group_size)
    try:
        trainer.follow()
    except RankDied as err:
        print(f"rollway learner rank {trainer.rank}: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        trainer.group.close()
    return 0
