"""`rollway show`: episodes turn by turn from a run folder and from the trajectories topic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e


def show(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollway.runners", "show", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"COLUMNS": "140", "PATH": "/usr/bin:/bin"})


def episodes(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]


def test_show_lists_episodes_and_renders_the_first_turn_by_turn(smoke_run):
    out = show(str(smoke_run.run_dir))
    assert out.returncode == 0, out.stderr
    trajs = episodes(smoke_run.run_dir)
    assert "8 episodes" in out.stdout
    assert all(t["episode_id"] in out.stdout for t in trajs)
    for text in ("model output", "tool call: bash", '{"command": "cat numbers.txt"}', "observation",
                 "Exit code: 0", "turn 3", "stop reason", "finish", "reward", "agent_gen"):
        assert text in out.stdout, text


def test_show_one_episode_as_html(smoke_run, tmp_path):
    t = episodes(smoke_run.run_dir)[3]
    out = show(str(smoke_run.run_dir), "--episode", t["episode_id"], "--html", str(tmp_path / "ep.html"))
    assert out.returncode == 0, out.stderr
    html = (tmp_path / "ep.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and t["episode_id"] in html
    answer = str(t["grade"]["expected"])
    assert "numbers.txt" in html and answer in html and "8 episodes" not in html


def test_show_reads_episodes_from_the_topic(smoke_run):
    t = episodes(smoke_run.run_dir)[-1]
    out = show("--bootstrap", smoke_run.bootstrap, "--topic-prefix", smoke_run.prefix, "--episode", t["episode_id"])
    assert out.returncode == 0, out.stderr
    assert t["episode_id"] in out.stdout and "tool call: finish" in out.stdout
    out = show("--bootstrap", smoke_run.bootstrap, "--topic-prefix", smoke_run.prefix)
    assert out.returncode == 0 and "8 episodes" in out.stdout


def test_show_names_a_missing_episode(smoke_run, capsys):
    from rollway.runners.cli import main

    assert main(["show", str(smoke_run.run_dir), "--episode", "nope"]) == 2
    assert "episode 'nope' is not in" in capsys.readouterr().err
