"""Generated hostile inputs for the tests that feed rollway data an attacker writes (a program's requests, a
rows file): a valid value with one to three of its fields, at any depth, replaced by a value of another type,
deleted, repeated, or given an extra key. Seeded, so a failure replays with its seed."""

from __future__ import annotations

import copy
import random
from typing import Any

VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**63, 2**70, 1.5, 1e308, float("nan"), float("inf"), "", "x", "auto", "none",
    "\ud800", "a" * 3000, [], {}, [None], [{}], [[]], [1, 2], {"a": {"b": []}}, "[]", "{}", "[1]", "null", "nan"]
"""Values of every JSON type, edge numbers, a lone surrogate, a long string, and JSON held in strings."""


def paths(value: Any, at: tuple = ()) -> list[tuple]:
    """Every key path into `value`'s dicts and lists."""
    out = [at] if at else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for name, inner in items:
        out += paths(inner, (*at, name))
    return out


def mutated(value: Any, rng: random.Random, values: list[Any] = VALUES, keys: list[str] = ("type",)) -> Any:
    """A copy of `value` with one to three fields replaced by one of `values`, deleted, repeated (in a list)
    or, in an object, given a key of `keys` set to one of `values`."""
    value = copy.deepcopy(value)
    for _ in range(rng.choice((1, 1, 2, 3))):
        found = paths(value)
        if not found:  # everything deleted already
            break
        path = rng.choice(found)
        parent = value
        for name in path[:-1]:
            parent = parent[name]
        last, roll = path[-1], rng.random()
        if roll < 0.6:
            parent[last] = copy.deepcopy(rng.choice(values))
        elif roll < 0.75:
            del parent[last]
        elif roll < 0.85 and isinstance(parent, list):
            parent.insert(last, copy.deepcopy(parent[last]))
        elif isinstance(parent[last], dict):
            parent[last][rng.choice(list(keys))] = copy.deepcopy(rng.choice(values))
    return value
