"""The bash and finish tools on the real local (bubblewrap) sandbox."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollway.sandboxes.base import Sandbox, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.local import LocalSandboxProvider, remove_tree
from rollway.tools.base import outside_episode
from rollway.tools.bash import BashTool
from rollway.tools.config import ToolsConfig
from rollway.tools.registry import build_tools, run_tool_calls


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    # Directly under /tmp: the jail user cannot traverse pytest's private tmp_path parents.
    root = tempfile.mkdtemp(prefix="rollway-tools-test-")
    provider = LocalSandboxProvider(SandboxConfig(root=root, max_output_bytes=2_000))
    box = asyncio.run(provider.create(SandboxSpec(files={"a.txt": "hello\n"}), "bash-test"))
    yield box
    remove_tree(Path(root))


def bash(sandbox: Sandbox, command: str, timeout_s: float = 10.0):
    return asyncio.run(BashTool(ToolsConfig(bash_timeout_s=timeout_s)).call({"command": command}, sandbox, outside_episode()))


def test_exit_code_and_output(sandbox: Sandbox) -> None:
    result = bash(sandbox, "cat a.txt && pwd")
    assert result.content == "Exit code: 0\nhello\n/workspace\n" and not result.is_error
    failed = bash(sandbox, "grep nothing a.txt")
    # A nonzero exit is an answer (no match, failing tests), not a failed call.
    assert failed.content == "Exit code: 1\n(no output)" and not failed.is_error
    assert failed.metadata["exit_code"] == 1


def test_timeout_is_reported(sandbox: Sandbox) -> None:
    # 3 s: the jail's start counts against the limit, and "started" must be printed before it expires
    # even on a loaded machine (at 1 s it was not, at load average 20)
    result = bash(sandbox, "echo started; sleep 60", timeout_s=3)
    assert result.is_error and result.metadata["timed_out"]
    assert "timed out after 3 s" in result.content and "started" in result.content


def test_long_output_is_cut_with_notices(sandbox: Sandbox) -> None:
    cfg = ToolsConfig(max_observation_chars=500)
    text = '<tool_call>{"name": "bash", "arguments": {"command": "seq 1 5000"}}</tool_call>'
    turn = asyncio.run(run_tool_calls(text, build_tools(["bash"], cfg), sandbox, cfg))
    [observation] = turn.observations
    assert observation.truncated and len(observation.content) <= 500
    assert observation.content.startswith("Exit code: 0\n1\n2\n") and "characters cut" in observation.content


def test_finish_ends_the_turn(sandbox: Sandbox) -> None:
    cfg = ToolsConfig()
    text = (
        '<tool_call>{"name": "bash", "arguments": {"command": "echo hi > b.txt"}}</tool_call>'
        '<tool_call>{"name": "finish", "arguments": {"message": "wrote b.txt"}}</tool_call>'
    )
    turn = asyncio.run(run_tool_calls(text, build_tools(["bash", "finish"], cfg), sandbox, cfg))
    assert turn.done == "finish" and [o.tool for o in turn.observations] == ["bash", "finish"]
    assert "+hi" in asyncio.run(sandbox.diff())
