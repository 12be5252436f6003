"""opencode (the npm package opencode-ai 1.18, a self-contained binary we did not write) plays a toy task
as a harness episode in the local bubblewrap jail and in a docker container, and the Harbor example
`log-top-ips` in its own image, through the gateway's chat completions, run by `rollway up`. Where its
title agent is left on, the title call must be recorded as a side call and not trained.

Real broker, real jail and docker engine, real gateway, the Harbor task's own verifier, the real program
(installed by scripts/setup-agents.sh, bound read-only into the sandbox; a test fails, never skips,
without it or without the docker engine); the scripted policy is the only fake:
it is the model, answering opencode's title call with a title, then its `bash` tool, then a plain answer."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
from agent_programs import assert_captured_tokens, opencode, opencode_harness
from test_qwen_code import NOT_SOLVE, TASK, run
from test_qwen_code import SOLVE as HARBOR_SOLVE

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


def test_opencode_told_its_history_is_past_the_engines_context_compacts_and_fixes_the_task(tmp_path):
    """opencode believes its model holds a million tokens (so it never compacts on its own); the engine holds
    28,000 (the scripted model declares it as an engine does). The first command's output pushes the next
    call past it: the gateway refuses that call with `context_length_exceeded`, and opencode, reading that
    code, runs its compaction agent and goes on from the summary to fix the task. Before, the gateway answered
    a prompt the engine refused with a 500, which opencode retried five times and then gave up on.
    opencode 1.18 still exits 1 after such a recovery (the session saw an error), and a program that exits
    non-zero is the agent's failure (graded 0, never retried): what `limit.context` set to the engine's
    context avoids (docs/harness.md)."""
    summary = "Summary: sum the two columns of numbers.txt into answer.txt; seq was run, nothing else done."
    harness = {**opencode_harness(opencode(), context=1_000_000), "time_limit_s": 400, "silence_limit_s": 300}
    cfg = job(harness, {"type": "local", "memory_mb": 2048, "root": str(tmp_path / "boxes")})
    cfg["policy"] = {"type": "scripted", "chat_format": "bytes-chatml", "max_model_len": 28000,
                     "script": [{"when": "You are a context summarization agent", "turns": [summary]},
                                {"when": "seq was run", "turns": [BASH, "Done."]},
                                {"when": "", "turns": [bash("seq 1 6000")]}]}
    out, [t] = run(tmp_path, "up", SOLVE, cfg)
    texts = [turn["assistant_text"] for turn in t["turns"]]
    assert texts == [bash("seq 1 6000"), summary, BASH, "Done."], texts  # compacted, then went on to the fix
    assert t["reward"] == 0.0 and t["grade"]["failure_kind"] == "HarnessCrashed", t["grade"]
    assert "context length is 28000 tokens" in t["grade"]["failure"], t["grade"]  # what it was told, in its output
    # The refused call left no record; every recorded prompt fits the engine's context.
    [path] = (tmp_path / "run" / "gateway-calls").glob("*.jsonl")
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(calls) == 4 and all(c["prompt_start"] + len(c["prompt_ids"]) < 28000 for c in calls)


# --- a Harbor task (docker only: its verifier runs in the task's image) -----------------------------------

UNFIXED = "This copy is the unfixed one."
"""Appended to a second copy's instruction: the scripted model tells the two copies apart by it."""


def bash(command: str) -> str:
    return "<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": command, "description": "Run"}}) + "</tool_call>"


def assert_harbor_episode(t: dict, calls: dict, command: str) -> None:
    """Two main calls captured token-exact in one segment, the title call beside them, recorded and
    not trained, in the trajectory and in the run folder's copy of the episode's calls."""
    assert t["stop_reason"] == "harness_exit" and t["num_turns"] == 2, t["grade"]
    assert [(c["name"], c["text"]) for c in t["side_calls"]] == [("opencode-title", "Log report")], t["side_calls"]
    assert_captured_tokens(t, [bash(command), "Done."], prompt_has=["opencode", "top404.txt"])
    mine = calls[t["episode"]["episode_id"]]
    assert sorted((c["side_call"] or "", c["segment"]) for c in mine) == [("", 0), ("", 0), ("opencode-title", -1)]


def test_opencode_fixes_a_harbor_task_in_docker_with_rollway_up_and_scores_zero_where_it_does_not(tmp_path):
    """One `rollway up` of two copies of `log-top-ips` with 1,536 MB instead of the shipped 512 (in a full test run
    opencode was killed by the 512 MB limit at 507 MB resident, exit 137), title agent on,
    side by side: the scripted model fixes the first and runs a command that fixes nothing in the second.
    One test, not two sharing a fixture: pytest-xdist would give each its own worker and run it twice."""
    from docker_engine import count_containers, ensure_engine, remove_labelled

    ensure_engine()
    tasks = tmp_path / "tasks"
    for name in ("log-top-ips", "log-top-ips-unfixed"):
        shutil.copytree(TASK, tasks / name)
        toml = tasks / name / "task.toml"
        toml.write_text(toml.read_text().replace("memory_mb = 512", "memory_mb = 1536"))
    instruction = tasks / "log-top-ips-unfixed" / "instruction.md"
    instruction.write_text(instruction.read_text() + f"\n{UNFIXED}\n")
    run_id = f"oc{uuid.uuid4().hex[:8]}"
    harness = {**opencode_harness(opencode(), title=True), "time_limit_s": 400, "silence_limit_s": 300}
    cfg = {
        "run": {"name": "opencode-harbor", "id": run_id, "timeout_s": 560},
        "tasks": {"type": "harbor", "path": str(tasks)},
        "sandbox": {"type": "docker", "gateway_root": str(tmp_path / "gateway")},
        "scheduler": {"group_size": 1, "max_inflight_episodes": 2, "episode_deadline_s": 500, "max_attempts": 1},
        "agent": {"concurrency": 2, "harness": harness},
        "policy": {"type": "scripted", "chat_format": "bytes-chatml",
                   "script": [{"when": "You are a title generator", "turns": ["Log report"]},
                              {"when": UNFIXED, "turns": [bash(NOT_SOLVE), "Done."]},
                              {"when": "", "turns": [bash(HARBOR_SOLVE), "Done."]}]},
    }
    try:
        out, trajs = run(tmp_path, "up", HARBOR_SOLVE, cfg, episodes=2)
        left = count_containers(f"{run_id}-")
    finally:
        remove_labelled(f"{run_id}-")
    calls = {path.name.rsplit(".", 2)[0]: [json.loads(line) for line in path.read_text().splitlines()]
             for path in (tmp_path / "run" / "gateway-calls").glob("*.jsonl")}
    by_task = {t["episode"]["task_id"]: t for t in trajs}
    fixed, unfixed = by_task["log-top-ips"], by_task["log-top-ips-unfixed"]
    assert fixed["resolved"] and fixed["reward"] == 1.0, fixed["grade"]
    assert_harbor_episode(fixed, calls, HARBOR_SOLVE)
    assert not unfixed["resolved"] and unfixed["reward"] == 0.0, unfixed["grade"]
    assert_harbor_episode(unfixed, calls, NOT_SOLVE)
    # Every sandbox (the agents' containers, the verifiers') was removed by its episode, none by the run's reaper.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sandboxes_reaped"] == 0 and left == 0
