"""Custom grading: partial credit, checked by a command in the sandbox. Run: python examples/extending/custom_reward.py"""

import asyncio

from rollway.config.run import load_config
from rollway.envs.base import Episode, Grade, Task
from rollway.envs.factory import build_taskset
from rollway.envs.toy import ToyTaskSet
from rollway.sandboxes.base import Sandbox, SandboxProvider
from rollway.sandboxes.factory import build_sandbox_provider


class PartialCreditToyTaskSet(ToyTaskSet):
    """The toy tasks with a softer reward: 1.0 for the right sum, 0.2 for any number in answer.txt."""

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        # The reward actor calls this once per episode, before it destroys the sandbox.
        expected = task.metadata["a"] + task.metadata["b"]
        check = await sandbox.exec(f'test "$(cat answer.txt)" -eq {expected}')
        if check.exit_code == 0:
            return Grade(1.0, True, details={"expected": expected})
        is_number = (await sandbox.exec("grep -Eqx '[0-9]+' answer.txt")).exit_code == 0
        return Grade(0.2 if is_number else 0.0, False, details={"expected": expected, "output": check.output[-200:]})


async def main() -> None:
    cfg = load_config(None, ["tasks.type=python:examples/extending/custom_reward.py:PartialCreditToyTaskSet"])
    taskset, provider = build_taskset(cfg.tasks), build_sandbox_provider(cfg.sandbox)
    task = taskset.tasks()[0]
    rewards = []
    for answer in ("12345", "{a} + {b}", "{sum}"):
        sandbox = await provider.create(taskset.sandbox_spec(task), "demo-reward")
        try:
            a, b = task.metadata["a"], task.metadata["b"]
            await sandbox.write_file("answer.txt", answer.format(a=a, b=b, sum=a + b) + "\n")
            rewards.append((await taskset.grade(task, sandbox, provider, Episode.outside_run(task))).reward)
        finally:
            await sandbox.destroy()
    print(rewards)
    assert rewards == [0.2, 0.0, 1.0]


if __name__ == "__main__":
    asyncio.run(main())
