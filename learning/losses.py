"""Policy losses behind one seam (`Loss`, chosen by `learner.loss`: ppo, cispo, gspo or a plugin), the
PPO clipped loss (clip-higher, dual-clip, truncated IS), aggregation and token stats.

Scheme (decoupled PPO): three policies appear per token.
  mu       behaviour policy: the inference engine's logprob, recorded in the trajectory;
  pi_old   the learner's weights when the update started ("proximal" policy); on a single
           on-policy optimizer step pi_old is pi_theta itself, detached, so the ratio is 1 with
           gradient grad(log pi_theta);
  pi_theta the weights being optimised.
Per token, with r = pi_theta / pi_old and advantage A:
  l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)            (clip-higher: eps_high > eps_low)
  l = min(l, -c A)               when A < 0                       (dual-clip bounds the loss)
  l = w l,  w = min(pi_old / mu, C) (detached)                    (truncated importance sampling)
w corrects for the engine sampling from mu != pi_old (policy lag, numerics of another kernel);
truncating at C bounds the variance. Tokens without a behaviour logprob get w = 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from rollway.learning.config import LearnerConfig, LossAgg
from rollway.learning.registries import LOSSES

_MAX_LOG_RATIO = 20.0
"""exp() of a log-ratio beyond this overflows float32 gradients; clamping changes no clipped loss."""


def _predicting_logits(logits_B_T_V: torch.Tensor, mask_B_T: torch.Tensor | None,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits of the positions that predict the selected tokens (N x V), and the B x T-1
    selection. Selecting first keeps the float32 copy to the loss tokens (agent episodes are mostly
    observation tokens)."""
    B, T, _ = logits_B_T_V.shape
    sel_B_S = torch.ones(B, T - 1, dtype=torch.bool, device=logits_B_T_V.device) if mask_B_T is None \
        else mask_B_T[:, 1:]
    z_N_V = logits_B_T_V[:, :-1][sel_B_S].float()
    return (z_N_V / temperature if temperature != 1.0 else z_N_V), sel_B_S


def _scatter(values_N: torch.Tensor, sel_B_S: torch.Tensor) -> torch.Tensor:
    """Values at the selected predicted positions back to B x T (0 elsewhere and at position 0)."""
    out_B_S = torch.zeros(sel_B_S.shape, dtype=values_N.dtype, device=values_N.device)
    return torch.nn.functional.pad(out_B_S.masked_scatter(sel_B_S, values_N), (1, 0))


def token_logprobs(logits_B_T_V: torch.Tensor, token_ids_B_T: torch.Tensor, temperature: float = 1.0,
                   mask_B_T: torch.Tensor | None = None) -> torch.Tensor:
    """Logprob of every token under the model, aligned with `token_ids_B_T`.

    The logprob of token t comes from the logits at position t-1 (next-token prediction); position
    0 has no predictor and gets 0 (it is always prompt, loss mask 0), as do tokens outside
    `mask_B_T` when given. Float32 whatever the logits dtype."""
    z_N_V, sel_B_S = _predicting_logits(logits_B_T_V, mask_B_T, temperature)
    picked_N = z_N_V.gather(-1, token_ids_B_T[:, 1:][sel_B_S].unsqueeze(-1)).squeeze(-1)
    return _scatter(picked_N - torch.logsumexp(z_N_V, dim=-1), sel_B_S)


ENTROPY_CHUNK_TOKENS = 2048
"""Tokens per chunk when entropy is only measured (no gradient): a chunk's float32 temporaries are
chunk x vocabulary (2048 x 151,936 x 4 bytes = 1.2 GB for Qwen3), where the whole micro-batch's
would be several times the logits (found on an H100: 16k-token micro-batches of a Qwen3-0.6B shape
ran out of its 80 GB in the entropy metric)."""


