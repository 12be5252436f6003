"""opencode (the npm package opencode-ai 1.18, a self-contained binary we did not write) plays a toy task
as a harness episode in the local bubblewrap jail, through the gateway's chat completions, run by
`rollway up`. Its title agent is left on: the title call must be recorded as a side call and not trained.

Real broker, real jail, real gateway, the real program (installed by scripts/setup-agents.sh, bound
read-only into the jail; the test fails, never skips, without it); the scripted policy is the only fake:
it is the model, answering opencode's title call with a title, then its `bash` tool, then a plain answer."""

from __future__ import annotations

import json

import pytest
from agent_programs import assert_captured_tokens, opencode, opencode_harness
from test_qwen_code import run

pytestmark = pytest.mark.e2e
SOLVE = "awk '{print $1 + $2}' numbers.txt > answer.txt"
BASH = "<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": SOLVE, "description": "Sum"}}) + "</tool_call>"


def job(harness: dict, sandbox: dict) -> dict:
    return {
        "run": {"name": "opencode", "timeout_s": 560},
        "tasks": {"type": "toy", "count": 1},
        "sandbox": sandbox,
        "scheduler": {"group_size": 1, "max_inflight_episodes": 1, "episode_deadline_s": 500, "max_attempts": 1},
        "agent": {"concurrency": 1, "harness": harness},
        "policy": {"type": "scripted", "chat_format": "bytes-chatml",
                   "script": [{"when": "You are a title generator", "turns": ["Sum numbers"]},
                              {"when": "", "turns": [BASH, "Done."]}]},
    }


def test_opencode_fixes_a_toy_task_in_the_local_jail_and_its_title_call_is_not_trained(tmp_path):
    harness = {**opencode_harness(opencode(), title=True), "time_limit_s": 400, "silence_limit_s": 300}
    sandbox = {"type": "local", "memory_mb": 2048, "root": str(tmp_path / "boxes")}
    out, [t] = run(tmp_path, "up", SOLVE, job(harness, sandbox))
    assert t["resolved"] and t["reward"] == 1.0, t["grade"]
    assert t["stop_reason"] == "harness_exit" and t["num_turns"] == 2
    # The title call is recorded apart; the trained stream is the main conversation alone, one segment.
    assert [(c["name"], c["text"]) for c in t["side_calls"]] == [("opencode-title", "Sum numbers")], t["side_calls"]
    assert_captured_tokens(t, [BASH, "Done."], prompt_has=["opencode", "numbers.txt"])


def test_opencode_with_its_title_agent_disabled_fixes_a_toy_task_in_a_docker_container(tmp_path):
    from docker_engine import ensure_engine

    ensure_engine()
    harness = {**opencode_harness(opencode()), "time_limit_s": 400, "silence_limit_s": 300}
    sandbox = {"type": "docker", "image": "rollway-sandbox:bookworm", "gateway_root": str(tmp_path / "gateway")}
    out, [t] = run(tmp_path, "up", SOLVE, job(harness, sandbox))
    assert t["resolved"] and t["reward"] == 1.0, t["grade"]
    assert t["stop_reason"] == "harness_exit" and t["num_turns"] == 2
    assert t["side_calls"] == []  # `agent.title.disable`: no title call at all
    assert_captured_tokens(t, [BASH, "Done."], prompt_has=["opencode", "numbers.txt"])
