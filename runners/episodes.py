"""Recorded episodes (trajectories as plain dicts) from a run folder or from the trajectories topic."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from rollway.base.run_dir import RunDir, read_trajectories


class EpisodeNotFound(LookupError):
    """No episode with that id in the source; the message lists where we looked."""


def load_run_dir(run_dir: Path) -> list[dict[str, Any]]:
    """Trajectories the sink wrote into `run_dir/trajectories.jsonl`, in completion order."""
    path = RunDir(run_dir).trajectories
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass the folder of a finished `rollway up` run")
    trajs = read_trajectories(run_dir)
    return sorted(trajs, key=lambda t: t.get("created_at", 0.0))


def load_topic(bootstrap: str, topic_prefix: str = "", episode_id: str | None = None,
               timeout_s: float = 15.0) -> list[dict[str, Any]]:
    """Trajectories read back from the `trajectories` topic (one per episode id: the first copy)."""
    from rollway.runners.cmd_replay import read_topic

    records: list[dict[str, Any]] = []
    args = argparse.Namespace(topic="trajectories", bootstrap=bootstrap, episode=episode_id, from_offset=None,
                              partition=None, limit=None, topic_prefix=topic_prefix, timeout=timeout_s)
    code = asyncio.run(read_topic(args, records.append))
    if code != 0:
        raise FileNotFoundError(f"topic {topic_prefix}trajectories not found on {bootstrap}; check --topic-prefix")
    seen: dict[str, dict[str, Any]] = {}
    for rec in records:
        value = rec.get("value")
        if value and value["episode"]["episode_id"] not in seen:  # redelivered copies are identical
            seen[value["episode"]["episode_id"]] = value
    return sorted(seen.values(), key=lambda t: t.get("created_at", 0.0))


def find_episode(trajs: list[dict[str, Any]], episode_id: str, source: str) -> dict[str, Any]:
    for t in trajs:
        if t["episode"]["episode_id"] == episode_id:
            return t
    ids = ", ".join(t["episode"]["episode_id"] for t in trajs[:5])
    raise EpisodeNotFound(f"episode {episode_id!r} is not in {source} ({len(trajs)} episodes, e.g. {ids})")
