"""Per-update learner metrics: batch statistics, and the JSONL + TensorBoard writer."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollway.base.run_dir import RunDir


def distribution(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """mean/std/min/max of `values` as `<prefix>_<stat>` (population std; empty -> zeros)."""
    if not values:
        return {f"{prefix}_{k}": 0.0 for k in ("mean", "std", "min", "max")}
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return {f"{prefix}_mean": mean, f"{prefix}_std": math.sqrt(var),
            f"{prefix}_min": float(min(values)), f"{prefix}_max": float(max(values))}


def batch_metrics(rewards: Sequence[float], resolved: Sequence[bool], advantages: Sequence[float],
                  masked: int, dropped_stale: int, degenerate_groups: int, groups: int) -> dict[str, float]:
    """What the batch looked like before the loss: reward, pass rate, advantages, masking counts."""
    out = {"reward_mean": sum(rewards) / max(len(rewards), 1),
           "pass_rate": sum(bool(r) for r in resolved) / max(len(resolved), 1),
           "episodes": float(len(rewards)), "groups": float(groups),
           "episodes_masked": float(masked), "episodes_dropped_stale": float(dropped_stale),
           "degenerate_group_frac": degenerate_groups / max(groups, 1)}
    out.update(distribution("advantage", advantages))
    return out


class MetricsWriter:
    """Appends one JSON line per update to run_dir/metrics.jsonl and mirrors scalars (and
    histograms) to TensorBoard in run_dir/tb when enabled."""

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = RunDir(run_dir).metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard))

    def write(self, step: int, metrics: dict[str, float], histograms: dict[str, Sequence[float]] | None = None) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is None:
            return
        for name, value in metrics.items():
            self._tb.add_scalar(f"learner/{name}", value, step)
        for name, values in (histograms or {}).items():
            if values:
                import numpy as np

                self._tb.add_histogram(f"learner/{name}", np.asarray(values, dtype=np.float64), step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
