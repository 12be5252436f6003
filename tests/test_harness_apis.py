"""Harness episodes on the Responses and Messages APIs and programs the gateway cannot serve, end to end
with `rollway up`: real broker, real bubblewrap jail, real gateway; the scripted policy is the only fake
(it is the model)."""

from __future__ import annotations

import json

import pytest
from test_harness import NON_FIX, up

pytestmark = pytest.mark.e2e

# A program that asks for an endpoint the gateway does not serve, then gives up as a real client does.
EMBEDDINGS = r"""
import json, os, sys, urllib.error, urllib.request
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/embeddings", method="POST",
    data=json.dumps({"model": "m", "input": "hi"}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
try:
    urllib.request.urlopen(request)
except urllib.error.HTTPError as err:
    print(err.code, err.read().decode()); sys.exit(1)
"""


def test_a_program_asking_for_an_unsupported_endpoint_is_graded_0_and_reported_once(tmp_path):
    """A command the model has the program run can ask for an unsupported endpoint as well as the program can:
    that used to fail the attempt for good, never graded (a way out of a 0). Each episode is graded 0 with the
    endpoint named, once in the log, counted by kind in the summary, and not re-run."""
    out, summary, trajs = up(tmp_path, NON_FIX, {"command": ["python3", "-c", EMBEDDINGS]})
    assert len(trajs) == 2 and summary["episodes_failed"] == 0, out.stderr[-3000:]
    assert sorted(t["episode"]["attempt"] for t in trajs) == [0, 0]
    for t in trajs:
        assert (t["reward"], t["stop_reason"], t["grade"]["failure_kind"]) == (0.0, "agent_failure", "HarnessUnsupported")
        assert "POST /v1/embeddings is not served" in t["grade"]["failure"]
    assert summary["graded_failures"] == {"agent: HarnessUnsupported": 2}
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("agent-*.out"))
    assert logs.count("a program asked for what the gateway does not serve") == 1, logs[-3000:]
    assert "2 episode(s) graded 0 for a failure after the agent ran (agent: HarnessUnsupported)" in out.stderr


def test_an_episode_past_its_segment_bound_is_graded_and_trained_up_to_it(tmp_path):
    from test_harness import AGENT_PROGRAM, FIX

    out, summary, trajs = up(tmp_path, FIX, {**AGENT_PROGRAM, "max_segments": 1})
    assert out.returncode == 0 and len(trajs) == 2, out.stderr[-3000:]
    for t in trajs:
        # agent_program.py compacts after two calls: that third call would open a second segment.
        assert t["stop_reason"] == "harness_segment_limit" and t["num_turns"] == 2 and t["segment_starts"] == []
        assert "grade" in t and sum(t["loss_mask"]) == sum(e - s for s, e in t["turn_spans"]) > 0
    # Each episode's calls are in the run folder too, as the log acknowledged them.
    files = sorted((tmp_path / "run" / "gateway-calls").glob("*.jsonl"))
    assert len(files) == 2
    for path in files:
        calls = [json.loads(line) for line in path.read_text().splitlines()]
        assert [c["call_index"] for c in calls] == [0, 1] and all(c["output_ids"] for c in calls)


def test_a_program_on_the_anthropic_sdk_fixes_toy_tasks_through_the_messages_api(tmp_path):
    from test_harness import AGENT_PROGRAM, ROOT, SHELL_CALL

    program = {**AGENT_PROGRAM, "command": ["python3", f"{ROOT}/examples/anthropic_agent_program.py", "{instruction}"]}
    script = [{"when": "", "turns": [SHELL_CALL.format("awk '{print $1 + $2}' numbers.txt > answer.txt"), "Done."]}]
    out, summary, trajs = up(tmp_path, script, program)
    assert out.returncode == 0 and len(trajs) == 2, out.stderr[-3000:]
    for t in trajs:
        assert t["resolved"] and t["reward"] == 1.0 and t["stop_reason"] == "harness_exit", t["grade"]
        assert t["num_turns"] == 2 and t["segment_starts"] == []  # the tool result extends the conversation
    calls = [json.loads(line) for path in sorted((tmp_path / "run" / "gateway-calls").glob("*.jsonl"))
             for line in path.read_text().splitlines()]
    assert {c["api"] for c in calls} == {"messages"} and len(calls) == 4
