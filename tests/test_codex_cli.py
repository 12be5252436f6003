"""The real Codex CLI (@openai/codex 0.171, which speaks only the Responses API) against the gateway:
streamed, stateless (`store: false`, the whole history each call), with its hosted tool types dropped
from what the model sees, captured token-exact in one segment; as a harness episode on toy tasks (jail,
docker) and on a Harbor task (docker). The program is installed by scripts/setup-agents.sh (run here
when missing: the test fails, never skips, without it). The scripted policy (policies/scripted.py) is
the only fake part: it stands in for the model."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from agent_programs import codex_cli
from conftest import run
from test_gateway import LoggedEngine, check_against_engine, key, serve

from rollway.gateway import rebuild_segments
from rollway.policies.config import ScriptRule

EXEC = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo hi > out.txt"}}\n</tool_call>'
DONE = "Done: wrote out.txt."


async def codex_exec(gateway: Any, handle: Any, tmp_path: Path, settings: str = "") -> tuple[int, str]:
    """The real Codex CLI's `exec` of "Write hi into out.txt" in `tmp_path/work`, its config.toml (in
    `tmp_path/codex-home`) naming the gateway's episode `handle` as its Responses API provider, with the lines
    `settings` added: exit code and output. Bounded (a compaction limit under Codex's own prompt would have it
    compact after every call)."""
    work, home = tmp_path / "work", tmp_path / "codex-home"
    work.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "rollway-policy"\nmodel_provider = "rollway"\n{settings}[model_providers.rollway]\n'
        f'name = "rollway"\nbase_url = "{gateway.url}/v1"\nenv_key = "ROLLWAY_KEY"\nwire_api = "responses"\n')
    env = {**os.environ, "CODEX_HOME": str(home), "ROLLWAY_KEY": handle.api_key}
    proc = await asyncio.create_subprocess_exec(
        str(codex_cli() / "node_modules" / ".bin" / "codex"), "exec", "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox", "Write hi into out.txt", cwd=work, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=600)
    finally:
        if proc.returncode is None:
            proc.kill()
    return proc.returncode, out.decode()


def test_codex_cli_plays_a_tool_episode_through_the_responses_api(tmp_path):
    work = tmp_path / "work"

    async def scenario():
        engine = LoggedEngine([ScriptRule(turns=[EXEC, DONE])])
        gateway, recorder = await serve(engine)
        handle = gateway.open_episode(key())
        try:
            code, out = await codex_exec(gateway, handle, tmp_path)  # Codex ends after the model's final answer
        finally:
            await gateway.stop()
        return code, out, engine, recorder.of("ep-1"), handle

    code, out, engine, calls, handle = run(scenario())
    assert code == 0, out[-3000:]
    assert DONE in out and (work / "out.txt").read_text() == "hi\n"
    assert handle.unsupported is None
    assert [c.api for c in calls] == ["responses", "responses"]
    # One stream: the second call (the command's output sent back) extends the first.
    assert [(c.segment, c.segment_reason, c.retry_of) for c in calls] == [(0, "start", None), (0, None, None)]
    [sent_back] = [m for m in calls[1].new_messages if m["role"] == "tool"]
    assert sent_back["tool_call_id"] == calls[0].tool_calls[0]["id"]
    offered = [t["function"]["name"] for t in calls[0].tools]
    assert "exec_command" in offered and "web_search" not in offered  # hosted and namespace tools dropped
    check_against_engine(calls, engine)
    [segment] = rebuild_segments(calls)
    assert segment.token_ids == engine.log[-1][0] + engine.log[-1][1].token_ids


LONG_OUTPUT = ('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "yes the quick brown fox jumps over the '
               'lazy dog | head -800"}}\n</tool_call>')
COMPACTED = "Summary: the text was printed; hi is still to be written into out.txt."


@pytest.mark.parametrize("told_context", [False, True], ids=["context-unknown", "context-and-compaction-set"])
def test_codex_cli_at_the_end_of_the_engines_context_compacts_only_when_told_the_context(tmp_path, told_context):
    """A command's output (about 2,400 tokens of what Codex keeps of it) takes the conversation past the
    engine's 8,000-token context (SmolLM2's tokenizer; Codex's own prompt is about 6,400 tokens). Not told the
    context, Codex sends the call, is refused with `context_length_exceeded` (the gateway's 400) and exits 1:
    graded 0 as a crash. Told it (`model_context_window`, `model_auto_compact_token_limit`), it compacts
    first (its "CONTEXT CHECKPOINT COMPACTION" call, recorded and trained as a segment of its own) and goes
    on to finish the task. docs/harness.md names both settings."""
    from rollway.gateway import Gateway, MemoryRecorder
    from rollway.policies.hf_chat import HFChatFormat
    from rollway.policies.model_loading import load_tokenizer

    work = tmp_path / "work"
    settings = "model_context_window = 8000\nmodel_auto_compact_token_limit = 7000\n" if told_context else ""
    chat = HFChatFormat(load_tokenizer("smollm2"))

    async def scenario():
        engine = LoggedEngine([ScriptRule(when="CONTEXT CHECKPOINT COMPACTION", turns=[COMPACTED]),
                               ScriptRule(when=COMPACTED, turns=[EXEC, DONE]),
                               ScriptRule(turns=[LONG_OUTPUT, EXEC, DONE])], max_model_len=8000, chat=chat)
        recorder = MemoryRecorder()
        gateway = Gateway(engine, chat, recorder)
        await gateway.start()
        try:
            code, out = await codex_exec(gateway, gateway.open_episode(key()), tmp_path, settings)
        finally:
            await gateway.stop()
        return code, out, engine, recorder.of("ep-1")

    code, out, engine, calls = run(scenario())
    assert all(len(prompt) + len(gen.token_ids) <= 8000 for prompt, gen in engine.log)  # nothing past it served
    if not told_context:
        assert code == 1 and "ran out of room in the model's context window" in out, out[-3000:]
        assert len(calls) == 1 and not (work / "out.txt").exists()  # the refused call left no record
        return
    assert code == 0 and (work / "out.txt").read_text() == "hi\n", out[-3000:]
    texts = [c.raw_text for c in calls]
    assert texts == [LONG_OUTPUT, COMPACTED, EXEC, DONE], texts
    assert [c.segment for c in calls] == [0, 1, 2, 2] and calls[1].side_call is None  # trained, a segment apart
    check_against_engine(calls, engine)


# As a harness episode: Codex runs inside the local jail (no network but the gateway's socket), from the
# read-only install folder; a shell line writes its config with the episode's base URL, then runs it.
CODEX_SETUP = ('mkdir -p "$CODEX_HOME" && printf \'model = "rollway-policy"\\nmodel_provider = "rollway"\\n'
               '[model_providers.rollway]\\nname = "rollway"\\nbase_url = "%s"\\nenv_key = "OPENAI_API_KEY"\\n'
               'wire_api = "responses"\\n\' "$OPENAI_BASE_URL" > "$CODEX_HOME/config.toml" && exec "$1" exec '
               '--skip-git-repo-check --dangerously-bypass-approvals-and-sandbox "$(cat "$0")"')
SUM = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "awk \'{print $1 + $2}\' numbers.txt > answer.txt"}}\n</tool_call>'


def test_codex_cli_fixes_toy_tasks_as_a_harness_episode_in_the_jail(tmp_path):
    from test_harness import up

    folder = codex_cli()
    binary = folder / "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
    harness = {"command": ["sh", "-c", CODEX_SETUP, "{instruction_file}", str(binary)],
               "env": {"CODEX_HOME": "/tmp/codex-home"}, "install": {"type": "host_dir", "path": str(folder)}}
    out, summary, trajs = up(tmp_path, [{"when": "", "turns": [SUM, DONE]}], harness)
    assert out.returncode == 0 and len(trajs) == 2, (out.stderr[-3000:],
                                                     (tmp_path / "run" / "failures.jsonl").read_text()[-3000:]
                                                     if (tmp_path / "run" / "failures.jsonl").exists() else "")
    for t in trajs:
        assert t["resolved"] and t["reward"] == 1.0 and t["stop_reason"] == "harness_exit", t["grade"]
        assert t["num_turns"] == 2 and t["segment_starts"] == []  # Codex extends its one conversation


def test_codex_cli_fixes_toy_tasks_as_a_harness_episode_in_a_docker_container(tmp_path):
    import json
    import subprocess

    import yaml
    from docker_engine import ensure_engine
    from test_harness import ROLLWAY, ROOT, harness_job

    ensure_engine()
    folder = codex_cli()
    binary = folder / "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
    harness = {"command": ["sh", "-c", CODEX_SETUP, "{instruction_file}", str(binary)],
               "env": {"CODEX_HOME": "/tmp/codex-home"}, "install": {"type": "host_dir", "path": str(folder)}}
    job = harness_job(tmp_path, [{"when": "", "turns": [SUM, DONE]}], harness)
    job["sandbox"] = {"type": "docker", "image": "rollway-sandbox:bookworm", "gateway_root": str(tmp_path / "gateway")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    out = subprocess.run([*ROLLWAY, "up", "--no-report", str(tmp_path / "job.yaml"), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=job["run"]["timeout_s"] + 60, cwd=ROOT)
    trajs_file = run_dir / "trajectories.jsonl"
    trajs = [json.loads(line) for line in trajs_file.read_text().splitlines()] if trajs_file.exists() else []
    failures = run_dir / "failures.jsonl"
    assert out.returncode == 0 and len(trajs) == 2, (out.stderr[-3000:],
                                                     failures.read_text()[-3000:] if failures.exists() else "")
    for t in trajs:
        assert t["resolved"] and t["reward"] == 1.0 and t["stop_reason"] == "harness_exit", t["grade"]
        assert t["num_turns"] == 2 and t["segment_starts"] == []


def test_codex_cli_fixes_a_harbor_task_in_docker_with_rollway_up(tmp_path):
    """The Codex CLI on the Harbor example `log-top-ips` (its own image, graded by its own verifier in a
    separate container), one episode: the scripted model runs the fix through `exec_command`, then answers."""
    import json

    from agent_programs import assert_captured_tokens
    from docker_engine import ensure_engine
    from test_qwen_code import SOLVE, TASK
    from test_qwen_code import run as run_job

    ensure_engine()
    folder = codex_cli()
    binary = folder / "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
    fix = "<tool_call>" + json.dumps({"name": "exec_command", "arguments": {"cmd": SOLVE}}) + "</tool_call>"
    harness = {"command": ["sh", "-c", CODEX_SETUP, "{instruction_file}", str(binary)], "time_limit_s": 400,
               "silence_limit_s": 300, "env": {"CODEX_HOME": "/tmp/codex-home"},
               "install": {"type": "host_dir", "path": str(folder)}}
    cfg = {  # the task as shipped: a static binary fits its 512 MB
        "run": {"name": "codex-harbor", "timeout_s": 560},
        "tasks": {"type": "harbor", "path": str(TASK)},
        "sandbox": {"type": "docker", "gateway_root": str(tmp_path / "gateway")},
        "scheduler": {"group_size": 1, "max_inflight_episodes": 1, "episode_deadline_s": 500, "max_attempts": 1},
        "agent": {"concurrency": 1, "harness": harness},
        "policy": {"type": "scripted", "chat_format": "bytes-chatml", "script": [{"when": "", "turns": [fix, DONE]}]},
    }
    out, [t] = run_job(tmp_path, "up", SOLVE, cfg)
    assert t["resolved"] and t["reward"] == 1.0, t["grade"]
    assert t["stop_reason"] == "harness_exit" and t["num_turns"] == 2
    assert_captured_tokens(t, [fix, DONE], prompt_has=["Codex", "top404.txt"])
