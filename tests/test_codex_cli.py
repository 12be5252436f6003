"""The real Codex CLI (@openai/codex 0.171, which speaks only the Responses API) against the gateway:
streamed, stateless (`store: false`, the whole history each call), with its hosted tool types dropped
from what the model sees, captured token-exact in one segment. The program is installed by
scripts/setup-agents.sh (run here when missing: the test fails, never skips, without it). The scripted
policy (policies/scripted.py) is the only fake part: it stands in for the model."""

from __future__ import annotations

import asyncio
import os

from agent_programs import codex_cli
from conftest import run
from test_gateway import LoggedEngine, check_against_engine, key, serve

from rollway.gateway import rebuild_segments
from rollway.policies.config import ScriptRule

EXEC = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo hi > out.txt"}}\n</tool_call>'
DONE = "Done: wrote out.txt."


def test_codex_cli_plays_a_tool_episode_through_the_responses_api(tmp_path):
    codex = codex_cli() / "node_modules" / ".bin" / "codex"
    work, home = tmp_path / "work", tmp_path / "codex-home"
    work.mkdir()
    home.mkdir()

    async def scenario():
        engine = LoggedEngine([ScriptRule(turns=[EXEC, DONE])])
        gateway, recorder = await serve(engine)
        handle = gateway.open_episode(key())
        (home / "config.toml").write_text(
            'model = "rollway-policy"\nmodel_provider = "rollway"\n[model_providers.rollway]\nname = "rollway"\n'
            f'base_url = "{gateway.url}/v1"\nenv_key = "ROLLWAY_KEY"\nwire_api = "responses"\n')
        env = {**os.environ, "CODEX_HOME": str(home), "ROLLWAY_KEY": handle.api_key}
        proc = await asyncio.create_subprocess_exec(
            str(codex), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "Write hi into out.txt", cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await proc.communicate()  # Codex ends after the model's final answer
        finally:
            await gateway.stop()
        return proc.returncode, out.decode(), engine, recorder.of("ep-1"), handle

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
