"""Trajectories to and from Parquet, one row per episode, for analysis and for other trainers.

Columns (see learning/EXPORT.md for how verl- and SkyRL-train-style trainers read them):

  episode_id, group_id, task_id   string   identity; group_id is the GRPO group (same task, n samples)
  sample_index, attempt           int32    position inside the group; re-issue attempt number
  prompt_ids                      list<int32>   the initial prompt (token_ids[:prompt_length])
  response_ids                    list<int32>   everything after the prompt: every completion and
                                                every tool observation, in order (token-exact)
  response_loss_mask              list<int8>    1 on tokens the model produced, 0 on observations
  response_logprobs               list<float32> behaviour logprob on model tokens, null elsewhere
  reward                          float64  scalar episode reward (for token-level rewards put it on
                                           the last response token)
  resolved                        bool     the task's tests passed
  stop_reason                     string   finish, max_turns, max_tokens, length, error:...
  num_turns                       int32
  turn_policy_versions            list<int32>   policy version that generated each turn
  response_turn_spans             list<list<int32>>  [start, end) of each turn's completion,
                                                relative to the start of response_ids
  min_policy_version, max_policy_version  int32  (-1 for an episode without turns)
  created_at                      float64  unix seconds the reward actor graded the episode
  response_segment_starts         list<int32>   harness episodes whose program rewrote its history:
                                                where each later token stream starts, relative to
                                                response_ids; train each stream as its own sequence
                                                (empty: one stream)

Invariant: response_ids, response_loss_mask and response_logprobs have equal length.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollway.schemas.messages import EpisodeKey, Trajectory

SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("group_id", pa.string()), ("task_id", pa.string()),
    ("sample_index", pa.int32()), ("attempt", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
    ("response_loss_mask", pa.list_(pa.int8())), ("response_logprobs", pa.list_(pa.float32())),
    ("reward", pa.float64()), ("resolved", pa.bool_()), ("stop_reason", pa.string()),
    ("num_turns", pa.int32()), ("turn_policy_versions", pa.list_(pa.int32())),
    ("response_turn_spans", pa.list_(pa.list_(pa.int32()))),
    ("min_policy_version", pa.int32()), ("max_policy_version", pa.int32()),
    ("created_at", pa.float64()), ("response_segment_starts", pa.list_(pa.int32())),
])


def trajectory_row(traj: Trajectory) -> dict[str, Any]:
    """One Parquet row (a dict keyed by the SCHEMA column names)."""
    p = traj.prompt_length
    versions = list(traj.turn_policy_versions)
    return {
        "episode_id": traj.episode_id, "group_id": traj.group_id, "task_id": traj.task_id,
        "sample_index": traj.sample_index, "attempt": traj.attempt,
        "prompt_ids": traj.token_ids[:p], "response_ids": traj.token_ids[p:],
        "response_loss_mask": traj.loss_mask[p:], "response_logprobs": traj.logprobs[p:],
        "reward": traj.reward, "resolved": traj.resolved, "stop_reason": traj.stop_reason,
        "num_turns": traj.num_turns, "turn_policy_versions": versions,
        "response_turn_spans": [[s - p, e - p] for s, e in traj.turn_spans],
        "min_policy_version": min(versions, default=-1), "max_policy_version": max(versions, default=-1),
        "created_at": traj.created_at, "response_segment_starts": [s - p for s in traj.segment_starts],
    }


def trajectories_to_table(trajs: Iterable[Trajectory]) -> pa.Table:
    return pa.Table.from_pylist([trajectory_row(t) for t in trajs], schema=SCHEMA)


def write_trajectories(path: str | Path, trajs: Iterable[Trajectory]) -> int:
    """Write `trajs` to one Parquet file (replacing it); returns the number of rows."""
    table = trajectories_to_table(trajs)
    pq.write_table(table, str(path), compression="zstd")
    return table.num_rows


class ParquetTrajectoryWriter:
    """Appends batches of trajectories as row groups of one Parquet file (for a sink); the file is
    readable once `close()` wrote the footer."""

    def __init__(self, path: str | Path) -> None:
        self._writer = pq.ParquetWriter(str(path), SCHEMA, compression="zstd")

    def write(self, trajs: Iterable[Trajectory]) -> None:
        table = trajectories_to_table(trajs)
        if table.num_rows:
            self._writer.write_table(table)

    def close(self) -> None:
        self._writer.close()


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a trajectory Parquet file as dicts (columns as documented above)."""
    return pq.read_table(str(path), schema=SCHEMA).to_pylist()


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Rebuild `Trajectory` messages (token-exact; turn records and messages are not
    exported and come back empty)."""
    return [_row_to_trajectory(r) for r in read_rows(path)]


def _row_to_trajectory(row: dict[str, Any]) -> Trajectory:
    p = len(row["prompt_ids"])
    return Trajectory(
        episode=EpisodeKey(episode_id=row["episode_id"], group_id=row["group_id"], task_id=row["task_id"],
                           sample_index=row["sample_index"], attempt=row["attempt"]),
        token_ids=row["prompt_ids"] + row["response_ids"],
        loss_mask=[0] * p + row["response_loss_mask"],
        logprobs=[None] * p + row["response_logprobs"],
        turn_policy_versions=row["turn_policy_versions"],
        turn_spans=[(s + p, e + p) for s, e in row["response_turn_spans"]],
        reward=row["reward"], resolved=row["resolved"], stop_reason=row["stop_reason"],
        num_turns=row["num_turns"], prompt_length=p, created_at=row["created_at"],
        segment_starts=[s + p for s in row.get("response_segment_starts") or []],
    )
