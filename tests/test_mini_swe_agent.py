"""mini-swe-agent (the PyPI package, a real program we did not write) plays a SWE-bench row in its
instance's docker container through the gateway, run by `rollway up` (a scripted fix: resolved) and
`rollway eval` (a scripted non-fix: not resolved, pass@1 0).

The row is the session's build from toolz 1.2.0's source archive (`rollway tasks build swe`, over a real
git mirror; conftest.py); the instance image comes from the row (cached on the engine). Real broker, real
docker sandbox, real gateway, the real program (installed by scripts/setup-agents.sh, bound read-only
into the container and started with the image's own python3); the scripted policy is the only fake: it
is the model, and it answers in mini-swe-agent's text format (a THOUGHT and one fenced
`mswea_bash_command` block), with mini-swe-agent's own SWE-bench prompt (swebench_backticks.yaml)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from agent_programs import assert_captured_tokens, mini_harness, mini_swe_agent
from conftest import ROOT
from jobs import run_with_progress

pytestmark = pytest.mark.e2e
ROLLWAY = [sys.executable, "-m", "rollway.runners"]
ACTION = "THOUGHT: {}\n\n```mswea_bash_command\n{}\n```"
SUBMIT = ACTION.format("The fix is in place.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")


@pytest.fixture(scope="module")
def row(toolz_swebench_row) -> tuple[dict, Path]:
    """One toolz SWE-bench row and its mirror folder (the session's build, conftest.py)."""
    from docker_engine import ensure_engine

    ensure_engine()
    return json.loads((toolz_swebench_row / "rows.jsonl").read_text().splitlines()[0]), toolz_swebench_row


def fix_action(patch: str) -> str:
    """What a model writes to apply `patch` in one command: a here-document, then `patch`."""
    assert "```" not in patch and "\nEOF\n" not in patch  # it would end the block or the document early
    return ACTION.format("Apply the fix.", f"cat > /tmp/fix.patch <<'EOF' && patch -p1 < /tmp/fix.patch\n{patch}EOF")


def job(folder: Path, script: list[dict], gateway: Path) -> dict:
    venv = mini_swe_agent()  # installed by scripts/setup-agents.sh (run here when missing: a failure, never a skip)
    harness = mini_harness(venv, own_python=True, configs=["benchmarks/swebench_backticks.yaml",
                                                           "environment.cwd=/workspace"])
    # The run's environment class is the sandbox itself (mini-swe-agent's own docker class is for the host).
    harness["command"] += ["--environment-class", "local"]
    # Limits a slow, loaded machine does not cross (start-up counts as silence; tests/test_harness.py
    # tests the limits themselves).
    harness.update(time_limit_s=420, silence_limit_s=420)
    return {
        "run": {"name": "mini-swebench", "timeout_s": 900},
        "tasks": {"type": "swebench", "path": str(folder / "rows.jsonl"), "mirror": str(folder / "mirror"),
                  "test_timeout_s": 300},
        "sandbox": {"type": "docker", "gateway_root": str(gateway)},
        "scheduler": {"group_size": 1, "max_inflight_episodes": 1, "episode_deadline_s": 840, "max_attempts": 1},
        # mini-swe-agent sends no max_tokens: the gateway's default per call must hold the whole patch
        # (bytes-chatml: a token per byte), or the reply ends with finish_reason=length.
        "agent": {"concurrency": 1, "max_tokens_per_turn": 4096, "harness": harness},
        "eval": {"attempts": 1, "ks": [1]},
        "policy": {"type": "scripted", "chat_format": "bytes-chatml", "script": script},
    }


def run(tmp_path: Path, folder: Path, verb: str, script: list[dict]) -> dict:
    # A gateway folder per command, beside the row (a short path for its sockets; the folder is shared).
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(folder, script, folder / f"gateway-{verb}")))
    run_dir = tmp_path / "run"
    out = run_with_progress([*ROLLWAY, verb, *(["--no-report"] if verb == "up" else []), str(tmp_path / "job.yaml"),
                          "--run-dir", str(run_dir)],
                         cwd=ROOT)
    failures = run_dir / "failures.jsonl"
    assert out.returncode == 0, out.stderr[-3000:]
    trajs_file = run_dir / "trajectories.jsonl"
    trajs = [json.loads(line) for line in trajs_file.read_text().splitlines()] if trajs_file.exists() else []
    assert len(trajs) == 1, failures.read_text()[-3000:] if failures.exists() else out.stderr[-3000:]
    return trajs[0]


def test_mini_swe_agent_fixes_a_swebench_row_in_docker_with_rollway_up(row, tmp_path):
    inst, folder = row
    fix = fix_action(inst["patch"])
    # mini-swe-agent's observations are user messages: the script keys on what the prompt holds.
    t = run(tmp_path, folder, "up", [{"when": "<returncode>0</returncode>", "turns": [SUBMIT]},
                                     {"when": "", "turns": [fix]}])
    assert t["resolved"] and t["reward"] == 1.0, t["grade"]
    assert t["stop_reason"] == "harness_exit" and t["num_turns"] == 2
    assert_captured_tokens(t, [fix, SUBMIT], prompt_has=["<pr_description>", f"Repository: {inst['repo']}"])


def test_mini_swe_agent_that_does_not_fix_scores_zero_in_rollway_eval(row, tmp_path):
    inst, folder = row
    t = run(tmp_path, folder, "eval", [{"when": "", "turns": [SUBMIT]}])
    assert not t["resolved"] and t["reward"] == 0.0 and t["stop_reason"] == "harness_exit"
    assert_captured_tokens(t, [SUBMIT], prompt_has=["<pr_description>", f"Repository: {inst['repo']}"])
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["completed"] == 1 and result["failed"] == 0 and result["pass@1"] == 0.0
    report = json.loads((tmp_path / "run" / "swebench_report.json").read_text())
    assert report["unresolved_ids"] == [inst["instance_id"]] and report["resolved_ids"] == []
