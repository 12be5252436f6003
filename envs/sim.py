"""Simulated tasks for the rollout benchmark: one task per planned episode (`rollway.bench.workload`)."""

from __future__ import annotations

import json

from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import SimTasksConfig
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec
from rollway.sandboxes.sim import SIM_SPEC_FILE


def read_plan_rows(path: str) -> list[dict]:
    """The rows of a plans file (`rollway.bench.workload.write_plans`: one JSON episode plan a
    line), read here as plain data so the task set does not import the benchmark package."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class SimTaskSet(TaskSet):
    """`tasks.type: sim`, `tasks.path`: a plans file written by `rollway bench`. Task k's sandbox
    starts in the planned time and its grading runs the planned time in the sandbox (`sim-grade`).
    Run it with `scheduler.group_size: 1`: each plan is one episode."""

    system_prompt = "You are a software engineering agent. Use the tools, then call finish."
    default_tools = ("bash", "finish")

    def __init__(self, cfg: SimTasksConfig):
        if not cfg.path:
            raise ValueError("tasks.type=sim needs tasks.path: a plans file written by `rollway bench pipeline`")
        plans = read_plan_rows(cfg.path)[: cfg.limit or None]
        self._tasks = [Task(task_id=f"sim-{p['index']:05d}", prompt=p["prompt"],
                            metadata={"index": p["index"], "init_s": p["init_s"], "grade_s": p["grade_s"],
                                      "resolved": p["resolved"], "expected_init_s": p.get("init_s_estimate", 0.0),
                                      "expected_grade_s": p.get("grade_s_estimate", 0.0)}) for p in plans]
        self._by_id = {t.task_id: t for t in self._tasks}

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def get(self, task_id: str) -> Task:
        try:
            return self._by_id[task_id]
        except KeyError:
            raise KeyError(f"task {task_id!r} is not in the sim plans file; check tasks.path") from None

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec(files={SIM_SPEC_FILE: json.dumps({"init_s": task.metadata["init_s"]})})

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        passed = int(task.metadata["resolved"])
        result = await sandbox.exec(f"sim-grade {task.metadata['grade_s']:.3f} {passed}")
        ok = result.exit_code == 0
        return Grade(1.0 if ok else 0.0, ok, details={"output": result.output})
