"""Each extension hook has one signature: `Tool.call(arguments, sandbox, context)` and
`TaskSet.grade(task, sandbox, provider, episode)`. A plugin written with the older, shorter form is
refused when it is loaded (the real plugin loader, the real tool and task-set builders), with an error
naming the hook and the signature rollway calls; the one form receives the context and the episode
(real local sandbox)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rollway.base.hooks import HookSignatureError
from rollway.config.run import load_config
from rollway.envs.base import Episode
from rollway.envs.factory import build_taskset
from rollway.sandboxes.local import LocalSandboxProvider
from rollway.tools.base import ToolContext
from rollway.tools.config import ToolsConfig
from rollway.tools.registry import build_tools, run_tool_calls

OLD_PLUGINS = '''
from rollway.envs.base import Grade
from rollway.envs.toy import ToyTaskSet
from rollway.tools.base import Tool, ToolResult


class OldTool(Tool):
    name, description, parameters = "old_echo", "echo", {"type": "object", "properties": {}}

    def __init__(self, cfg):
        pass

    async def call(self, arguments, sandbox):
        return ToolResult("old")


class OldGradeTaskSet(ToyTaskSet):
    async def grade(self, task, sandbox, provider):
        return Grade(1.0, True)
'''

NEW_PLUGINS = '''
from rollway.envs.base import Grade
from rollway.envs.toy import ToyTaskSet
from rollway.tools.base import Tool, ToolResult


class EchoTool(Tool):
    name, description, parameters = "new_echo", "echo", {"type": "object", "properties": {}}

    def __init__(self, cfg):
        pass

    async def call(self, arguments, sandbox, context):
        return ToolResult(f"{context.episode_id} turn {context.turn} of {context.task.task_id}")


class EpisodeTaskSet(ToyTaskSet):
    async def grade(self, task, sandbox, provider, episode):
        return Grade(1.0, True, details={"episode": episode.episode_id, "turns": len(episode.turns)})
'''


@pytest.fixture
def plugins(tmp_path):
    (tmp_path / "old_hooks.py").write_text(OLD_PLUGINS)
    (tmp_path / "new_hooks.py").write_text(NEW_PLUGINS)
    return tmp_path


def test_a_tool_with_the_old_call_signature_is_refused_at_load(plugins):
    ref = f"python:{plugins}/old_hooks.py:OldTool"
    with pytest.raises(HookSignatureError) as err:
        build_tools([ref, "finish"], ToolsConfig())
    message = str(err.value)
    assert "OldTool.call(arguments, sandbox)" in message
    assert "async def call(self, arguments, sandbox, context: ToolContext) -> ToolResult" in message


def test_a_task_set_with_the_old_grade_signature_is_refused_at_load(plugins):
    cfg = load_config(None, [f"tasks.type=python:{plugins}/old_hooks.py:OldGradeTaskSet"])
    with pytest.raises(HookSignatureError) as err:
        build_taskset(cfg.tasks)
    message = str(err.value)
    assert "OldGradeTaskSet.grade(task, sandbox, provider)" in message
    assert "async def grade(self, task, sandbox, provider, episode: Episode) -> Grade" in message


def test_the_one_signatures_get_the_context_and_the_episode(plugins):
    cfg = load_config(None, [f"tasks.type=python:{plugins}/new_hooks.py:EpisodeTaskSet", "tasks.count=1"])
    taskset = build_taskset(cfg.tasks)
    task = taskset.tasks()[0]
    tools = build_tools([f"python:{plugins}/new_hooks.py:EchoTool"], ToolsConfig())
    provider = LocalSandboxProvider()

    async def play():
        sandbox = await provider.create(taskset.sandbox_spec(task), f"hooks-{uuid.uuid4().hex[:8]}")
        try:
            context = ToolContext(task=task, episode_id="ep-1", turn=2)
            turn = await run_tool_calls('<tool_call>{"name": "new_echo", "arguments": {}}</tool_call>', tools,
                                        sandbox, ToolsConfig(), context)
            episode = Episode(episode_id="ep-1", attempt=0, task=task, messages=[])
            return turn.observations[0].content, await taskset.grade(task, sandbox, provider, episode)
        finally:
            await sandbox.destroy()

    seen, grade = asyncio.run(play())
    assert seen == f"ep-1 turn 2 of {task.task_id}"
    assert grade.details == {"episode": "ep-1", "turns": 0}
