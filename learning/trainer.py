"""The built-in torch learner: trajectories in, PPO/GRPO updates, checkpoints and versions out."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from rollway.learning.advantages import build_advantage_estimator, group_advantages
from rollway.learning.batching import Sample, collate, plan_micro_batches, trajectory_samples
from rollway.learning.checkpoint import (
    OPTIMIZER_FILE,
    RecentIds,
    TrainerState,
    latest_checkpoint,
    load_state,
    save_checkpoint,
)
from rollway.learning.config import LearnerConfig
from rollway.learning.groups import GroupBuffer
from rollway.learning.losses import (
    TokenStats,
    build_loss,
    k3_kl,
    sequence_loss_weights,
    token_entropy,
    token_logprobs,
)
from rollway.learning.metrics import MetricsWriter, batch_metrics
from rollway.learning.modeling import ModelFactory, default_factory, pick_device, torch_dtype
from rollway.learning.staleness import lag_histogram, policy_lag, stale_weight
from rollway.schemas.messages import Trajectory
from rollway.schemas.tokens import check_token_arrays

log = structlog.get_logger()


@dataclass(frozen=True)
class StepResult:
    """One finished update. Publish `PolicyVersion(version, checkpoint=str(checkpoint_path), step,
    episodes_trained, metrics)` when `checkpoint_path` is not None."""

    version: int
    step: int
    checkpoint_path: Path | None
    """Loadable HF folder of this version; None when this update was not checkpointed."""
    episodes_trained: int
    """Total episodes consumed by updates so far (this run and before a resume)."""
    episode_ids: list[str]
    """Episodes this update consumed (trained, masked or dropped)."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Prepared:
    samples: list[Sample]
    episode_ids: list[str]
    metrics: dict[str, float]
    lags: list[int]


