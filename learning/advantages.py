"""Group-relative advantage estimators (GRPO, RLOO, Dr.GRPO) and the episode masking rules."""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollway.learning.config import LearnerConfig


class AdvantageEstimator(ABC):
    """Turns the rewards of one group into one advantage per episode. Built by
    `build_advantage_estimator(cfg)` as `from_config(learner_config)`; the trainer calls `compute` once
    per complete group."""

    @classmethod
    def from_config(cls, cfg: LearnerConfig) -> AdvantageEstimator:
        """The estimator for this learner config; default `Class(cfg)` (how plugins are built)."""
        return cls(cfg)

    @abstractmethod
    def compute(self, rewards_G: torch.Tensor, in_baseline_G: torch.Tensor) -> torch.Tensor:
        """Advantages for every episode of the group (float64, shape G). Only episodes with
        `in_baseline_G` True enter the baseline; the others still get an advantage (r - baseline)."""


def _baseline_stats(rewards_G: torch.Tensor, in_baseline_G: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean of the baseline members (0 when there are none) and their count."""
    members = rewards_G[in_baseline_G]
    n = int(members.numel())
    return (members.mean() if n else rewards_G.new_zeros(())), n


class GRPOAdvantage(AdvantageEstimator):
    """(r - mean) / (std + eps) over the baseline members (std with Bessel's correction, as in
    torch.std; a group with a single member has std 0)."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    @classmethod
    def from_config(cls, cfg: LearnerConfig) -> GRPOAdvantage:
        return cls(cfg.adv_eps)

    def compute(self, rewards_G: torch.Tensor, in_baseline_G: torch.Tensor) -> torch.Tensor:
        mean, n = _baseline_stats(rewards_G, in_baseline_G)
        std = rewards_G[in_baseline_G].std() if n > 1 else rewards_G.new_zeros(())
        return (rewards_G - mean) / (std + self.eps)


class DrGRPOAdvantage(AdvantageEstimator):
    """r - mean: Dr.GRPO drops the std division, which up-weights near-degenerate groups."""

    @classmethod
    def from_config(cls, cfg: LearnerConfig) -> DrGRPOAdvantage:
        return cls()

    def compute(self, rewards_G: torch.Tensor, in_baseline_G: torch.Tensor) -> torch.Tensor:
        mean, _ = _baseline_stats(rewards_G, in_baseline_G)
        return rewards_G - mean


class RLOOAdvantage(AdvantageEstimator):
    """r_i minus the mean reward of the *other* baseline members (leave-one-out). A non-member is
    compared with the mean of all members. With fewer than two members the advantage is 0."""

    @classmethod
    def from_config(cls, cfg: LearnerConfig) -> RLOOAdvantage:
        return cls()

    def compute(self, rewards_G: torch.Tensor, in_baseline_G: torch.Tensor) -> torch.Tensor:
        mean, n = _baseline_stats(rewards_G, in_baseline_G)
        if n < 2:
            return torch.zeros_like(rewards_G)
        total = rewards_G[in_baseline_G].sum()
        loo_mean_G = (total - rewards_G) / (n - 1)
        return torch.where(in_baseline_G, rewards_G - loo_mean_G, rewards_G - mean)


def build_advantage_estimator(cfg: LearnerConfig) -> AdvantageEstimator:
    """The estimator named by `cfg.advantage.type` (a plugin is constructed with the learner config; its
    own options are `cfg.advantage`)."""
    from rollway.learning.registries import ADVANTAGES

    return ADVANTAGES.load(cfg.advantage.type).from_config(cfg)


def is_masked_stop(stop_reason: str, patterns: Sequence[str]) -> bool:
    """True when `stop_reason` matches one of the fnmatch `patterns` (truncated/failed episode)."""
    return any(fnmatch.fnmatchcase(stop_reason, p) for p in patterns)


@dataclass(frozen=True)
class GroupAdvantages:
    """Result for one group, in the order the rewards were given."""

    advantages: list[float]
    loss_mask: list[bool]
    """False for episodes that get no loss (truncated/failed)."""
    degenerate: bool
    """All rewards of the group were equal: every advantage is exactly 0."""


def group_advantages(estimator: AdvantageEstimator, rewards: Sequence[float], stop_reasons: Sequence[str],
                     cfg: LearnerConfig) -> GroupAdvantages:
    """Advantages of one group with the masking rules of `cfg` applied.

    Masked episodes (stop reason in `cfg.masked_stop_reasons`) never get loss; whether their
    reward enters the baseline is `cfg.masked_in_baseline`. A degenerate group gets exact zeros
    (the estimators would give zeros up to float error, and a tiny non-zero would still push)."""
    keep = [not is_masked_stop(s, cfg.masked_stop_reasons) for s in stop_reasons]
    rewards_G = torch.tensor(list(rewards), dtype=torch.float64)
    keep_G = torch.tensor(keep, dtype=torch.bool)
    in_baseline_G = torch.ones_like(keep_G) if cfg.masked_in_baseline else keep_G
    degenerate = bool((rewards_G == rewards_G[0]).all()) if len(rewards) else True
    if degenerate:
        return GroupAdvantages([0.0] * len(rewards), keep, True)
    adv_G = estimator.compute(rewards_G, in_baseline_G)
    return GroupAdvantages(adv_G.tolist(), keep, False)
