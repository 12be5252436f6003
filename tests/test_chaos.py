"""Nothing lost: a seeded chaos run kills workers of every kind; every episode ends exactly once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from rollway.runners.chaos import count_outcomes

pytestmark = pytest.mark.e2e


def test_chaos_run_loses_and_duplicates_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rollway.runners", "chaos", "examples/smoke.yaml", "--seed", "3", "--json",
         "--run-dir", str(tmp_path / "run"), "--min-gap", "0.8", "--max-gap", "2.0"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert result["scheduled"] == 8 and result["completed"] + result["failed"] == 8
    assert result["lost"] == 0 and result["duplicated"] == 0
    killed_kinds = {e["kill"].split("-")[0] for e in result["events"] if "kill" in e}
    assert result["kills"] >= 4 and len(killed_kinds) >= 3, result["events"]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_outcome_counting_detects_lost_and_duplicated_episodes(tmp_path):
    _write(tmp_path / "trajectories.jsonl", [{"episode_id": "a"}, {"episode_id": "b"}])
    _write(tmp_path / "learner-records.jsonl", [{"episode_id": "a"}, {"episode_id": "b"}, {"episode_id": "a"}])
    (tmp_path / "scheduler.json").write_text(json.dumps(
        {"episodes_scheduled": 4, "failed": [{"episode_id": "c"}]}))
    got = count_outcomes(tmp_path)
    assert got["lost"] == 1 and got["duplicated"] == 1 and got["completed"] == 2 and got["failed"] == 1