class Trainer:
    """Buffers trajectories into groups and runs one update per `groups_per_step` complete groups.

    Construction reads the newest checkpoint of `run_dir` (version, step, dedup window) but builds
    the model and optimizer only at the first update. An episode counts as consumed only once its
    update succeeded, and as durable only once a checkpoint holds it (`uncheckpointed_episode_ids`
    until then). An update that raises leaves the trainer unusable (`broken`): its groups have left
    the buffer, so the caller must restart from the checkpoint. Not thread-safe: call from one task.
    `model_factory(path_or_none) -> (model, tokenizer|None)` overrides the policy loader (tests)."""

    def __init__(self, cfg: LearnerConfig, run_dir: Path, *, group_size: int | None = None,
                 model_factory: ModelFactory | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: what the group timeout is measured on (a test's fake clock; monotonic otherwise)."""
        if not cfg.trains:
            raise ValueError("learner.type=record does not train; build a Trainer only for ppo/grpo")
        size = cfg.group_size or group_size
        if not size:
            raise ValueError("group size unknown: set learner.group_size or pass scheduler.group_size")
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.device = pick_device(cfg.device)
        self.dtype = torch_dtype(cfg.dtype)
        self._factory = model_factory or default_factory(cfg.model_path, self.device, self.dtype)
        self._buffer = GroupBuffer(size, cfg.group_timeout_s, clock)
        self._estimator = build_advantage_estimator(cfg)
        self._loss = build_loss(cfg)
        ckpt = latest_checkpoint(self.run_dir)
        self.state = load_state(ckpt) if ckpt else TrainerState()
        self.latest_checkpoint: Path | None = ckpt
        self.state.manifest = []  # entries of the loaded folder are already durable
        self._recent = RecentIds(cfg.dedup_window, self.state.recent_episode_ids)
        self._trained_groups = RecentIds(cfg.dedup_window, self.state.recent_group_ids)
        """Groups consumed already: a member arriving after its group was taken (at its timeout) is late."""
        self._clock = clock
        self._uncheckpointed: set[str] = set()
        self._training: set[str] = set()
        """Episodes of the update running now: out of the buffer, not yet consumed."""
        self._book = threading.Lock()
        """Guards the buffer and the id sets: the learner reads them (held offsets) from its event
        loop while an update runs in a worker thread."""
        self.broken: BaseException | None = None
        self.watermarks = None
        """Optional callable returning the committed positions recorded at each save (the learner's)."""
        self.duplicates = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._ref_model: Any = None
        self._writer: MetricsWriter | None = None

    # ---- public API -------------------------------------------------------------------------

    def add(self, traj: Trajectory) -> list[StepResult]:
        """Buffer one trajectory; run the updates its arrival makes possible (usually 0 or 1).
        An episode already trained (or buffered) is ignored and counted in `duplicates`."""
        check_token_arrays(traj)  # the contract TokenStream built (episode/stream.py)
        self._refuse_if_broken()
        with self._book:
            fresh = traj.episode_id not in self._recent
            late = fresh and traj.group_id in self._trained_groups
            fresh = fresh and not late and self._buffer.add(traj)
        if late:
            self._consume_late(traj.group_id, traj.episode_id, abandoned=False)
            return []
        if not fresh:
            self.duplicates += 1
            return []
        return self._run_ready() + self.tick()

    def abandon(self, group_id: str, episode_id: str) -> list[StepResult]:
        """The scheduler gave up on `episode_id`: its group completes without it (it is consumed,
        with no trajectory, in the update that takes the group)."""
        self._refuse_if_broken()
        with self._book:
            fresh = episode_id not in self._recent
            late = fresh and group_id in self._trained_groups
            fresh = fresh and not late and self._buffer.abandon(group_id, episode_id)
        if late:
            self._consume_late(group_id, episode_id, abandoned=True)
            return []
        if not fresh:
            return []
        return self._run_ready() + self.tick()

    def tick(self, now: float | None = None) -> list[StepResult]:
        """Train incomplete groups past `group_timeout_s` (call periodically, e.g. once a second).
        Groups of fewer than two episodes carry no signal and are consumed without training."""
        self._refuse_if_broken()
        with self._book:
            expired = self._take(self._buffer.pop_expired(now))
        return self._train_all(expired) if expired else []

    def flush(self) -> list[StepResult]:
        """Train every complete group buffered now, even fewer than `groups_per_step` (shutdown)."""
        with self._book:
            groups = self._take(self._buffer.pop_complete(self._buffer.complete_groups))
        return self._train_all(groups) if groups else []

    def pause(self, seconds: float) -> None:
        """The caller read nothing for `seconds` (it was loading weights into the engine, say): that time
        does not count towards a buffered group's timeout, as an update's own time does not."""
        with self._book:
            self._buffer.pause(seconds)

    def pending_episode_ids(self) -> set[str]:
        """Episodes buffered but not yet trained (lost on a crash: do not commit their offsets)."""
        with self._book:
            return self._buffer.pending_episode_ids() | self._training

    def knows(self, episode_id: str) -> bool:
        """True when `episode_id` is buffered or in the dedup window (a second copy is ignored)."""
        with self._book:
            return episode_id in self._recent or episode_id in self._training or \
                episode_id in self._buffer.pending_episode_ids()

    def uncheckpointed_episode_ids(self) -> set[str]:
        """Episodes consumed by updates that no checkpoint holds yet (a crash undoes their update)."""
        with self._book:
            return set(self._uncheckpointed)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _refuse_if_broken(self) -> None:
        """After a failed update the trainer's state is undefined: only a restart from the checkpoint goes on."""
        if self.broken is not None:
            raise RuntimeError("an earlier update failed; restart the learner from its checkpoint") from self.broken

    # ---- update -----------------------------------------------------------------------------

    def _run_ready(self) -> list[StepResult]:
        results = []
        while True:
            with self._book:
                groups = self._take(self._buffer.pop_complete(self.cfg.groups_per_step))
            if not groups:
                break
            results += self._train_all(groups)
        return results

    def _train_all(self, groups: list[list[Trajectory]]) -> list[StepResult]:
        start = self._clock()
        try:
            result = self._update(groups)
        except BaseException as err:
            self.broken = err
            raise
        finally:
            self.pause(self._clock() - start)  # nothing was read meanwhile
        return [result] if result is not None else []

    def _update(self, groups: list[list[Trajectory]]) -> StepResult | None:
        """One policy version from these groups; None when no episode had loss (no weight change).
        State changes only after the optimiser step succeeded."""
        with self._book:
            abandoned, self._buffer.released_abandoned = self._buffer.released_abandoned, []
        prepared = self._prepare([g for g in groups if g])
        metrics = {**prepared.metrics, **lag_histogram(prepared.lags)}
        updated = self._has_signal(prepared.samples)
        if updated:
            self._ensure_model()
            metrics.update(self._optimise(prepared.samples))
            self.state.version += 1
            self.state.step += 1
        else:
            log.info("update skipped: no episode of these groups has loss and signal", groups=len(groups))
        self._consumed(prepared.episode_ids, abandoned, updated, {g[0].group_id for g in groups if g})
        if not updated:
            return None
        ckpt = self._maybe_checkpoint()
        self._metrics_writer().write(self.state.step, metrics, {"staleness": prepared.lags})
        return StepResult(self.state.version, self.state.step, ckpt, self.state.episodes_trained,
                          prepared.episode_ids, metrics)

    def _has_signal(self, samples: list[Sample]) -> bool:
        """False when the update could only move weights through Adam momentum: no sample, or all
        advantages zero without a KL or entropy term."""
        if self.cfg.kl_coef > 0 or self.cfg.entropy_coef > 0:
            return bool(samples)
        return any(s.advantage != 0 for s in samples)

    def _prepare(self, groups: list[list[Trajectory]]) -> _Prepared:
        """Advantages per group, then masking and staleness per episode."""
        samples, ids, lags, rewards, resolved, advs = [], [], [], [], [], []
        masked = dropped = degenerate = 0
        for group in groups:
            ids += [t.episode_id for t in group]
            rewards += [t.reward for t in group]
            resolved += [t.resolved for t in group]
            ga = group_advantages(self._estimator, [t.reward for t in group], [t.stop_reason for t in group], self.cfg)
            degenerate += ga.degenerate
            if ga.degenerate and self.cfg.drop_degenerate_groups:
                continue
            for traj, adv, keep in zip(group, ga.advantages, ga.loss_mask, strict=True):
                lag = policy_lag(self.state.version, traj.turn_policy_versions)
                weight = stale_weight(lag, self.cfg)
                lags.append(lag)
                masked += not keep
                dropped += keep and weight == 0
                if keep and weight > 0 and any(traj.loss_mask):
                    samples += trajectory_samples(traj, adv, weight)  # one per segment (harness episodes)
                    advs.append(adv)
        metrics = batch_metrics(rewards, resolved, advs, masked, dropped, degenerate, len(groups))
        return _Prepared(samples, ids, metrics, lags)

    def _optimise(self, samples: list[Sample]) -> dict[str, float]:
        """ppo_epochs x mini_batches optimizer steps over `samples`; returns loss/optimizer metrics."""
        start = time.perf_counter()
        minibatches = episode_minibatches([s.episode_id for s in samples], self.cfg.mini_batches)
        n_mb = len(minibatches)
        single_step = n_mb == 1 and self.cfg.ppo_epochs == 1
        old = None if single_step else self._logprobs_no_grad(self.model, samples)
        ref = self._logprobs_no_grad(self._ref_model, samples) if self.cfg.kl_coef > 0 else None
        stats, totals = TokenStats(), {"loss": 0.0, "grad_norm": 0.0, "tokens": 0.0, "padded_tokens": 0.0}
        for _ in range(self.cfg.ppo_epochs):
            for rows in minibatches:
                self._optimizer_step([samples[i] for i in rows], _pick(old, rows), _pick(ref, rows), stats, totals)
        seconds = time.perf_counter() - start
        steps = self.cfg.ppo_epochs * n_mb
        return {**stats.summary(), "loss": totals["loss"] / steps, "grad_norm": totals["grad_norm"] / steps,
                "train_tokens": totals["tokens"], "pad_fraction": 1 - totals["tokens"] / max(totals["padded_tokens"], 1),
                "train_seconds": seconds, "tokens_per_second": totals["tokens"] / max(seconds, 1e-9),
                "optimizer_steps": float(steps)}

    def _optimizer_step(self, samples: list[Sample], old: list[torch.Tensor] | None,
                        ref: list[torch.Tensor] | None, stats: TokenStats, totals: dict[str, float]) -> None:
        """Accumulate gradients over token-budgeted micro-batches, clip, step."""
        assert self.optimizer is not None
        weights = sequence_loss_weights([s.loss_tokens for s in samples], [s.sample_weight for s in samples],
                                        self.cfg.effective_loss_agg, self.cfg.loss_norm_tokens,
                                        episode_ids=[s.episode_id for s in samples])
        self.optimizer.zero_grad(set_to_none=True)
        for rows in self._plan([len(s.token_ids) for s in samples]):
            mb = self._collate(samples, rows, weights)
            loss = self._micro_loss(mb, mb.place(old), mb.place(ref), stats)
            loss.backward()
            totals["loss"] += float(loss.detach())
            totals["tokens"] += mb.real_tokens
            totals["padded_tokens"] += mb.input_ids_B_T.numel()
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        totals["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(trainable, max_norm))
        self.optimizer.step()
        self.state.optimizer_steps += 1

    def _micro_loss(self, mb: Any, old_B_T: torch.Tensor | None, ref_B_T: torch.Tensor | None,
                    stats: TokenStats) -> torch.Tensor:
        """Aggregated loss of one micro-batch (its share of the mini-batch loss)."""
        with self._autocast():
            logits_B_T_V = self.model(**mb.model_inputs()).logits
        logprobs_B_T = token_logprobs(logits_B_T_V, mb.input_ids_B_T, self.cfg.temperature, mb.loss_mask_B_T)
        # on the single on-policy step the "old" policy is the current one, without gradient
        old_B_T = logprobs_B_T.detach() if old_B_T is None else old_B_T
        loss_B_T = self._loss.token_loss(logprobs_B_T, old_B_T, mb.advantages_B, mb.behaviour_B_T,
                                         mb.behaviour_valid_B_T, mb.loss_mask_B_T, stats)
        weights = mb.token_weights_B  # per row, or per token in a packed row
        w_B_T = (weights if weights.dim() == 2 else weights.unsqueeze(-1)) * mb.loss_mask_B_T
        entropy_B_T = token_entropy(logits_B_T_V if self.cfg.entropy_coef > 0 else logits_B_T_V.detach(),
                                    self.cfg.temperature, mb.loss_mask_B_T)
        stats.add("entropy", entropy_B_T, mb.loss_mask_B_T)
        loss = (loss_B_T * w_B_T).sum() - self.cfg.entropy_coef * (entropy_B_T * w_B_T).sum()
        if ref_B_T is not None:
            kl_B_T = k3_kl(logprobs_B_T, ref_B_T)
            stats.add("kl_ref", kl_B_T, mb.loss_mask_B_T)
            loss = loss + self.cfg.kl_coef * (kl_B_T * w_B_T).sum()
        return loss

    @torch.no_grad()
    def _logprobs_no_grad(self, model: Any, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample logprobs (CPU, unpadded) under `model`, for pi_old or the reference."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        for rows in self._plan([len(s.token_ids) for s in samples]):
            mb = self._collate(samples, rows, [0.0] * len(samples))
            with self._autocast():
                logits = model(**mb.model_inputs()).logits
            lp_B_T = token_logprobs(logits, mb.input_ids_B_T, self.cfg.temperature, mb.loss_mask_B_T).cpu()
            for i, values in mb.extract(lp_B_T).items():
                out[i] = values
        return out

    def _plan(self, lengths: list[int]) -> list[list[int]]:
        """Micro-batches (sample indices): packed rows of `micro_batch_tokens`, or right-padded rows
        within that token budget."""
        if self.cfg.pack_sequences:
            from rollway.learning.packing import pack_rows

            return pack_rows(lengths, self.cfg.micro_batch_tokens)
        return plan_micro_batches(lengths, self.cfg.micro_batch_tokens)

    def _collate(self, samples: list[Sample], rows: list[int], weights: list[float]) -> Any:
        if self.cfg.pack_sequences:
            from rollway.learning.packing import collate_packed

            return collate_packed(samples, rows, weights, self.device, self.cfg.micro_batch_tokens)
        return collate(samples, rows, weights, self.device)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.cfg.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # ---- model, checkpoints, metrics ----------------------------------------------------------

    def _ensure_model(self) -> None:
        """Build the model (from the newest checkpoint when resuming) and AdamW, once."""
        if self.model is not None:
            return
        torch.manual_seed(self.cfg.seed)
        ckpt = self.latest_checkpoint
        lora = self.cfg.lora.enabled  # LoRA checkpoints hold adapters only: the base is the initial model
        self.model, self.tokenizer = self._factory(str(ckpt) if ckpt and not lora else None)
        self.model.to(device=self.device, dtype=self.dtype)
        if lora:
            from rollway.learning.lora import attach_lora

            self.model = attach_lora(self.model, self.cfg.lora, ckpt)
        self._set_mode(self.model)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay,
                                           betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))
        if ckpt and (ckpt / OPTIMIZER_FILE).is_file():
            self.optimizer.load_state_dict(torch.load(ckpt / OPTIMIZER_FILE, map_location=self.device))
        if self.cfg.kl_coef > 0:  # (with LoRA the frozen base is the reference; a copy keeps this simple)
            self._ref_model = self._factory(None)[0].to(device=self.device, dtype=self.dtype).eval()
            self._ref_model.requires_grad_(False)

    def _set_mode(self, model: Any) -> None:
        # eval() turns dropout off so pi_old and pi_theta agree; HF checkpointing needs train().
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
            model.train()
        else:
            model.eval()

    def _take(self, groups: list[list[Trajectory]]) -> list[list[Trajectory]]:
        """Mark popped groups as in training (still pending for the held offsets). Under _book.
        Nothing popped changes nothing: the episodes of an update that failed stay held (a tick that
        found no expired group after a failed update emptied this set, and their offsets were committed)."""
        if groups or self._buffer.released_abandoned:
            self._training = {t.episode_id for g in groups for t in g} | set(self._buffer.released_abandoned)
        return groups

    def _consumed(self, episode_ids: list[str], abandoned: list[str], updated: bool, group_ids: set[str]) -> None:
        with self._book:
            self.state.episodes_trained += len(episode_ids)
            for e in (*episode_ids, *abandoned):
                self._recent.add(e)
            for g in sorted(group_ids):
                self._trained_groups.add(g)
            self._uncheckpointed.update(episode_ids, abandoned)
            self._training = set()
        self.state.manifest.append({"step": self.state.step, "version": self.state.version,
                                    "episode_ids": list(episode_ids), "abandoned_ids": list(abandoned),
                                    "updated": updated})

    def _consume_late(self, group_id: str, episode_id: str, abandoned: bool) -> None:
        """A member of a group an update already took: consumed without training (its group's advantages
        are computed; on its own it would be a group of one task's late episodes against themselves)."""
        log.info("late member of a trained group consumed without training", group=group_id, episode=episode_id)
        with self._book:
            self.state.episodes_trained += not abandoned
            self._recent.add(episode_id)
            self._uncheckpointed.add(episode_id)
        self.state.manifest.append({"step": self.state.step, "version": self.state.version, "late": True,
                                    "episode_ids": [] if abandoned else [episode_id],
                                    "abandoned_ids": [episode_id] if abandoned else [], "updated": False})

    def _maybe_checkpoint(self) -> Path | None:
        if self.state.step % self.cfg.checkpoint_every:
            return None
        return self.save()

    def save(self) -> Path:
        """Write a checkpoint of the current version now (also called every `checkpoint_every`):
        weights, optimizer, the dedup window, the manifest of what was consumed since the last one and
        the committed positions `watermarks()` reports ("topic:partition" -> offset; set by the learner)."""
        self._ensure_model()
        opt = self.optimizer if self.cfg.save_optimizer else None
        self.state.recent_episode_ids = self._recent.to_list()
        self.state.recent_group_ids = self._trained_groups.to_list()
        if self.watermarks is not None:
            self.state.watermarks = self.watermarks()
        with self._book:
            saved_ids = set(self._uncheckpointed)
        self.latest_checkpoint = save_checkpoint(self.run_dir, self.state, self.model, self.tokenizer, opt,
                                                 self.cfg.keep_checkpoints, write_weights=self._weights_writer())
        with self._book:
            self.state.manifest = []
            self._uncheckpointed -= saved_ids
        return self.latest_checkpoint

    def _weights_writer(self) -> Callable[[Path], None] | None:
        """Who writes the weights into a checkpoint folder: None, `save_checkpoint` itself (one process);
        a sharded learner has every rank write its part."""
        return None

    def _metrics_writer(self) -> MetricsWriter:
        if self._writer is None:
            self._writer = MetricsWriter(self.run_dir, self.cfg.tensorboard)
        return self._writer


def episode_minibatches(episode_ids: list[str], mini_batches: int) -> list[list[int]]:
    """Sample indices per mini-batch, dealt round-robin by episode: the segments of one episode stay in
    one mini-batch, so its weight is normalised once (`sequence_loss_weights`). One sample per episode
    gives the plain round-robin over samples."""
    episodes = list(dict.fromkeys(episode_ids))
    n = min(mini_batches, len(episodes))
    slot = {e: k % n for k, e in enumerate(episodes)}
    return [[i for i, e in enumerate(episode_ids) if slot[e] == j] for j in range(n)]


def _pick(values: list[torch.Tensor] | None, rows: list[int]) -> list[torch.Tensor] | None:
    return None if values is None else [values[i] for i in rows]
