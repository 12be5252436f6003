"""Build the configured task set."""

from __future__ import annotations

from rollway.envs.base import TaskSet
from rollway.envs.config import TasksConfig


def build_taskset(cfg: TasksConfig) -> TaskSet:
    if cfg.type == "toy":
        from rollway.envs.toy import ToyTaskSet

        return ToyTaskSet(cfg)
    raise NotImplementedError(f"tasks.type={cfg.type!r} is not built yet")
