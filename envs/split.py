"""Deterministic train/test split and limit of a task list, by task id hash (see TasksConfig)."""

from __future__ import annotations

import hashlib

from rollway.envs.base import Task
from rollway.envs.config import TasksConfig


def in_test_split(task_id: str, test_fraction: float) -> bool:
    """Stable across processes and machines: the split depends on the id alone, not on list order."""
    bucket = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") / 2**64
    return bucket < test_fraction


def select_tasks(tasks: list[Task], cfg: TasksConfig) -> list[Task]:
    """The configured split, in the given order, cut to `cfg.limit`."""
    if cfg.split != "all":
        want_test = cfg.split == "test"
        tasks = [t for t in tasks if in_test_split(t.task_id, cfg.test_fraction) == want_test]
    return tasks[: cfg.limit] if cfg.limit else tasks
