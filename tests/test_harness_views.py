"""Harness episodes as people read them: `rollway show`, the HTML report, replay and the ATIF export
display a real harness run call by call, with its segments (which call opened one and why). The run is
`rollway up` with examples/agent_program.py (it compacts its history after two calls, opening a second
segment) in the local jail on the session broker; the scripted policy is the only fake (it is the model)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from types import SimpleNamespace

import pytest
from conftest import ROOT
from jobs import run_with_progress
from test_harness import AGENT_PROGRAM, FIX, ROLLWAY, harness_job

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def harness_run(broker, tmp_path_factory):
    """One real harness run (two toy tasks, three program calls each, the third after a rewrite)."""
    tmp = tmp_path_factory.mktemp("harness-views")
    harness_job(tmp, FIX, AGENT_PROGRAM)
    prefix = f"hv{uuid.uuid4().hex[:6]}-"
    run_dir = tmp / "run"
    out = run_with_progress([*ROLLWAY, "up", "--no-report", str(tmp / "job.yaml"), "--run-dir", str(run_dir), "--bootstrap",
                          broker.bootstrap, "runtime.processes=one", f"topics.prefix={prefix}"], cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 and all(len(t["segment_starts"]) == 1 for t in trajs)
    return SimpleNamespace(run_dir=run_dir, prefix=prefix, bootstrap=broker.bootstrap, trajs=trajs, tmp=tmp)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_with_progress([*ROLLWAY, *args], cwd=ROOT,
                          env={**os.environ, "COLUMNS": "160"})


def test_harness_turns_record_each_call_and_what_the_program_sent_back(harness_run):
    for t in harness_run.trajs:
        turns = t["turns"]
        assert [turn["call_index"] for turn in turns] == [0, 1, 2]
        # call 0's reply asked for `cat numbers.txt`; the program's next call carried its output
        [obs] = turns[0]["observations"]
        assert obs["tool"] == "shell" and obs["arguments"] == {"command": "cat numbers.txt"} and obs["content"].strip()
        assert obs["call_id"]
        # call 1's result went into the rewritten history: the call that opened segment 1 carries it
        assert turns[1]["observations"] == [] and turns[2]["segment_reason"] == "history_rewritten"
        opened = turns[2]["segment_messages"]
        assert opened[0]["role"] == "system" and "Summary:" in opened[1]["content"]
        assert [m["role"] for m in opened[2:]] == ["assistant", "tool"]
        assert turns[0]["segment_messages"] is None and turns[1]["segment_messages"] is None


def test_show_displays_a_harness_episode_call_by_call_with_its_segments(harness_run):
    t = harness_run.trajs[0]
    eid = t["episode"]["episode_id"]
    out = _cli("show", str(harness_run.run_dir), "--episode", eid)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "segments" in text and "segment 1 at call 2: history_rewritten" in text
    assert "call 0 · segment 0" in text and "call 1 · segment 0" in text and "call 2 · segment 1" in text
    assert "new segment 1: the program rewrote its history" in text
    # call 2's panel (its title in the border) opens with why its segment started, then its output
    assert text.index("call 1 · segment 0") < text.index("call 2 · segment 1") < text.index("new segment 1") \
        < text.index("The sum is in answer.txt.")
    assert "Summary:" in text and "tool call: shell" in text and "cat numbers.txt" in text
    assert "The sum is in answer.txt." in text
    listing = _cli("show", str(harness_run.run_dir))
    assert listing.returncode == 0 and "3 (2 segments)" in listing.stdout


def test_the_report_lists_the_calls_and_the_call_that_opened_a_segment(harness_run):
    from rollway.reports.report import write_report

    html = write_report(harness_run.run_dir).read_text()
    assert "<section id='calls'>" in html and "Agent-program calls" in html
    for t in harness_run.trajs:
        eid = t["episode"]["episode_id"]
        assert f"<tr><td>{eid}</td><td>2</td><td>1</td><td>history_rewritten</td>" in html
        assert f"<tr><td>{eid}</td><td>0</td><td>0</td><td></td><td>tool_calls</td>" in html


def test_atif_export_has_one_step_per_call_with_its_segment(harness_run):
    from rollway.reports.eval_outputs import to_atif

    t = harness_run.trajs[0]
    doc = to_atif(t, "scripted")
    agent = [s for s in doc["steps"] if s["source"] == "agent"]
    assert [s["extra"]["call_index"] for s in agent] == [0, 1, 2]
    assert [s["extra"]["segment"] for s in agent] == [0, 0, 1]
    assert "segment_reason" not in agent[0]["extra"] and agent[2]["extra"]["segment_reason"] == "history_rewritten"
    assert "Summary:" in agent[2]["extra"]["segment_messages"][1]["content"]
    assert agent[0]["tool_calls"][0]["function_name"] == "shell"
    assert agent[0]["observation"]["results"][0]["source_call_id"] == agent[0]["tool_calls"][0]["tool_call_id"]
    assert [s["metrics"]["completion_token_ids"] for s in agent] == [turn["completion_ids"] for turn in t["turns"]]
    assert doc["extra"]["segments"] == 2


def test_replay_reads_the_calls_and_refuses_to_rerun_a_program_through_rollways_tools(harness_run):
    eid = harness_run.trajs[0]["episode"]["episode_id"]
    out = _cli("replay", "gateway-calls", "--bootstrap", harness_run.bootstrap, "--topic-prefix", harness_run.prefix,
               "--episode", eid)
    assert out.returncode == 0, out.stderr
    calls = [json.loads(line)["value"] for line in out.stdout.splitlines()]
    assert sorted((c["call_index"], c["segment"], c["segment_reason"]) for c in calls) == \
        [(0, 0, "start"), (1, 0, None), (2, 1, "history_rewritten")]
    out = _cli("replay", "trajectories", "--bootstrap", harness_run.bootstrap, "--topic-prefix", harness_run.prefix,
               "--episode", eid)
    [traj] = [json.loads(line)["value"] for line in out.stdout.splitlines()]
    assert [turn["call_index"] for turn in traj["turns"]] == [0, 1, 2] and traj["segment_starts"]
    out = _cli("replay", "--rerun", eid, "--run-dir", str(harness_run.run_dir))
    assert out.returncode == 2 and "played by an agent program" in out.stderr and "rollway show" in out.stderr
