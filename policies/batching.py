"""Continuous batching over a Hugging Face causal LM: the compute core of the built-in CPU engine.

One engine thread owns the model. Each loop iteration admits waiting requests (prefilled together,
left-padded, then merged into the running batch's KV cache), runs one decode step for every running
sequence, samples per sequence and retires finished ones, so requests that arrive while others decode
join at the next step. Weight updates wait until running sequences finish (new ones are held back),
so every completion comes from one policy version.

Logprobs are those of the sampled token under the distribution actually sampled from: logits / T,
restricted to the top-p nucleus and renormalised (the behaviour policy RL needs). For T = 0 (greedy)
the distribution is a point mass, so the untempered (T = 1) logprob is reported instead.
"""

from __future__ import annotations

import asyncio
import math
import queue
import random
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rollway.policies.base import SamplingParams


class RequestRefused(ValueError):
    """A request the engine cannot serve for what it holds (empty, an id outside the vocabulary, longer than
    the context): the client's error, raised by `BatchEngine.check` and `generate`."""


@dataclass(frozen=True)
class EngineRequest:
    """One completion request; `prompt_ids` are validated by `BatchEngine.check`."""

    prompt_ids: list[int]
    params: SamplingParams
    ignore_eos: bool = False
    """Do not stop at the model's EOS token (benchmarks); `stop_token_ids` still stop."""
    top_logprobs: int = 0
    """Also return this many most likely tokens per position (under the sampling distribution)."""


