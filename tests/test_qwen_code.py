"""Qwen Code (the npm package @qwen-code/qwen-code, a real Node program we did not write) plays a Harbor
task in a docker container, and a toy task in the local bubblewrap jail, through the gateway, run by
`rollway up` and `rollway eval`.

Real broker, real docker sandbox and real jail, real gateway, the real program (installed by
scripts/setup-agents.sh, bound read-only into the sandbox); the scripted policy is the only fake: it is the model, and it
answers in Qwen Code's own format (an OpenAI tool call of its `run_shell_command` tool, decoded by the
gateway from the sampled text, then a plain answer that ends the program's turn)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from agent_programs import assert_captured_tokens, qwen_code, qwen_harness
from conftest import ROOT
from jobs import run_with_progress

pytestmark = pytest.mark.e2e
ROLLWAY = [sys.executable, "-m", "rollway.runners"]
TASK = ROOT / "examples" / "harbor" / "log-top-ips"
SOLVE = ("awk '$9 == 404 {print $1}' access.log | sort | uniq -c | awk '{print $1, $2}' "
         "| sort -k1,1nr -k2,2 | head -3 > top404.txt")
NOT_SOLVE = "wc -l access.log"


def shell_call(command: str) -> str:
    """What the model samples for one call of Qwen Code's shell tool (the gateway's tool-call format)."""
    return "<tool_call>" + json.dumps({"name": "run_shell_command", "arguments": {"command": command}}) + "</tool_call>"


def script(command: str) -> list[dict]:
    # Turn 0 (no assistant message yet): the tool call; turn 1 (after the tool's output): the answer.
    return [{"when": "", "turns": [shell_call(command), "Done."]}]


def harbor_task(tmp_path):
    """The example task with room for node: its 512 MB container limit kills Qwen Code (its resident
    size is about 700 MB), so the copy asks for 2 GB."""
    task = tmp_path / "log-top-ips"
    shutil.copytree(TASK, task)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("memory_mb = 512", "memory_mb = 2048"))
    return task


def job(tmp_path, command: str) -> dict:
    from docker_engine import ensure_engine

    ensure_engine()
    harness = {**qwen_harness(qwen_code()), "time_limit_s": 400, "silence_limit_s": 300}
    return {
        "run": {"name": "qwen", "timeout_s": 560},
        "tasks": {"type": "harbor", "path": str(harbor_task(tmp_path))},
        "sandbox": {"type": "docker", "gateway_root": str(tmp_path / "gateway")},
        "scheduler": {"group_size": 1, "max_inflight_episodes": 1, "episode_deadline_s": 500, "max_attempts": 1},
        "agent": {"concurrency": 1, "harness": harness},
        "eval": {"attempts": 1, "ks": [1]},
        "policy": {"type": "scripted", "chat_format": "bytes-chatml", "script": script(command)},
    }


def run(tmp_path, verb: str, command: str, cfg: dict | None = None,
        episodes: int = 1) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cfg = cfg or job(tmp_path, command)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = run_with_progress([*ROLLWAY, verb, *(["--no-report"] if verb == "up" else []), str(tmp_path / "job.yaml"),
                          "--run-dir", str(run_dir)],
                         cwd=ROOT)
    trajs_file = run_dir / "trajectories.jsonl"
    trajs = [json.loads(line) for line in trajs_file.read_text().splitlines()] if trajs_file.exists() else []
    failures = run_dir / "failures.jsonl"
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(trajs) == episodes, failures.read_text()[-3000:] if failures.exists() else out.stderr[-3000:]
    return out, trajs


def assert_tokens_are_what_the_engine_sampled(t: dict, texts: list[str]) -> None:
    # The program's own prompt reached the engine: Qwen Code's system prompt and the task's instruction.
    assert_captured_tokens(t, texts, prompt_has=["Qwen Code", "top404.txt"])


def test_qwen_code_fixes_a_harbor_task_in_docker_with_rollway_up(tmp_path):
    out, trajs = run(tmp_path, "up", SOLVE)
    t = trajs[0]
    assert t["resolved"] and t["reward"] == 1.0, t["grade"]
    assert t["stop_reason"] == "harness_exit" and t["num_turns"] == 2
    assert_tokens_are_what_the_engine_sampled(t, [shell_call(SOLVE), "Done."])
    # What the tool printed came back to the model as the next call's new tokens (observation).
    assert t["turns"][1]["finish_reason"] == "stop"


def test_qwen_code_that_does_not_fix_scores_zero_in_rollway_eval(tmp_path):
    out, trajs = run(tmp_path, "eval", NOT_SOLVE)
    t = trajs[0]
    assert not t["resolved"] and t["reward"] == 0.0 and t["stop_reason"] == "harness_exit"
    assert_tokens_are_what_the_engine_sampled(t, [shell_call(NOT_SOLVE), "Done."])
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["completed"] == 1 and result["failed"] == 0 and result["pass@1"] == 0.0


# --- in the local jail -------------------------------------------------------------------------------

JAIL_SOLVE = "awk '{print $1 + $2}' numbers.txt > answer.txt"
JAIL_NOT_SOLVE = "cat numbers.txt"


def jail_job(tmp_path, command: str) -> dict:
    """One toy task in the local jail (bubblewrap), Qwen Code bound read-only from its install folder.
    node reserves about 18 GB of address space while using about 700 MB: the sandbox's 2 GB hold its
    real memory (the jail's memory cgroup), not its address space."""
    harness = {**qwen_harness(qwen_code()), "time_limit_s": 400, "silence_limit_s": 300}
    return {
        "run": {"name": "qwen-jail", "timeout_s": 560},
        "tasks": {"type": "toy", "count": 1},
        "sandbox": {"type": "local", "memory_mb": 2048, "root": str(tmp_path / "boxes")},
        "scheduler": {"group_size": 1, "max_inflight_episodes": 1, "episode_deadline_s": 500, "max_attempts": 1},
        "agent": {"concurrency": 1, "harness": harness},
        "eval": {"attempts": 1, "ks": [1]},
        "policy": {"type": "scripted", "chat_format": "bytes-chatml", "script": script(command)},
    }


def test_qwen_code_fixes_a_toy_task_in_the_local_jail_with_rollway_up(tmp_path):
    out, trajs = run(tmp_path, "up", JAIL_SOLVE, jail_job(tmp_path, JAIL_SOLVE))
    t = trajs[0]
    assert t["resolved"] and t["reward"] == 1.0, t["grade"]
    assert t["stop_reason"] == "harness_exit" and t["num_turns"] == 2
    assert_captured_tokens(t, [shell_call(JAIL_SOLVE), "Done."], prompt_has=["Qwen Code", "numbers.txt"])


def test_qwen_code_that_does_not_fix_scores_zero_in_the_local_jail_in_rollway_eval(tmp_path):
    out, trajs = run(tmp_path, "eval", JAIL_NOT_SOLVE, jail_job(tmp_path, JAIL_NOT_SOLVE))
    t = trajs[0]
    assert not t["resolved"] and t["reward"] == 0.0 and t["stop_reason"] == "harness_exit"
    assert_captured_tokens(t, [shell_call(JAIL_NOT_SOLVE), "Done."], prompt_has=["Qwen Code", "numbers.txt"])
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["completed"] == 1 and result["failed"] == 0 and result["pass@1"] == 0.0