def token_entropy(logits_B_T_V: torch.Tensor, temperature: float = 1.0,
                  mask_B_T: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the distribution that predicted each token, aligned like `token_logprobs`.

    With gradient (an entropy bonus) it is computed over the micro-batch at once; as a metric only
    (logits that need no gradient), chunk by chunk under no_grad, so its temporaries stay small."""
    if logits_B_T_V.requires_grad and torch.is_grad_enabled():
        z_N_V, sel_B_S = _predicting_logits(logits_B_T_V, mask_B_T, temperature)
        return _scatter(_entropy(z_N_V), sel_B_S)
    with torch.no_grad():
        B, T, _ = logits_B_T_V.shape
        sel_B_S = torch.ones(B, T - 1, dtype=torch.bool, device=logits_B_T_V.device) if mask_B_T is None \
            else mask_B_T[:, 1:]
        picked_N_V = logits_B_T_V[:, :-1][sel_B_S]  # model dtype: the float32 copy is made per chunk
        parts = [_entropy(chunk.float() / temperature if temperature != 1.0 else chunk.float())
                 for chunk in picked_N_V.split(ENTROPY_CHUNK_TOKENS)]
        values_N = torch.cat(parts) if parts else picked_N_V.new_zeros(0, dtype=torch.float32)
        return _scatter(values_N, sel_B_S)


def _entropy(z_N_V: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) z), per row."""
    return torch.logsumexp(z_N_V, dim=-1) - (torch.softmax(z_N_V, dim=-1) * z_N_V).sum(-1)


def sequence_loss_weights(token_counts: list[int], sample_weights: list[float], mode: LossAgg,
                          norm_tokens: int, *, episode_ids: list[str] | None = None) -> list[float]:
    """Per-token loss weight of each sequence of a mini-batch, so that sum(weight x token loss)
    over all micro-batches is the aggregated loss. In every mode the weight is constant inside a
    sequence, which lets gradient accumulation split the mini-batch anywhere.

    token-mean: 1 / (loss tokens of the mini-batch); seq-mean-token-mean: 1 / (L_i x sequences);
    token-sum-norm: 1 / (norm_tokens x sequences). Sequences count only with L_i > 0; the sample
    weight (staleness) multiplies the weight and does not change the normaliser.

    `episode_ids`: the episode of each sequence. The segments of one episode (a harness program that
    rewrote its history trains as one sequence per segment) then count as ONE sequence whose L_i is
    their loss tokens together, so splitting an episode into segments never changes its weight."""
    if episode_ids is not None:
        return _episode_loss_weights(token_counts, sample_weights, mode, norm_tokens, episode_ids)
    live = [n for n in token_counts if n > 0]
    if not live:
        return [0.0] * len(token_counts)
    weights = []
    for n, w in zip(token_counts, sample_weights, strict=True):
        if n == 0:
            weights.append(0.0)
        elif mode == "token-mean":
            weights.append(w / sum(live))
        elif mode == "seq-mean-token-mean":
            weights.append(w / (n * len(live)))
        elif mode == "token-sum-norm":
            weights.append(w / (norm_tokens * len(live)))
        else:
            raise ValueError(f"unknown loss aggregation {mode!r}")
    return weights


def _episode_loss_weights(token_counts: list[int], sample_weights: list[float], mode: LossAgg, norm_tokens: int,
                          episode_ids: list[str]) -> list[float]:
    episodes = list(dict.fromkeys(episode_ids))
    tokens = dict.fromkeys(episodes, 0)
    weight: dict[str, float] = {}
    for episode, n, w in zip(episode_ids, token_counts, sample_weights, strict=True):
        tokens[episode] += n
        weight[episode] = w  # (one staleness weight per episode: its segments share it)
    per_episode = sequence_loss_weights([tokens[e] for e in episodes], [weight[e] for e in episodes], mode,
                                        norm_tokens)
    by_episode = dict(zip(episodes, per_episode, strict=True))
    return [by_episode[e] if n > 0 else 0.0 for e, n in zip(episode_ids, token_counts, strict=True)]


@dataclass(frozen=True)
class ClipParams:
    """The knobs of `ppo_token_loss` (see the module docstring)."""

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float | None = 3.0
    tis_cap: float | None = 2.0


@dataclass
class TokenStats:
    """Masked sums, maxima and minima accumulated over micro-batches; `summary()` gives means."""

    sums: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0

    def add(self, name: str, values_B_T: torch.Tensor, mask_B_T: torch.Tensor, extremes: bool = False) -> None:
        vals = values_B_T.detach().float()[mask_B_T]
        self.sums[name] = self.sums.get(name, 0.0) + float(vals.sum())
        if extremes and vals.numel():
            self.maxs[name] = max(self.maxs.get(name, -float("inf")), float(vals.max()))
            self.mins[name] = min(self.mins.get(name, float("inf")), float(vals.min()))

    def summary(self) -> dict[str, float]:
        out = {f"{k}_mean": v / max(self.tokens, 1.0) for k, v in self.sums.items()}
        out.update({f"{k}_max": v for k, v in self.maxs.items()})
        out.update({f"{k}_min": v for k, v in self.mins.items()})
        return out


def ppo_token_loss(logprobs_B_T: torch.Tensor, old_logprobs_B_T: torch.Tensor, advantages_B: torch.Tensor,
                   behaviour_logprobs_B_T: torch.Tensor, behaviour_valid_B_T: torch.Tensor,
                   mask_B_T: torch.Tensor, params: ClipParams, stats: TokenStats | None = None) -> torch.Tensor:
    """Per-token PPO loss (unaggregated, zero outside `mask_B_T`); optionally records stats."""
    adv_B_T = per_token(advantages_B, logprobs_B_T)
    log_ratio_B_T = (logprobs_B_T - old_logprobs_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio_B_T = torch.exp(log_ratio_B_T)
    clipped_B_T = ratio_B_T.clamp(1.0 - params.eps_low, 1.0 + params.eps_high)
    loss_B_T = -torch.minimum(ratio_B_T * adv_B_T, clipped_B_T * adv_B_T)
    if params.dual_clip_c is not None:
        loss_B_T = torch.where(adv_B_T < 0, torch.minimum(loss_B_T, -params.dual_clip_c * adv_B_T), loss_B_T)
    tis_B_T = _tis_weights(old_logprobs_B_T, behaviour_logprobs_B_T, behaviour_valid_B_T, params.tis_cap)
    loss_B_T = torch.where(mask_B_T, loss_B_T * tis_B_T, torch.zeros_like(loss_B_T))
    if stats is not None:
        _record(stats, ratio_B_T, log_ratio_B_T, adv_B_T, old_logprobs_B_T, behaviour_logprobs_B_T,
                behaviour_valid_B_T & mask_B_T, tis_B_T, mask_B_T, params)
    return loss_B_T


def per_token(advantages_B: torch.Tensor, like_B_T: torch.Tensor) -> torch.Tensor:
    """The advantages as one value per token: given one per row (B), or already per token (B x T: a packed
    row holds several episodes, learning/packing.py). Every objective, a plugin's too, reads them so."""
    adv = advantages_B.to(like_B_T.dtype)
    return adv if adv.dim() == 2 else adv.unsqueeze(-1).expand_as(like_B_T)


def _tis_weights(old_B_T: torch.Tensor, behaviour_B_T: torch.Tensor, valid_B_T: torch.Tensor,
                 cap: float | None) -> torch.Tensor:
    """min(pi_old / mu, cap) where mu is known, else 1; never carries gradient."""
    if cap is None:
        return torch.ones_like(old_B_T)
    log_w_B_T = (old_B_T.detach() - behaviour_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    w_B_T = torch.exp(log_w_B_T).clamp(max=cap)
    return torch.where(valid_B_T, w_B_T, torch.ones_like(w_B_T))


def _record(stats: TokenStats, ratio_B_T: torch.Tensor, log_ratio_B_T: torch.Tensor, adv_B_T: torch.Tensor,
            old_B_T: torch.Tensor, behaviour_B_T: torch.Tensor, bvalid_B_T: torch.Tensor,
            tis_B_T: torch.Tensor, mask_B_T: torch.Tensor, params: ClipParams) -> None:
    """Clip fractions, ratio stats, approx KL (k3) to pi_old and mismatch to the behaviour policy."""
    with torch.no_grad():
        stats.tokens += float(mask_B_T.sum())
        stats.add("clip_frac_low", ((ratio_B_T < 1 - params.eps_low) & (adv_B_T < 0)).float(), mask_B_T)
        stats.add("clip_frac_high", ((ratio_B_T > 1 + params.eps_high) & (adv_B_T > 0)).float(), mask_B_T)
        if params.dual_clip_c is not None:
            stats.add("dual_clip_frac", ((ratio_B_T > params.dual_clip_c) & (adv_B_T < 0)).float(), mask_B_T)
        stats.add("ratio", ratio_B_T, mask_B_T, extremes=True)
        stats.add("approx_kl", (ratio_B_T - 1) - log_ratio_B_T, mask_B_T)
        stats.add("tis_weight", tis_B_T, mask_B_T, extremes=True)
        # KL(mu || pi_old) by k3 with samples from mu: how far the engine's numbers are from ours.
        log_w_B_T = (old_B_T - behaviour_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        stats.add("behaviour_kl", torch.where(bvalid_B_T, torch.exp(log_w_B_T) - 1 - log_w_B_T, 0.0), mask_B_T)


def k3_kl(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) on samples from pi_theta (>= 0, unbiased)."""
    log_r_B_T = (ref_logprobs_B_T - logprobs_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_r_B_T) - 1 - log_r_B_T


# -- the loss seam -------------------------------------------------------------------------------
class Loss(ABC):
    """A per-token policy objective, chosen by `learner.loss` through `build_loss(config)`. The trainer
    calls `token_loss` once per micro-batch and aggregates the result (`learner.loss_agg`, sample
    weights, KL and entropy terms stay in the trainer). A plugin (`python:MODULE:CLASS`) subclasses
    this and is constructed as `Class(learner_config)`."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def token_loss(self, logprobs_B_T: torch.Tensor, old_logprobs_B_T: torch.Tensor, advantages_B: torch.Tensor,
                   behaviour_logprobs_B_T: torch.Tensor, behaviour_valid_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                   stats: TokenStats | None = None) -> torch.Tensor:
        """Per-token loss, zero outside `mask_B_T`. `old_logprobs_B_T`: the proximal policy (detached);
        `behaviour_*`: the engine's logprobs and where they exist (for importance weights). `advantages_B`
        is one per row, or one per token in packed rows (`learner.pack_sequences`): read it through
        `per_token(advantages_B, logprobs_B_T)`."""

    @property
    def tis_cap(self) -> float | None:
        return self.cfg.tis_cap


class PPOClipLoss(Loss):
    """`ppo`: the clipped objective of the module docstring (clip-higher, dual-clip, truncated IS)."""

    def __init__(self, cfg: LearnerConfig) -> None:
        super().__init__(cfg)
        self.params = ClipParams(cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c, cfg.tis_cap)

    def token_loss(self, logprobs_B_T, old_logprobs_B_T, advantages_B, behaviour_logprobs_B_T, behaviour_valid_B_T,
                   mask_B_T, stats=None):
        return ppo_token_loss(logprobs_B_T, old_logprobs_B_T, advantages_B, behaviour_logprobs_B_T,
                              behaviour_valid_B_T, mask_B_T, self.params, stats)


class CISPOLoss(Loss):
    """`cispo` (MiniMax-M1, 2025): clip the importance-sampling weight instead of the update, so every
    token keeps its gradient: l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta, times the
    truncated IS weight w of the module docstring. Uses learner.clip_eps_low / clip_eps_high."""

    def token_loss(self, logprobs_B_T, old_logprobs_B_T, advantages_B, behaviour_logprobs_B_T, behaviour_valid_B_T,
                   mask_B_T, stats=None):
        adv_B_T = per_token(advantages_B, logprobs_B_T)
        log_ratio_B_T = (logprobs_B_T - old_logprobs_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio_B_T = torch.exp(log_ratio_B_T)
        weight_B_T = ratio_B_T.clamp(1.0 - self.cfg.clip_eps_low, 1.0 + self.cfg.clip_eps_high).detach()
        tis_B_T = _tis_weights(old_logprobs_B_T, behaviour_logprobs_B_T, behaviour_valid_B_T, self.tis_cap)
        loss_B_T = -weight_B_T * adv_B_T * logprobs_B_T * tis_B_T
        if stats is not None:
            _count(stats, ratio_B_T, log_ratio_B_T, mask_B_T)
            stats.add("is_clip_frac", (weight_B_T != ratio_B_T.detach()).float(), mask_B_T)
        return torch.where(mask_B_T, loss_B_T, torch.zeros_like(loss_B_T))


class GSPOLoss(Loss):
    """`gspo` (Qwen, 2025): one importance ratio per sequence, s = exp(mean over its tokens of
    log(pi_theta / pi_old)), clipped like PPO: l = -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A) on
    every token of the sequence (GSPO-token form: the value is s, the gradient flows through each
    token's own logprob). Its clip ranges are small (the paper: 3e-4, 4e-4): set learner.clip_eps_low
    and clip_eps_high; pair it with loss_agg seq-mean-token-mean."""

    def token_loss(self, logprobs_B_T, old_logprobs_B_T, advantages_B, behaviour_logprobs_B_T, behaviour_valid_B_T,
                   mask_B_T, stats=None):
        adv_B_T = per_token(advantages_B, logprobs_B_T)
        log_ratio_B_T = (logprobs_B_T - old_logprobs_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        m_B_T = mask_B_T.to(logprobs_B_T.dtype)
        seq_log_ratio_B = (log_ratio_B_T * m_B_T).sum(-1) / m_B_T.sum(-1).clamp(min=1.0)
        s_B_T = torch.exp(seq_log_ratio_B.detach().unsqueeze(-1) + logprobs_B_T - logprobs_B_T.detach())
        clipped_B_T = s_B_T.clamp(1.0 - self.cfg.clip_eps_low, 1.0 + self.cfg.clip_eps_high)
        loss_B_T = -torch.minimum(s_B_T * adv_B_T, clipped_B_T * adv_B_T)
        tis_B_T = _tis_weights(old_logprobs_B_T, behaviour_logprobs_B_T, behaviour_valid_B_T, self.tis_cap)
        if stats is not None:
            _count(stats, torch.exp(log_ratio_B_T), log_ratio_B_T, mask_B_T)
            stats.add("seq_ratio", s_B_T, mask_B_T, extremes=True)
        return torch.where(mask_B_T, loss_B_T * tis_B_T, torch.zeros_like(loss_B_T))


def _count(stats: TokenStats, ratio_B_T: torch.Tensor, log_ratio_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> None:
    with torch.no_grad():
        stats.tokens += float(mask_B_T.sum())
        stats.add("ratio", ratio_B_T, mask_B_T, extremes=True)
        stats.add("approx_kl", (ratio_B_T - 1) - log_ratio_B_T, mask_B_T)


def build_loss(cfg: LearnerConfig) -> Loss:
    """The objective `cfg.loss.type` names (learning/registries.py, LOSSES), constructed with the learner
    config (a plugin's own options are `cfg.loss`)."""
    return LOSSES.load(cfg.loss.type)(cfg)
