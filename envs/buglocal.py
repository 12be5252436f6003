"""Bug localisation tasks: read the failing tests of an injected bug, name the file and the function
that was changed. Built from the mutation instances of `rollway tasks build swe`; graded from the
model's own `locate` call, never from a file in the workspace."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from rollway.envs.base import Environment, Episode, Grade, Step, Task, TaskSet
from rollway.envs.config import BugLocTasksConfig
from rollway.envs.swe import load_instances, prepare_buggy_copy
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.config import ToolsConfig
from rollway.tools.registry import register_tool

MAX_ANSWER_CHARS = 300
"""A file path or a qualified name longer than this is no answer (bounds the grade's details)."""

SYSTEM_PROMPT = (
    "You find bugs in Python repositories. The repository is checked out in your working directory. "
    "One function in the library (not in the tests) was changed and now breaks the failing tests. "
    "Find that function, then call locate with its file (path from the repository root) and its qualified "
    "name (function, or Class.method). You have one answer: locate ends the episode.")


def _call(tool: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


class LocateTool(Tool):
    """The answer: the file and the function the model says were changed. Ends the episode."""

    name = "locate"
    description = ("Give your answer and end the episode: `file`, the path of the changed file from the "
                   "repository root, and `function`, its qualified name (function, or Class.method).")
    parameters = {
        "type": "object",
        "properties": {
            "file": {"type": "string", "maxLength": MAX_ANSWER_CHARS, "description": "e.g. toolz/itertoolz.py"},
            "function": {"type": "string", "maxLength": MAX_ANSWER_CHARS, "description": "e.g. groupby or Foo.bar"},
        },
        "required": ["file", "function"],
        "additionalProperties": False,
    }

    def __init__(self, cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        # The grade reads the arguments from the episode's record of this call, not from the sandbox,
        # so nothing the agent's commands write can stand in for the answer.
        return ToolResult(content="Answer recorded.", ends_episode=True)


register_tool("locate", LocateTool)


def normalise_file(path: str) -> str:
    """`./a/b.py`, `a//b.py` and `/a/b.py` name the same workspace file as `a/b.py`."""
    parts = [p for p in str(path).strip().replace("\\", "/").split("/") if p not in ("", ".")]
    return "/".join(parts)


def module_of(path: str) -> str:
    """`pkg/a.py` is the module `pkg.a`; `pkg/__init__.py` is `pkg`."""
    return normalise_file(path).removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def normalise_function(name: str, file: str | None = None) -> str:
    """`Foo.bar()`, ` Foo.bar `, `def Foo.bar` and `FILE::Foo.bar` name `Foo.bar`; with the answer's `file`,
    so does the module-qualified `pkg.a.Foo.bar` (a bare `bar` stays `bar`: not the method `Foo.bar`)."""
    text = str(name).strip()
    text = text.removeprefix("def ").removeprefix("async def ").strip()
    text = text.rsplit("::", 1)[-1].removesuffix("()").strip()
    module = module_of(file) if file else ""
    return text.removeprefix(f"{module}.") if module else text


TEXT_ANSWER = re.compile(r"(?P<file>[\w./-]+\.py)::(?P<function>\w+(?:\.\w+)*)")
"""A plain-text answer, `FILE::FUNCTION` (`tasks.text_answer`)."""


def text_answer_of(text: str) -> dict[str, str] | None:
    """The first `FILE::FUNCTION` in a message's text, or None."""
    found = TEXT_ANSWER.search(text)
    return {"file": found["file"][:MAX_ANSWER_CHARS], "function": found["function"][:MAX_ANSWER_CHARS]} if found else None


def answer_of(episode: Episode | None, text_answer: bool = False) -> dict[str, str] | None:
    """The arguments of the episode's accepted `locate` call (the last one that ran); else, with
    `text_answer`, a `FILE::FUNCTION` in the last message's text; else None."""
    if episode is None:
        return None
    for turn in reversed(episode.turns):
        for obs in reversed(turn.observations):
            if obs.tool == "locate" and not obs.is_error:
                return {k: str(obs.arguments.get(k, ""))[:MAX_ANSWER_CHARS] for k in ("file", "function")}
    if text_answer and episode.turns:
        return text_answer_of(episode.turns[-1].assistant_text)
    return None


def judge(truth_file: str, truth_function: str, answer: dict[str, str] | None) -> Grade:
    """Reward 1 for the right function in the right file; `file_correct` is the second figure."""
    if answer is None:
        return Grade(0.0, False, details={"outcome": "no_answer", "file_correct": False,
                                          "function_correct": False})
    file_ok = normalise_file(answer["file"]) == normalise_file(truth_file)
    function_ok = file_ok and normalise_function(answer["function"], answer["file"]) == truth_function
    details = {"outcome": "resolved" if function_ok else "wrong_location", "file_correct": file_ok,
               "function_correct": function_ok, "answer": answer}
    return Grade(1.0 if function_ok else 0.0, function_ok, details=details)


MAX_TESTS_SHOWN = 5
"""Failing tests listed in a task (the rest are counted): a bug that breaks 40 parametrised cases is a
fine localisation task, and its prompt stays short enough for a small model's context."""


def task_prompt(instance: dict[str, Any]) -> str:
    # The SWE statement ends by asking for a fix; here the question is where the bug is.
    failing = instance["problem_statement"].split("\n\nThe rest of the test suite passes")[0]
    head, _, tests = failing.partition("Failing tests:\n")
    lines = tests.split("\n")
    if len(lines) > MAX_TESTS_SHOWN:
        failing = (f"{head}Failing tests:\n" + "\n".join(lines[:MAX_TESTS_SHOWN])
                   + f"\n- ... and {len(lines) - MAX_TESTS_SHOWN} more failing tests")
    return (f"Repository: {instance['repo']} (checked out in the working directory).\n\n{failing}\n\n"
            "One function of the library was changed. Find where it is defined, then answer with "
            "locate(file, function).")


def _example_task(test: str, message: str) -> str:
    return task_prompt({"repo": "shapes==1.0", "problem_statement": (
        "Some behaviour of `shapes==1.0` is broken: tests of its own test suite fail on this checkout.\n\n"
        f"Failing tests:\n- `{test}`: {message}\n\nThe rest of the test suite passes.")})


EXAMPLES = [
    # (task, where the definition is: search's answer, grep's answer, file, function)
    (_example_task("tests/test_text.py::test_shout", "assert 'hi' == 'HI'"),
     ("shout", "shapes/text.py:5  function shout: def shout(text):", "./shapes/text.py:5:def shout(text):"),
     "shapes/text.py", "shout"),
    (_example_task("tests/test_geometry.py::test_circle_area", "assert 6.283185307179586 == 3.141592653589793"),
     ("circle_area", "shapes/geometry.py:4  function circle_area: def circle_area(radius):",
      "./shapes/geometry.py:4:def circle_area(radius):"),
     "shapes/geometry.py", "circle_area"),
]
"""Two made-up tasks of a made-up library, solved in the worked examples (the 135M model needs them to emit
tool calls); the tools' outputs are as the real tools print them."""


_SEARCH_LIST = re.compile(r"^(?P<file>\S+\.py):(?P<line>\d+)  (?:async )?(?:function|method) (?P<name>[\w.]+): ", re.M)
_SEARCH_SOURCE = re.compile(r"^(?:async )?(?:function|method) (?P<name>[\w.]+) at (?P<file>\S+\.py):(?P<line>\d+) ", re.M)
_GREP = re.compile(r"^(?P<file>[^:\s]+\.py):(?P<line>\d+):\s*(?:async\s+)?def\s+(?P<name>\w+)", re.M)
"""A definition as the tools print it: search's list (`FILE:N  function NAME: def ...`), search's source
view (`method Foo.bar at FILE:N (lines ...)`), a grep line (`./FILE:N:    def NAME(`)."""


def _is_test_file(path: str) -> bool:
    parts = path.split("/")
    name = parts[-1]
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py" or any(
        p in ("test", "tests", "testing") for p in parts[:-1])


def definition_hints(observations: Sequence[Any]) -> list[str]:
    """The hint after a turn whose tools printed a definition (the same in both arms): where the first
    library definition is and the locate call that names it, written as the call itself (the small model
    copies text; a described call it repeated its search instead); a test's definition only: that the
    bug is in the library. Nothing when no definition was printed."""
    found = []
    for obs in observations:
        if obs.tool in (None, "locate"):
            continue
        text = str(obs.content)
        for pattern in (_SEARCH_LIST, _SEARCH_SOURCE, _GREP):
            found += [(m.start(), normalise_file(m["file"]), int(m["line"]), m["name"]) for m in pattern.finditer(text)]
    found.sort()
    library = [f for f in found if not _is_test_file(f[1])]
    if library:
        _, file, line, name = library[0]
        return [f"The definition of {name} is in {file} at line {line}. If {name} is the changed function, "
                f"answer with:\n{_call('locate', file=file, function=name)}"]
    if found:
        return [f"{found[0][1]} is a test file: the changed function is in the library. Look up the function "
                "the failing test calls."]
    return []


def _navigation(tool: str, name: str, search_out: str, grep_out: str) -> tuple[str, str]:
    """The one navigation step, per arm: the AST search, or grep through bash."""
    if tool == "search":
        return (_call("search", action="definition", name=name),
                f"1 definition of `{name}` (best match first):\n{search_out}")
    return _call("bash", command=f'grep -rn "def {name}" --include=*.py .'), f"Exit code: 0\n{grep_out}"


def worked_example(tool: str, hints: str = "none") -> list[dict[str, str]]:
    """Solved episodes shown as earlier turns: read the failing test, find the definition, answer. With
    `hints`, the hint the environment adds is shown where it adds it: `observation` at the end of the
    tool's output (as the agent loop appends hints), `user` as a user message after it."""
    messages = []
    for task, (name, search_out, grep_out), file, function in EXAMPLES:
        call, output = _navigation(tool, name, search_out, grep_out)
        hint = definition_hints([_Printed(output)]) if hints != "none" else []
        if hints == "observation":
            output, hint = "\n\n".join([output, *hint]), []
        messages += [{"role": "user", "content": task},
                     {"role": "assistant", "content": call},
                     {"role": "tool", "content": output},
                     *({"role": "user", "content": h} for h in hint),
                     {"role": "assistant", "content": _call("locate", file=file, function=function)},
                     {"role": "tool", "content": "Answer recorded."}]
    return messages


class _Printed:
    """A tool's printed output, as `definition_hints` reads an observation."""

    tool = "example"

    def __init__(self, content: str) -> None:
        self.content = content


class BugLocEnvironment(Environment):
    """A worked example before the task; the hint after a printed definition; an answer in plain text."""

    async def start(self, system_prompt: str | None = None) -> list[dict[str, Any]]:
        cfg = self.taskset.cfg
        example = worked_example(cfg.worked_example, cfg.definition_hints) if cfg.worked_example else []
        return [{"role": "system", "content": system_prompt or self.taskset.system_prompt}, *example,
                {"role": "user", "content": self.task.prompt}]

    async def step(self, output: str, episode: Episode) -> Step:
        """With `text_answer`, a message without a tool call that writes `FILE::FUNCTION` ends the episode (as
        locate does); the hint after a printed definition ends the observation or is the next user message."""
        step, cfg = await self.run_tools(output, episode), self.taskset.cfg
        if step.done or episode.stop_reason:
            return step
        if cfg.text_answer and not any(o.tool for o in step.observations) and text_answer_of(output):
            step.done = "user_done"
        elif cfg.definition_hints == "user":
            step.user_message = "\n".join(definition_hints(step.observations)) or None
        elif cfg.definition_hints == "observation":
            step.hints = definition_hints(step.observations)
        return step


class BugLocTaskSet(TaskSet):
    """One task per mutation instance; `repos`/`exclude_repos` split by library for held-out tests."""

    system_prompt = SYSTEM_PROMPT
    default_tools = ("bash", "search", "locate")
    environment_class = BugLocEnvironment

    def __init__(self, cfg: BugLocTasksConfig) -> None:
        if not cfg.path:
            raise ValueError("tasks.type=buglocal needs tasks.path, an instances file written by "
                             "`rollway tasks build swe ... --out FILE`")
        self.cfg = cfg
        self.describe_tools = cfg.describe_tools
        selected = [row for row in load_instances(cfg.path, cfg.cache_dir) if self._library_selected(row)]
        rows = [row for row in selected if cfg.difficulty == "all" or named_in_tests(row)]
        if not selected:
            raise ValueError(f"tasks.path {cfg.path} holds no instance of the selected libraries "
                             f"(repos={cfg.repos}, exclude_repos={cfg.exclude_repos})")
        if not rows:
            raise ValueError(f"tasks.path {cfg.path}: none of its {len(selected)} instances of the selected libraries "
                             "is `named` (a bug in a function a failing test is named after), which "
                             "tasks.difficulty=named keeps; use tasks.difficulty=all or other libraries")
        self.instances = {row["instance_id"]: row for row in rows}
        self._tasks = [Task(iid, task_prompt(row), {"repo": row["repo"], "file": row["mutation"]["path"],
                                                   "function": row["mutation"]["function"]})
                       for iid, row in self.instances.items()]

    def _library_selected(self, row: dict[str, Any]) -> bool:
        library = library_of(row["repo"])
        if self.cfg.repos is not None and library not in self.cfg.repos:
            return False
        return library not in self.cfg.exclude_repos

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec(source_dir=str(prepare_buggy_copy(self.instances[task.task_id], self.cfg.cache_dir)))

    def reference_solution(self, task: Task) -> list[str] | None:
        return [_call("locate", file=task.metadata["file"], function=task.metadata["function"])]

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        return judge(task.metadata["file"], task.metadata["function"], answer_of(episode, self.cfg.text_answer))



def named_in_tests(instance: dict[str, Any]) -> bool:
    """The changed function's own name (`bar` of `Foo.bar`) starts a word of a failing test's name
    (`test_bar`, `test_bar_empty[1]`, `TestFoo::test_bar`)."""
    name = instance["mutation"]["function"].split(".")[-1].strip("_").lower()
    return any(f"_{name}" in "_" + test.split("::")[-1].lower() for test in instance["FAIL_TO_PASS"])


def library_of(repo: str) -> str:
    """`toolz==1.2.0` and `toolz` are the library `toolz` (instances name the archive they came from)."""
    return str(repo).split("==")[0].strip().lower()
