"""A custom task set read from a JSONL file. Run: python examples/extending/custom_taskset.py"""

import asyncio
import json
import tempfile
from pathlib import Path

from rollway.config.run import load_config
from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import FileTasksConfig
from rollway.envs.factory import build_taskset
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec
from rollway.sandboxes.factory import build_sandbox_provider


class FileTaskSet(TaskSet):
    """One task per line of `tasks.path`: {"task_id", "prompt", "files": {path: content}, "answer"}.
    `files` is the task's repository; the agent must write `answer` to answer.txt."""

    default_tools = ("bash", "finish")
    config_class = FileTasksConfig  # the shared task fields plus `path`

    def __init__(self, cfg: FileTasksConfig) -> None:
        lines = Path(cfg.path).read_text().splitlines()
        self._tasks = [Task(d["task_id"], d["prompt"], metadata=d) for d in map(json.loads, lines) if d]

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec(files=task.metadata["files"])

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        try:
            answer = (await sandbox.read_file("answer.txt")).strip()
        except SandboxError:
            answer = None
        ok = answer == task.metadata["answer"]
        return Grade(float(ok), ok, details={"answer": answer})


async def main() -> None:
    path = Path(tempfile.mkdtemp()) / "tasks.jsonl"
    task = {"task_id": "sum-1", "prompt": "Write the sum of numbers.txt to answer.txt.",
            "files": {"numbers.txt": "3 4\n"}, "answer": "7"}
    path.write_text(json.dumps(task) + "\n")
    # The same section selects it in a run, from the repository root (the whole section, so the toy
    # task set's `count` in smoke.yaml does not follow: it is not a field of FileTasksConfig):
    #   rollway up examples/smoke.yaml 'tasks={"type": "python:examples/extending/custom_taskset.py:FileTaskSet",
    #                                          "path": "..."}'
    cfg = load_config(None, ["tasks.type=python:examples/extending/custom_taskset.py:FileTaskSet", f"tasks.path={path}"])
    taskset, provider = build_taskset(cfg.tasks), build_sandbox_provider(cfg.sandbox)
    first = taskset.tasks()[0]
    sandbox = await provider.create(taskset.sandbox_spec(first), "demo-taskset")
    try:
        await sandbox.exec("awk '{print $1 + $2}' numbers.txt > answer.txt")  # what a good agent does
        grade = await taskset.grade(first, sandbox, provider, Episode.outside_run(first))
    finally:
        await sandbox.destroy()
    print(first.task_id, grade)
    assert grade.resolved and grade.reward == 1.0


if __name__ == "__main__":
    asyncio.run(main())
