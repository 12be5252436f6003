"""A test-only task set whose grade is a fixed function of the episode's sandbox, not of the answer.

It exists to give a learner reward variance within every group from a policy that cannot solve
anything (a tiny randomly initialised model served by vLLM): the thing under test is then the
pipeline's policy-version bookkeeping, with the real engine, learner, broker and sandboxes.
Faked part: the grader (it reads no answer)."""

from __future__ import annotations

import hashlib
import json

from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import CountedTasksConfig
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec


class CoinTaskSet(TaskSet):
    """`tasks.count` tasks; an episode's reward is a number in [0, 1) derived from its sandbox handle,
    so the members of a group get different rewards. The last task is flat: every attempt gets 0.5, so
    its group carries no signal and is consumed without an update."""

    default_tools = ("bash", "finish")
    config_class = CountedTasksConfig

    def __init__(self, cfg: CountedTasksConfig):
        self._tasks = [Task(task_id=f"coin-{k:03d}", prompt="Say anything, then call finish.",
                            metadata={"flat": k == cfg.count - 1}) for k in range(cfg.count)]

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec()

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        if task.metadata["flat"]:
            return Grade(reward=0.5, resolved=False)
        digest = hashlib.sha256(json.dumps(sandbox.handle, sort_keys=True).encode()).digest()
        reward = digest[0] / 256
        return Grade(reward=reward, resolved=reward >= 0.5)
