"""The task-set interface: where tasks come from, how their sandbox is built, how they are graded."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec


@dataclass
class Task:
    """One task. `prompt` is what the model reads first; `metadata` is the task set's own."""

    task_id: str
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Grade:
    """The result of grading one episode."""

    reward: float
    resolved: bool
    stop_reason: str | None = None
    """Set when grading itself ended abnormally (`apply_failed`, `test_timeout`); overrides the
    agent's stop reason in the trajectory."""
    details: dict[str, Any] = field(default_factory=dict)
    """Partial counts and test names, e.g. {"fail_to_pass": {"passed": 1, "total": 2}}."""


class TaskCost(NamedTuple):
    """A task's expected cost, as the scheduler's issue order sees it."""

    init_s: float
    """Sandbox start, seconds."""
    grade_s: float
    """Grading, seconds."""


class TaskSet(ABC):
    """A family of tasks. Built once per worker by `build_taskset(config)`."""

    system_prompt: str = "You are a helpful agent. Use the tools to solve the task, then call finish."
    default_tools: tuple[str, ...] = ("bash", "finish")
    describe_tools: bool = True
    """Render the tools' JSON specs into the prompt. Small models may do better with worked
    examples in `initial_messages` instead."""

    def initial_messages(self, task: Task, system_prompt: str | None = None) -> list[dict[str, Any]]:
        """The chat the model sees first (the init actor calls this). Default: system, then the task."""
        return [{"role": "system", "content": system_prompt or self.system_prompt},
                {"role": "user", "content": task.prompt}]

    @abstractmethod
    def tasks(self) -> list[Task]:
        """All tasks of the configured split, in a stable order."""

    def get(self, task_id: str) -> Task:
        """The task with this id; KeyError naming the id when absent. Indexed on first use (every
        init and reward message looks its task up)."""
        index = self.__dict__.get("_task_index")
        if index is None:
            index = self.__dict__["_task_index"] = {t.task_id: t for t in self.tasks()}
        try:
            return index[task_id]
        except KeyError:
            raise KeyError(f"task {task_id!r} is not in this {type(self).__name__} ({len(index)} tasks); "
                           "check tasks.* in the config (count, split, limit, path)") from None

    def cost_estimate(self, task: Task) -> TaskCost | None:
        """Expected sandbox-start and grading seconds of this task, for `scheduler.order` (johnson,
        ends); None when unknown. Default: the metadata keys `expected_init_s` and `expected_grade_s`
        (a task builder writes them from its own timed runs of the task)."""
        init_s, grade_s = task.metadata.get("expected_init_s"), task.metadata.get("expected_grade_s")
        if init_s is None or grade_s is None:
            return None
        return TaskCost(float(init_s), float(grade_s))

    @abstractmethod
    def sandbox_spec(self, task: Task) -> SandboxSpec:
        """How the init actor builds this task's sandbox."""

    @abstractmethod
    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider) -> Grade:
        """Called by the reward actor once per episode, before the sandbox is destroyed."""
