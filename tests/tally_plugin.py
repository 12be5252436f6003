"""A stateful task-set plugin for tests (tests/test_rerun.py): per-task tools built from the task's data,
a tally kept in the episode's state store, a chat-only turn (no tool call needed), and a grade read from
the state and from the `finish` call's arguments, as docs/extending.md says."""

from __future__ import annotations

from typing import Any

from rollway.envs.base import Environment, Episode, Grade, Task, TaskSet
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.registry import Toolbox


class AddTool(Tool):
    """Adds its task's step to the tally in the state store."""

    name = "tally.add"
    description = "Add this task's step to the tally and print the tally."
    parameters = {"type": "object", "properties": {}, "additionalProperties": False}

    def __init__(self, step: int) -> None:
        self.step = step

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        context.state["tally"] = context.state.get("tally", 0) + self.step
        return ToolResult(f"tally {context.state['tally']}")


class TallyTaskSet(TaskSet):
    system_prompt = "Add to the tally twice, then call finish with the message 'done'."
    require_tool_call = False  # the first turn only talks

    def __init__(self, cfg: Any) -> None:
        self._tasks = [Task(f"tally-{step}", f"Reach {2 * step}.", {"step": step}) for step in (3, 5)]
        self._tools = {t.task_id: [AddTool(t.metadata["step"]), "finish"] for t in self._tasks}

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def environment(self, task: Task, sandbox: Sandbox | None, toolbox: Toolbox) -> Environment:
        return Environment(self, task, toolbox.build(self._tools[task.task_id]), sandbox, toolbox.cfg)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec()

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        finish = [o.arguments for o in episode.turns[-1].observations if o.ends_episode] if episode.turns else []
        ok = episode.state.get("tally") == 2 * task.metadata["step"] and finish == [{"message": "done"}]
        return Grade(float(ok), ok, details={"tally": episode.state.get("tally"), "finish": finish})
