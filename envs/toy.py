"""Toy shell tasks made in memory: small, real sandboxed work for the smoke job and tests."""

from __future__ import annotations

import json
import random
import re

from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import ToyTasksConfig
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec


class ToyTaskSet(TaskSet):
    """Task k: `numbers.txt` holds two integers; the agent must write their sum to `answer.txt`.
    Graded by reading `answer.txt` back from the episode's sandbox."""

    system_prompt = ("You are an agent working in a shell sandbox. Use the tools to inspect files and "
                     "run commands. When the task is done, call finish.")
    default_tools = ("bash", "finish")

    def __init__(self, cfg: ToyTasksConfig, seed: int = 1234):
        rng = random.Random(seed)
        self._tasks = []
        for k in range(cfg.count):
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            self._tasks.append(Task(
                task_id=f"toy-{k:03d}",
                prompt="The file numbers.txt holds two integers. Write their sum to answer.txt, then call finish.",
                metadata={"a": a, "b": b}))
        self._tasks = self._tasks[: cfg.limit or len(self._tasks)]

    def tasks(self) -> list[Task]:
        return list(self._tasks)


    def reference_solution(self, task: Task):
        """A reference agent that reads the file through the bash tool and answers with what it printed
        (not with the task's metadata): cat, then write the sum it read, then finish."""

        def agent(conversation: str, turn: int) -> str:
            if turn == 0:
                return tool_call("bash", command="cat numbers.txt")
            seen = re.findall(r"^(-?\d+) (-?\d+)$", conversation, flags=re.MULTILINE)
            if turn == 1 and seen:
                a, b = map(int, seen[-1])
                return tool_call("bash", command=f"echo {a + b} > answer.txt")
            return tool_call("finish")

        return agent

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec(files={"numbers.txt": f"{task.metadata['a']} {task.metadata['b']}\n"})

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        expected = task.metadata["a"] + task.metadata["b"]
        try:
            answer = (await sandbox.read_file("answer.txt")).strip()
        except (FileNotFoundError, OSError, SandboxError):
            return Grade(0.0, False, details={"answer": None, "expected": expected})
        ok = answer == str(expected)
        return Grade(1.0 if ok else 0.0, ok, details={"answer": answer[:100], "expected": expected})


def tool_call(name: str, **arguments: str) -> str:
    """A call in the hermes format every built-in chat format parses."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
