"""A shell-task family graded by check scripts: each task is a prompt, some files, and a shell check
that exits 0 when the task is done. One file, public API only.

Run it: `rollway up examples/plugins/shell_tasks.yaml` (plays each task's reference solution: the
`gold` policy), or `rollway tasks verify examples/plugins/shell_tasks.yaml` (gold resolves every task,
doing nothing resolves none)."""

from __future__ import annotations

import json
import shlex

from pydantic import Field

from rollway.envs.base import Environment, Episode, Grade, Task, TaskSet
from rollway.envs.config import TasksConfig
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec
from rollway.tools.registry import Toolbox

TASKS = [
    {"id": "make-dir", "prompt": "Create a folder `out` holding a file `done.txt` whose only line is `ok`.",
     "files": {}, "check": 'test "$(cat out/done.txt)" = ok',
     "solution": ["mkdir -p out && echo ok > out/done.txt"]},
    {"id": "count-lines", "prompt": "Write the number of lines of data.txt (digits only) to count.txt.",
     "files": {"data.txt": "a\nb\nc\nd\ne\n"}, "check": 'test "$(tr -d " \\n" < count.txt)" = 5',
     "solution": ["wc -l < data.txt > count.txt"]},
    {"id": "fix-script", "prompt": "run.sh should print 42 but prints 41. Fix run.sh.",
     "files": {"run.sh": "echo $((40 + 1))\n"}, "check": 'test "$(sh run.sh)" = 42',
     "solution": ["sed -i 's/40 + 1/40 + 2/' run.sh", "sh run.sh"], "tools": ["bash", "editor", "finish"]},
    {"id": "home-config", "prompt": "Write `color=blue` to ~/.apprc, then check it is still there in a "
     "second command.", "files": {}, "check": 'grep -qx color=blue "$HOME/.apprc"',
     "solution": ["echo color=blue > ~/.apprc", "cat ~/.apprc"]},
]
"""The family: prompt, workspace files, the check (run in the sandbox at grading, never shown to the
agent), a reference solution (bash commands) and, optionally, the task's own tools."""


class ShellTasksConfig(TasksConfig):
    """`tasks:` for this family: the TasksConfig fields plus its own (unknown keys still fail)."""

    only: list[str] | None = None
    """Task ids to keep (None: all)."""
    check_timeout_s: float = Field(10.0, gt=0)
    """Time limit of one check script."""


def tool_call(name: str, **arguments: object) -> str:
    """One tool call as the model writes it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ShellTaskSet(TaskSet):
    config_class = ShellTasksConfig
    system_prompt = "You are a shell agent. Use bash to do the task, then call finish."
    default_tools = ("bash", "finish")

    def __init__(self, cfg: ShellTasksConfig) -> None:
        self.cfg = cfg
        rows = [t for t in TASKS if cfg.only is None or t["id"] in cfg.only]
        self._tasks = [Task(f"shell-{t['id']}", t["prompt"], metadata=t) for t in rows][: cfg.limit or None]

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def environment(self, task: Task, sandbox: Sandbox | None, toolbox: Toolbox) -> Environment:
        """A task may name its own tools (`tools` in its metadata)."""
        return Environment(self, task, toolbox.build(task.metadata.get("tools", self.default_tools)), sandbox,
                           toolbox.cfg)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec(files=dict(task.metadata["files"]))

    def reference_solution(self, task: Task) -> list[str]:
        return [*(tool_call("bash", command=c) for c in task.metadata["solution"]), tool_call("finish")]

    def grading_time_limit_s(self, task: Task) -> float:
        return self.cfg.check_timeout_s  # the one check below: the scheduler waits this long for a grade

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        check = await sandbox.exec(f"sh -c {shlex.quote(task.metadata['check'])}", timeout_s=self.cfg.check_timeout_s)
        ok = check.exit_code == 0
        return Grade(float(ok), ok, details={"check_exit": check.exit_code, "turns": len(episode.turns),
                                             "episode_id": episode.episode_id})
