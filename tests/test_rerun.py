"""`rollway replay --rerun`: recorded model outputs re-run against a fresh sandbox of the same task."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e
FILE_TASKSET = "python:examples/extending/custom_taskset.py:FileTaskSet"


def rollway(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollway.runners", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def replay(capsys, monkeypatch):
    """`rollway replay ARGS` in this process, from the repository root (plugin paths are relative)."""
    from rollway.runners.cli import main

    monkeypatch.chdir(ROOT)

    def run(*args: str) -> SimpleNamespace:
        code = main(["replay", *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def first_episode(run_dir) -> str:
    return json.loads((run_dir / "trajectories.jsonl").read_text().splitlines()[0])["episode"]["episode_id"]


def test_rerun_of_a_recorded_episode_matches(smoke_run, replay):
    ep = first_episode(smoke_run.run_dir)
    out = replay("--rerun", ep, "--run-dir", str(smoke_run.run_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "re-ran 4 turns" in out.stdout and "every observation matches" in out.stdout


def test_rerun_reads_the_episode_from_the_topic(smoke_run, replay):
    ep = first_episode(smoke_run.run_dir)
    # The episode from the broker; the config (and its topic prefix) from the run folder.
    out = replay("--rerun", ep, "--bootstrap", smoke_run.bootstrap, "--run-dir", str(smoke_run.run_dir),
                  "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["identical"] and result["episode_id"] == ep and result["replayed_reward"] == 1.0


def test_rerun_reports_the_turns_that_see_a_changed_repository(broker, replay, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    task = {"task_id": "sum-1", "prompt": "Write the sum of numbers.txt to answer.txt, then call finish.",
            "files": {"numbers.txt": "3 4\n"}, "answer": "7"}
    tasks.write_text(json.dumps(task) + "\n")
    run_dir = tmp_path / "run"
    out = rollway("up", "--no-report", "examples/smoke.yaml", "--bootstrap", broker.bootstrap, "runtime.processes=one", "--run-dir", str(run_dir),
                  "tasks=" + json.dumps({"type": FILE_TASKSET, "path": str(tasks)}), "scheduler.group_size=1",
                  f"topics.prefix=rerun{tmp_path.name[-6:]}-")
    assert out.returncode == 0, out.stderr[-3000:]
    ep = first_episode(run_dir)
    assert replay("--rerun", ep, "--run-dir", str(run_dir)).returncode == 0

    # Same task id, different repository: `cat numbers.txt` (turn 1) and the sum (turn 2) change;
    # `ls -la` (turn 0) does not (same file size) and `finish` (turn 3) does not.
    tasks.write_text(json.dumps({**task, "files": {"numbers.txt": "5 4\n"}}) + "\n")
    out = replay("--rerun", ep, "--run-dir", str(run_dir), "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["differing_turns"] == [1, 2]
    first = result["differences"][0]
    assert first["tool"] == "bash" and first["arguments"] == {"command": "cat numbers.txt"}
    assert "-3 4" in first["diff"] and "+5 4" in first["diff"]
    assert result["recorded_reward"] == 1.0 and result["replayed_reward"] == 0.0
    text = replay("--rerun", ep, "--run-dir", str(run_dir))
    assert text.returncode == 1 and "2 turn(s) differ: 1, 2" in text.stdout and "+5 4" in text.stdout


TALLY = "python:tests/tally_plugin.py:TallyTaskSet"
TALLY_SCRIPT = [{"when": "", "turns": [
    "I will add twice.",
    '<tool_call>{"name": "tally.add", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "tally.add", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "finish", "arguments": {"message": "done"}}</tool_call>']}]


def test_a_stateful_plugin_episode_replays_to_the_reward_it_earned(broker, replay, tmp_path):
    """tests/tally_plugin.py through `rollway up` on the real broker: per-task tools, a tally in the
    episode's state store, a chat-only turn, graded from the state and the finish call's arguments.
    Re-run, each episode plays the same way and earns the same reward (re-run once ignored per-task
    tools, dropped the state between turns and graded with an empty episode: reward 0)."""
    run_dir = tmp_path / "run"
    out = rollway("up", "--no-report", "examples/smoke.yaml", "--bootstrap", broker.bootstrap, "runtime.processes=one",
                  "--run-dir", str(run_dir), "tasks=" + json.dumps({"type": TALLY}),
                  "policy.script=" + json.dumps(TALLY_SCRIPT), "scheduler.group_size=1",
                  f"topics.prefix=tally{tmp_path.name[-6:]}-")
    assert out.returncode == 0, out.stderr[-3000:]
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(t["episode"]["task_id"] for t in trajs) == ["tally-3", "tally-5"]
    assert [t["reward"] for t in trajs] == [1.0, 1.0] and all(t["turns"][0]["observations"] == [] for t in trajs)
    for traj in trajs:
        out = replay("--rerun", traj["episode"]["episode_id"], "--run-dir", str(run_dir), "--json")
        result = json.loads(out.stdout)
        assert (out.returncode, result["differences"], result["replayed_reward"]) == (0, [], 1.0), out.stderr


def test_comparison_ignores_file_times_but_not_content():
    from rollway.audit.rerun import compare_turn, normalizer
    from rollway.schemas import Observation

    turn = {"turn": 0, "observations": [
        {"tool": "bash", "arguments": {}, "content": "-rw-r--r-- 1 nobody nogroup 5 Nov 22 00:25 a"}]}
    same = [Observation(content="-rw-r--r-- 1 nobody nogroup 5 Nov 23 13:05 a", tool="bash")]
    assert compare_turn(turn, same, normalizer(False, [])) == []
    assert len(compare_turn(turn, same, normalizer(True, []))) == 1
    other = [Observation(content="-rw-r--r-- 1 nobody nogroup 6 Nov 22 00:25 a", tool="bash")]
    assert compare_turn(turn, other, normalizer(False, []))[0].turn == 0
    assert compare_turn(turn, [], normalizer(False, []))[0].replayed == "<no observation>"


def test_replay_without_a_topic_or_rerun_says_what_to_give(replay):
    assert replay().returncode == 2 and "TOPIC --bootstrap" in replay().stderr
    assert "--run-dir" in replay("--rerun", "x").stderr
