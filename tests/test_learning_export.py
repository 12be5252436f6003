"""Parquet export: round trip, column meaning, appending writer."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollway.learning.export import ParquetTrajectoryWriter, read_rows, read_trajectories, write_trajectories
from rollway.learning.testing import make_trajectory


def _trajs():
    two_turn = make_trajectory("e0", "g", [1, 2, 3], [10, 11], 1.0, observation=[50, 51, 52], second=[12, 13],
                               versions=[4, 5], behaviour_logprob=-0.123456)
    cut = make_trajectory("e1", "g", [1, 2, 3], [20], 0.0, stop_reason="length", versions=[5], sample_index=1)
    return [two_turn, cut]


def test_round_trip_is_token_exact(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    trajs = _trajs()
    assert write_trajectories(path, trajs) == 2
    back = read_trajectories(path)
    for a, b in zip(trajs, back, strict=True):
        assert (b.token_ids, b.loss_mask, b.turn_spans) == (a.token_ids, a.loss_mask, [tuple(s) for s in a.turn_spans])
        assert (b.episode_id, b.group_id, b.reward, b.stop_reason, b.turn_policy_versions) == (
            a.episode_id, a.group_id, a.reward, a.stop_reason, a.turn_policy_versions)
        assert [x is None for x in b.logprobs] == [x is None for x in a.logprobs]
        assert [x for x in b.logprobs if x is not None] == pytest.approx([x for x in a.logprobs if x is not None])


def test_columns_split_prompt_and_response(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    write_trajectories(path, _trajs())
    row = read_rows(path)[0]
    assert row["prompt_ids"] == [1, 2, 3]
    assert row["response_ids"] == [10, 11, 50, 51, 52, 12, 13]
    assert row["response_loss_mask"] == [1, 1, 0, 0, 0, 1, 1]
    assert row["response_logprobs"][2] is None
    assert row["response_turn_spans"] == [[0, 2], [5, 7]]
    assert (row["num_turns"], row["min_policy_version"], row["max_policy_version"]) == (2, 4, 5)


def test_appending_writer(tmp_path: Path) -> None:
    path = tmp_path / "sink.parquet"
    writer = ParquetTrajectoryWriter(path)
    writer.write(_trajs()[:1])
    writer.write(_trajs()[1:])
    writer.close()
    assert pq.ParquetFile(path).metadata.num_row_groups == 2
    assert [r["episode_id"] for r in read_rows(path)] == ["e0", "e1"]


def test_a_multi_segment_trajectory_keeps_its_segment_starts(tmp_path: Path) -> None:
    """Another trainer must split a harness episode where its program rewrote its history, as rollway's
    learner does: the segment starts travel with the rows (relative to response_ids) and come back."""
    from segmented import make_segmented_trajectory

    from rollway.schemas.tokens import segment_bounds

    traj = make_segmented_trajectory("s", "g", [[[1, 2, 3], [10, 11], [5], [12]], [[1, 7], [13, 14]]], 1.0)
    path = tmp_path / "t.parquet"
    write_trajectories(path, [traj])
    [row] = read_rows(path)
    assert row["response_segment_starts"] == [s - traj.prompt_length for s in traj.segment_starts] == [4]
    [back] = read_trajectories(path)
    assert back.segment_starts == traj.segment_starts and segment_bounds(back) == segment_bounds(traj)
