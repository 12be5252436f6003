"""Build the configured task set: built-ins by name, your own as `python:MODULE:CLASS`."""

from __future__ import annotations

from rollway.base.registry import Registry
from rollway.envs.base import TaskSet, check_taskset
from rollway.envs.config import TasksConfig
from rollway.envs.split import select_tasks
from rollway.sandboxes.config import SandboxConfig

TASK_SETS = Registry("task set", "tasks.type", "rollway.envs.base:TaskSet")
"""`tasks.type` -> TaskSet class and its config class. A new built-in is one
`TASK_SETS.add(name, "module:Class", "module:ItsConfig")` line (and its name in TasksConfig.type); a plugin
needs nothing here (its `config_class` attribute names its config)."""
TASK_SETS.add("toy", "rollway.envs.toy:ToyTaskSet", "rollway.envs.config:ToyTasksConfig")
TASK_SETS.add("swe", "rollway.envs.swebench:SWEBenchTaskSet", "rollway.envs.config:SWETasksConfig")
TASK_SETS.add("humaneval", "rollway.envs.humaneval:HumanEvalTaskSet", "rollway.envs.config:HumanEvalTasksConfig")
TASK_SETS.add("calc", "rollway.envs.calc:CalcTaskSet", "rollway.envs.config:CalcTasksConfig")
TASK_SETS.add("sim", "rollway.envs.sim:SimTaskSet", "rollway.envs.config:SimTasksConfig")
TASK_SETS.add("swebench", "rollway.envs.swebench:SWEBenchTaskSet", "rollway.envs.config:SWEBenchTasksConfig")
TASK_SETS.add("buglocal", "rollway.envs.buglocal:BugLocTaskSet", "rollway.envs.config:BugLocTasksConfig")
TASK_SETS.add("harbor", "rollway.envs.harbor:HarborTaskSet", "rollway.envs.config:HarborTasksConfig")


def build_taskset(cfg: TasksConfig, sandbox: SandboxConfig | None = None) -> TaskSet:
    """The task set `cfg.type` names, constructed with its (validated) config section, with the task
    selection every task set has (`split`, `test_fraction`, `limit`) applied by the framework and the
    run's sandbox settings given to it (`TaskSet.sandbox_config`). A task set whose hooks have another
    signature than rollway calls is refused (HookSignatureError naming the hook and the signature)."""
    cls = TASK_SETS.load(cfg.type)
    check_taskset(cls)  # a hook with another signature fails here, named, not mid-run
    taskset = with_selection(cls(cfg), cfg)
    taskset.sandbox_config = sandbox
    return taskset


def with_selection(taskset: TaskSet, cfg: TasksConfig) -> TaskSet:
    """`taskset` whose `tasks()` gives the configured split and limit of what the class lists. The
    selection is idempotent, so a task set that also selects (older built-ins) gets the same list."""
    chosen = select_tasks(taskset.tasks(), cfg)
    taskset.tasks = lambda: list(chosen)  # type: ignore[method-assign]
    return taskset
