"""Benchmark figures over samples that may be empty: a mean, ratio or percentile with no sample to stand on
is `None`, and the figures say why (`no_sample`: figure -> reason) instead of printing NaN, infinity or a
made-up 0. Every `rollway bench ...` result goes out through `dumps`, which refuses NaN and infinity and
names the figure, so a new figure that divides by an empty sample fails loudly where it is written."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

NO_SAMPLE = "no_sample"
"""Key, in a figures dict, of {figure: why it is null} for the figures that had nothing to stand on."""


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def mean(values: Iterable[float]) -> float | None:
    """Mean of the finite values; None when there are none."""
    kept = [v for v in values if finite(v)]
    return sum(kept) / len(kept) if kept else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or not finite, or the denominator is 0."""
    if not finite(numerator) or not finite(denominator) or denominator == 0:
        return None
    return numerator / denominator


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of the finite values; None when there are none."""
    ordered = sorted(v for v in values if finite(v))
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def scaled(factor: float, value: float | None) -> float | None:
    """factor x value, None stays None (seconds -> milliseconds of an optional figure)."""
    return None if value is None else factor * value


def put(figures: dict[str, Any], key: str, value: float | None, reason: str) -> None:
    """figures[key] = value; when it is None (or not finite), null and `reason` under figures["no_sample"]."""
    if finite(value):
        figures[key] = value
    else:
        figures[key] = None
        figures.setdefault(NO_SAMPLE, {})[key] = reason


def fmt(value: Any, spec: str = ".2f", missing: str = "n/a") -> str:
    """A figure for a text report: formatted with `spec`, or `missing` when it is None."""
    return missing if value is None else format(value, spec)


class NonFiniteFigure(ValueError):
    """A benchmark result holds NaN or infinity: a figure divided by an empty sample or by zero."""


def non_finite_paths(value: Any, path: str = "result") -> list[str]:
    """Where in `value` (nested dicts, lists) a float is NaN or infinite, as `result.mode.key` paths."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [f"{path} = {value}"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite_paths(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in non_finite_paths(v, f"{path}[{i}]")]
    return []


def dumps(result: Any, **kwargs: Any) -> str:
    """json.dumps of a benchmark result that refuses NaN and infinity (which json.dumps would write as the
    non-JSON tokens NaN/Infinity), naming each offending figure."""
    bad = non_finite_paths(result)
    if bad:
        raise NonFiniteFigure(f"benchmark figures that are not numbers: {', '.join(bad[:10])}; a figure over an "
                              "empty sample must be None with its reason (rollway.base.figures.put)")
    return json.dumps(result, allow_nan=False, **kwargs)
