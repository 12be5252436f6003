"""Policy-lag rules: how far behind the trainer an episode's policy was, and what that costs it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rollway.learning.config import LearnerConfig

LAG_BUCKETS = (0, 1, 2, 3, 4, 8, 16)
"""Lower edges of the staleness histogram buckets; the last one is open-ended."""


def policy_lag(trainer_version: int, turn_policy_versions: Sequence[int]) -> int:
    """Versions between the trainer and the oldest policy that produced any turn (0 without turns).

    The oldest turn rules because every later token was conditioned on that turn's output."""
    if not turn_policy_versions:
        return 0
    return max(0, trainer_version - min(turn_policy_versions))


def stale_weight(lag: int, cfg: LearnerConfig) -> float:
    """Loss weight of an episode with this lag: 1 within `max_policy_lag`, else 0 (`drop`) or
    `stale_weight` (`downweight`)."""
    if cfg.max_policy_lag is None or lag <= cfg.max_policy_lag:
        return 1.0
    return 0.0 if cfg.stale_policy == "drop" else cfg.stale_weight


def _bucket(lag: int) -> str:
    edges = [e for e in LAG_BUCKETS if e <= lag]
    lo = edges[-1]
    idx = LAG_BUCKETS.index(lo)
    if idx == len(LAG_BUCKETS) - 1:
        return f"{lo}+"
    hi = LAG_BUCKETS[idx + 1] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"


def lag_histogram(lags: Sequence[int]) -> dict[str, float]:
    """Share of episodes per lag bucket, as flat metrics `staleness/lag_<bucket>`, plus the max."""
    counts = Counter(_bucket(lag) for lag in lags)
    total = max(len(lags), 1)
    out = {f"staleness/lag_{b}": n / total for b, n in counts.items()}
    out["staleness/lag_max"] = float(max(lags, default=0))
    return out