@dataclass
class EngineOutput:
    """A finished completion. Per-token lists have the length of `token_ids` (stop token included)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str
    """`stop` (a stop token or EOS was produced) or `length` (max_tokens or the context was reached)."""
    stop_reason: int | None
    """The stop token id that ended generation; None for EOS or length (as vLLM reports it)."""
    policy_version: int
    prompt_len: int


@dataclass
class _Seq:
    request: EngineRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator
    version: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)


@dataclass
class _WeightUpdate:
    state_dict: dict[str, torch.Tensor]
    version: int | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
             error: BaseException | None = None) -> None:
    def apply() -> None:
        if future.done():
            return  # the caller went away (cancelled request)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    loop.call_soon_threadsafe(apply)


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class BatchEngine:
    """Serves `model` to many concurrent callers; call `start()` once, then `await generate(...)`."""

    def __init__(self, model: Any, eos_token_ids: tuple[int, ...], max_batch: int = 8,
                 max_model_len: int = 2048, policy_version: int = 0):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.policy_version = policy_version
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[_Seq] = deque()
        self._update: _WeightUpdate | None = None
        self._seqs: list[_Seq] = []
        self._base: dict[str, torch.Tensor] = {}
        """Base weights of the layers LoRA adapters touched (a later adapter replaces, not stacks)."""
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, T] 1 where the cache holds a real token
        self._next_pos: torch.Tensor | None = None  # [B] position id of the next fed token
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollway-engine", daemon=True)
        self.steps = 0

    # -- public API (event-loop side) --------------------------------------------------------------

    def start(self) -> BatchEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def check(self, request: EngineRequest) -> None:
        """Raise RequestRefused (a client error) if the request cannot be served."""
        ids = request.prompt_ids
        if not ids:
            raise RequestRefused("prompt is empty: send at least one token id")
        bad = [t for t in [*ids, *request.params.stop_token_ids] if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRefused(f"token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        total = len(ids) + request.params.max_tokens
        if total > self.max_model_len:
            raise RequestRefused(f"prompt ({len(ids)} tokens) + max_tokens ({request.params.max_tokens}) = {total} "
                             f"exceeds the engine's max_model_len {self.max_model_len}: shorten the prompt "
                             "or lower max_tokens")

    async def generate(self, request: EngineRequest) -> EngineOutput:
        """The request's output; RequestRefused, before it is queued, when it cannot be served."""
        self.check(request)
        loop = asyncio.get_running_loop()
        seed = request.params.seed if request.params.seed is not None else random.getrandbits(63)
        seq = _Seq(request, loop.create_future(), loop, torch.Generator().manual_seed(seed))
        self._inbox.put(seq)
        return await seq.future

    async def update_weights(self, checkpoint: str | Path, version: int | None = None) -> int:
        """Load safetensors weights from `checkpoint` (a folder or file) once running sequences finish;
        returns the new policy version (`version`, or the current one + 1)."""
        state_dict = await asyncio.to_thread(self.read_checkpoint, Path(checkpoint))
        loop = asyncio.get_running_loop()
        update = _WeightUpdate(state_dict, version, loop.create_future(), loop)
        self._inbox.put(update)
        return await update.future

    def read_checkpoint(self, path: Path) -> dict[str, torch.Tensor]:
        """Tensors of every *.safetensors in `path`, checked against the model's parameter names/shapes."""
        from safetensors.torch import load_file

        from rollway.policies.adapters import is_adapter, merged_weights

        if path.is_dir() and is_adapter(path):  # LoRA: only the adapters travel; merged onto our base
            return merged_weights(path, self._base_weight)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"no *.safetensors checkpoint at {path}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(f))
        own = self.model.state_dict()
        unknown = sorted(set(tensors) - set(own))
        wrong = sorted(k for k in set(tensors) & set(own) if tensors[k].shape != own[k].shape)
        missing = sorted(set(own) - set(tensors) - self._tied_names())
        if unknown or wrong or missing:
            raise ValueError(f"checkpoint {path} does not fit the served model: unknown {unknown[:3]}, "
                             f"wrong shape {wrong[:3]}, missing {missing[:3]}")
        return tensors

    def _base_weight(self, name: str) -> torch.Tensor | None:
        """The weight `name` as first loaded (LoRA merges onto it), copied on first use."""
        if name not in self._base:
            own = self.model.state_dict().get(name)
            if own is None:
                return None
            self._base[name] = own.detach().clone()
        return self._base[name]

    def _tied_names(self) -> set[str]:
        # lm_head shares the embedding matrix in tied models; checkpoints store it once.
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        return {"lm_head.weight"} if tied else set()

    # -- engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._receive(block=not self._seqs and not self._waiting)
            try:
                self._maybe_update_weights()
                self._admit()
                if self._seqs:
                    self._decode_step()
            except Exception as error:  # keep serving: fail the affected requests, reset the batch
                for seq in self._seqs:
                    _resolve(seq.loop, seq.future, error=error)
                self._reset_batch()

    def _receive(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, _WeightUpdate):
                self._queue_update(item)
            else:
                self._waiting.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _queue_update(self, update: _WeightUpdate) -> None:
        if self._update is not None:  # a newer checkpoint supersedes one not yet applied
            _resolve(self._update.loop, self._update.future, error=RuntimeError("superseded by a newer update"))
        self._update = update

    def _maybe_update_weights(self) -> None:
        update = self._update
        if update is None or self._seqs:
            return  # drain running sequences first: one policy version per completion
        self._update = None
        try:
            with torch.no_grad():
                self.model.load_state_dict(update.state_dict, strict=False)
            self.policy_version = update.version if update.version is not None else self.policy_version + 1
            _resolve(update.loop, update.future, self.policy_version)
        except Exception as error:
            _resolve(update.loop, update.future, error=error)

    def _admit(self) -> None:
        if self._update is not None:
            return  # hold new requests back until the weight update is applied
        while self._waiting and self._waiting[0].future.done():
            self._waiting.popleft()  # cancelled before it started
        room = self.max_batch - len(self._seqs)
        new = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        if new:
            self._prefill(new)

    @torch.inference_mode()
    def _prefill(self, new: list[_Seq]) -> None:
        from transformers import DynamicCache

        length = max(len(s.request.prompt_ids) for s in new)
        ids = torch.zeros(len(new), length, dtype=torch.long)
        mask = torch.zeros(len(new), length, dtype=torch.long)
        for i, s in enumerate(new):
            n = len(s.request.prompt_ids)
            ids[i, length - n:] = torch.tensor(s.request.prompt_ids)
            mask[i, length - n:] = 1
            s.version = self.policy_version
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self._zero_padding(cache, mask)
        self._merge(new, cache, mask, mask.sum(-1))
        self._sample_and_retire(out.logits[:, -1], first_new=len(self._seqs) - len(new))

    def _zero_padding(self, cache: Any, mask: torch.Tensor) -> None:
        # Padded slots are never attended to, but NaN there would still poison 0-weight sums.
        keep = mask.bool()[:, None, :, None]
        for layer in cache.layers:
            layer.keys = torch.where(keep, layer.keys, 0)
            layer.values = torch.where(keep, layer.values, 0)

    def _merge(self, new: list[_Seq], cache: Any, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        """Append the prefilled rows to the running batch, left-padding both to one cache length."""
        if not self._seqs:
            self._seqs, self._cache, self._mask, self._next_pos = list(new), cache, mask, next_pos
            return
        length = max(self._mask.shape[1], mask.shape[1])
        for old, add in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, length, 2), _left_pad(add.keys, length, 2)])
            old.values = torch.cat([_left_pad(old.values, length, 2), _left_pad(add.values, length, 2)])
        self._mask = torch.cat([_left_pad(self._mask, length, 1), _left_pad(mask, length, 1)])
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self._seqs.extend(new)

    @torch.inference_mode()
    def _decode_step(self) -> None:
        last = torch.tensor([[s.token_ids[-1]] for s in self._seqs], device=self.device)
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(self._seqs), 1)], dim=1)
        out = self.model(input_ids=last, attention_mask=self._mask, position_ids=self._next_pos[:, None],
                         past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        self._next_pos = self._next_pos + 1
        self.steps += 1
        self._sample_and_retire(out.logits[:, -1], first_new=0)

    def _sample_and_retire(self, logits_B_V: torch.Tensor, first_new: int) -> None:
        """Sample for rows `first_new:` (earlier rows were sampled already this step), retire finished."""
        rows = self._seqs[first_new:]
        logprobs_B_V = self._sampling_logprobs(logits_B_V.float(), rows)
        cdf_B_V = logprobs_B_V.exp().cumsum(-1)
        for seq, logprobs_V, cdf_V in zip(rows, logprobs_B_V, cdf_B_V, strict=True):
            self._sample_one(seq, logprobs_V, cdf_V)
        keep = [i for i, s in enumerate(self._seqs) if not self._finish_if_done(s)]
        if len(keep) < len(self._seqs):
            self._select_rows(keep)

    def _sampling_logprobs(self, logits_B_V: torch.Tensor, rows: list[_Seq]) -> torch.Tensor:
        temps = torch.tensor([s.request.params.temperature for s in rows], device=logits_B_V.device)
        greedy = temps == 0
        scaled = logits_B_V / torch.where(greedy, 1.0, temps)[:, None]
        top_p = [1.0 if g else s.request.params.top_p for s, g in zip(rows, greedy.tolist(), strict=True)]
        top_p = torch.tensor(top_p, device=logits_B_V.device)
        if bool((top_p < 1).any()):
            scaled = self._nucleus(scaled, top_p)
        return F.log_softmax(scaled, dim=-1)

    @staticmethod
    def _nucleus(scaled_B_V: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
        """Mask tokens outside each row's top-p nucleus (the most likely token always stays)."""
        probs, order = torch.softmax(scaled_B_V, dim=-1).sort(dim=-1, descending=True)
        outside = (probs.cumsum(-1) - probs) >= top_p_B[:, None]
        mask = torch.zeros_like(outside).scatter(-1, order, outside)
        return scaled_B_V.masked_fill(mask, -math.inf)

    def _sample_one(self, seq: _Seq, logprobs_V: torch.Tensor, cdf_V: torch.Tensor) -> None:
        if seq.request.params.temperature == 0:
            token = int(logprobs_V.argmax())
        else:
            # Inverse-CDF draw with the sequence's own generator (seeded requests replay exactly);
            # several times cheaper than torch.multinomial over a 49k vocabulary. Zero-probability
            # tokens are flat steps of the CDF, which searchsorted(right=True) never lands on.
            # The generator is a CPU one (seeds replay on any device): move its draw to the CDF's device.
            u = torch.rand(1, generator=seq.generator, dtype=cdf_V.dtype).to(cdf_V.device) * cdf_V[-1]
            token = int(torch.searchsorted(cdf_V, u, right=True))
            if token == cdf_V.shape[0]:  # u rounded up to the total: take the last likely token
                token = int((cdf_V < cdf_V[-1]).sum())
        seq.token_ids.append(token)
        seq.logprobs.append(float(logprobs_V[token]))
        if seq.request.top_logprobs:
            values, ids = logprobs_V.topk(seq.request.top_logprobs)
            seq.tops.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))

    def _finish_if_done(self, seq: _Seq) -> bool:
        if seq.future.done():
            return True  # the caller cancelled: free the slot
        params, token = seq.request.params, seq.token_ids[-1]
        reason, stop_reason = None, None
        if token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token in self.eos_token_ids and not seq.request.ignore_eos:
            reason = "stop"
        elif (len(seq.token_ids) >= params.max_tokens
              or len(seq.request.prompt_ids) + len(seq.token_ids) >= self.max_model_len):
            reason = "length"
        if reason is None:
            return False
        output = EngineOutput(seq.token_ids, seq.logprobs, seq.tops, reason, stop_reason, seq.version,
                              len(seq.request.prompt_ids))
        _resolve(seq.loop, seq.future, output)
        return True

    def _select_rows(self, keep: list[int]) -> None:
        if not keep:
            self._reset_batch()
            return
        index = torch.tensor(keep, device=self.device)
        mask = self._mask[index]
        start = int(mask.any(0).nonzero()[0])  # drop leading columns that are padding for every row
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        self._mask, self._next_pos = mask[:, start:], self._next_pos[index]
        self._seqs = [self._seqs[i] for i in keep]

    def _reset_batch(self) -> None:
        self._seqs, self._cache, self._mask, self._next_pos = [], None, None, None
