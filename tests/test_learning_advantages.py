"""Advantage estimators and masking rules against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rollway.learning.advantages import (
    DrGRPOAdvantage,
    GRPOAdvantage,
    RLOOAdvantage,
    build_advantage_estimator,
    group_advantages,
    is_masked_stop,
)
from rollway.learning.config import LearnerConfig


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


ALL = torch.ones(4, dtype=torch.bool)


def test_grpo_divides_by_sample_std() -> None:
    # mean 0.5; deviations +-0.5; sample std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    adv = GRPOAdvantage(eps=0.0).compute(_t([1, 0, 0, 1]), ALL)
    expected = 0.5 / math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected])


def test_rloo_leaves_one_out() -> None:
    # episode 0: 1 - mean(0,0,0) = 1; others: 0 - mean(1,0,0) = -1/3
    adv = RLOOAdvantage().compute(_t([1, 0, 0, 0]), ALL)
    assert adv.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_drgrpo_is_mean_centred_only() -> None:
    adv = DrGRPOAdvantage().compute(_t([1, 0, 0, 0]), ALL)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_non_member_compared_with_member_mean() -> None:
    members = torch.tensor([True, True, False])
    # members (rewards 2 and 1) are each other's baseline; the non-member (0) vs mean(2, 1)
    adv = RLOOAdvantage().compute(_t([2, 1, 0]), members)
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.5])


def test_degenerate_group_gets_exact_zeros() -> None:
    cfg = LearnerConfig(type="ppo")
    ga = group_advantages(build_advantage_estimator(cfg), [0.1, 0.1, 0.1], ["finish"] * 3, cfg)
    assert ga.degenerate and ga.advantages == [0.0, 0.0, 0.0]


def test_stop_reason_patterns() -> None:
    pats = LearnerConfig().masked_stop_reasons
    assert is_masked_stop("length", pats) and is_masked_stop("error:sandbox timeout", pats)
    assert not is_masked_stop("finish", pats) and not is_masked_stop("max_turns", pats)


def test_masked_episodes_counted_in_baseline() -> None:
    cfg = LearnerConfig(type="ppo", advantage="drgrpo")
    stops = ["finish", "length", "error:crash", "finish"]
    ga = group_advantages(build_advantage_estimator(cfg), [1, 0, 0, 0], stops, cfg)
    assert ga.loss_mask == [True, False, False, True]
    assert ga.advantages == pytest.approx([0.75, -0.25, -0.25, -0.25])  # baseline 1/4


def test_masked_episodes_left_out_of_baseline() -> None:
    cfg = LearnerConfig(type="ppo", advantage="drgrpo", masked_in_baseline=False)
    stops = ["finish", "length", "error:crash", "finish"]
    ga = group_advantages(build_advantage_estimator(cfg), [1, 0, 0, 0], stops, cfg)
    assert ga.advantages == pytest.approx([0.5, -0.5, -0.5, -0.5])  # baseline mean(1, 0)
