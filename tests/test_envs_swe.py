"""SWE tasks: mutation operators, the sdist task builder on toolz (SWE-bench rows over a real git mirror by
default; the older instances format converted on load), grading on the one SWE path in the real local sandbox."""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import re
from pathlib import Path

import pytest
from jobs import run_with_progress

from rollway.envs.base import Episode
from rollway.envs.config import TasksConfig
from rollway.envs.factory import build_taskset
from rollway.envs.mutations import Mutation, apply_mutation, find_mutations
from rollway.envs.pytest_report import parse_pytest_output
from rollway.envs.swe import load_instances
from rollway.envs.swe_build import make_patch, ordered_candidates
from rollway.envs.swe_export import rows_from_instances
from rollway.envs.swe_grading import answer_patch
from rollway.runners import cmd_tasks
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.local import LocalSandboxProvider

SDIST = "toolz==1.2.0"


def mutations_of(source: str) -> list[Mutation]:
    return find_mutations("m.py", source.encode())


def mutated(source: str, mutation: Mutation) -> str:
    return apply_mutation(source.encode(), mutation).decode()


@pytest.mark.parametrize(
    ("source", "operator", "original", "replacement", "expected_line"),
    [
        ("def f(a, b):\n    return a < b  # keep\n", "compare", "<", "<=", "    return a <= b  # keep"),
        ("def f(a, b):\n    return a in b\n", "compare", "in", "not in", "    return a not in b"),
        ("def f(a, b):\n    return a is not b\n", "compare", "is not", "is", "    return a is b"),
        ("def f(a, b):\n    return a and b\n", "boolean", "and", "or", "    return a or b"),
        ("def f(a):\n    return not (a or 1)\n", "not_removed", "not ", "", "    return (a or 1)"),
        ("def f(a, b):\n    return a + b\n", "arithmetic", "+", "-", "    return a - b"),
        ("def f(a, b):\n    return a * b\n", "arithmetic", "*", "//", "    return a // b"),
        ("def f(a):\n    a += 2\n", "arithmetic", "+=", "-=", "    a -= 2"),
        ("def f(a):\n    return a[:3]\n", "off_by_one", "3", "4", "    return a[:4]"),
        ("def f(a, n):\n    return a[:n]\n", "slice_bound", "n", "n + 1", "    return a[:n + 1]"),
        ("def f(a):\n    return True\n", "return_value", "True", "False", "    return False"),
        ("def f(a):\n    return a.x\n", "return_value", "a.x", "None", "    return None"),
        ("def f(a):\n    if a.ok:\n        return 1\n", "condition_negated", "a.ok", "not (a.ok)",
         "    if not (a.ok):"),
    ],
)
def test_each_operator_edits_only_its_span(source, operator, original, replacement, expected_line):
    found = [m for m in mutations_of(source) if m.operator == operator and m.original == original
             and m.replacement == replacement]
    assert len(found) == 1, [(m.operator, m.original, m.replacement) for m in mutations_of(source)]
    new = mutated(source, found[0])
    ast.parse(new)
    assert expected_line in new.splitlines()
    # Everything outside the span is byte-identical.
    m = found[0]
    assert new.encode()[: m.start] == source.encode()[: m.start]
    assert new.encode()[m.start + len(m.replacement.encode()) :] == source.encode()[m.end :]


def test_mutations_skip_docstrings_strings_and_module_level_code():
    source = 'X = 1 + 2\n\ndef f(s):\n    """Doc 1 < 2."""\n    return "a" + s\n'
    kinds = {(m.operator, m.original) for m in mutations_of(source)}
    assert ("arithmetic", "+") not in kinds  # string concatenation and module-level code stay
    assert all(m.function == "f" for m in mutations_of(source))


def test_mutation_spans_are_byte_offsets_with_non_ascii_text():
    source = 'def f(a):\n    x = "héllo"; return a < 3\n'
    for m in mutations_of(source):
        ast.parse(mutated(source, m))
    lt = next(m for m in mutations_of(source) if m.original == "<")
    assert "return a <= 3" in mutated(source, lt)


def test_apply_mutation_refuses_a_different_file():
    m = next(iter(mutations_of("def f(a):\n    return a < 1\n")))
    with pytest.raises(ValueError, match="rebuild"):
        apply_mutation(b"def f(a):\n    return b\n", m)


def test_candidate_order_is_deterministic_for_a_seed():
    files = {"m.py": b"def f(a, b):\n    if a < b and b:\n        return a + 1\n    return b[1:a]\n"}
    assert ordered_candidates(files, 3) == ordered_candidates(files, 3)
    assert ordered_candidates(files, 3) != ordered_candidates(files, 4)


def test_instance_ids_are_unique_when_two_files_define_the_same_function():
    """python-slugify 9.2.0 defines `_decode_entities` in slugify.py and _legacy.py: both files' first
    bug in it were named `..._decode_entities__5` and the family's file could not be loaded."""
    from rollway.envs.swe_build import _instance_id, _per_function_index

    source = b"def _decode(a):\n    return a[1:] + 1\n"
    candidates = ordered_candidates({"pkg/new.py": source, "pkg/_legacy.py": source}, 0)
    index = _per_function_index(candidates)
    ids = [_instance_id("python-slugify==9.2.0", m, index[m]) for m in candidates]
    assert len(set(ids)) == len(ids) == 2 * len(find_mutations("pkg/new.py", source))
    single = ordered_candidates({"pkg/new.py": source}, 0)  # one file: the ids stay what they were
    assert sorted(_instance_id("x==1", m, k) for m, k in _per_function_index(single).items()) == \
        sorted(f"x__1___decode__{k}" for k in range(len(single)))


def test_parse_pytest_summary():
    text = (".F\n=========================== short test summary info ============================\n"
            "PASSED t/test_a.py::test_ok\nFAILED t/test_a.py::test_bad[1 - 2] - AssertionError: assert 1 == 2\n"
            "ERROR t/test_b.py - ImportError: no module\n1 failed, 1 passed, 1 error in 0.1s\n")
    report = parse_pytest_output(text)
    assert report.outcomes == {"t/test_a.py::test_ok": "passed", "t/test_a.py::test_bad[1 - 2]": "failed"}
    assert report.messages["t/test_a.py::test_bad[1 - 2]"] == "AssertionError: assert 1 == 2"
    assert report.collection_errors == {"t/test_b.py": "ImportError: no module"}


def test_built_rows_run_their_tests_with_plain_asserts(tmp_path):
    """The command of rollway's own rows (and of the build's test runs) leaves the test modules' asserts
    as written: rewriting each module anew in a fresh tree was half a toolz run's CPU, and a status does
    not depend on it (a false assert still fails; only its message is shorter)."""
    import os
    import subprocess
    import sys

    from rollway.envs.pytest_report import pytest_command

    (tmp_path / "test_a.py").write_text("def test_not_rewritten():\n    assert '@pytest_ar' not in globals()\n\n"
                                        "def test_false():\n    assert 1 + 1 == 3\n")
    ran = subprocess.run(["bash", "-c", pytest_command(["test_a.py"], python=sys.executable)], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    report = parse_pytest_output(ran.stdout)
    assert report.outcomes == {"test_a.py::test_not_rewritten": "passed", "test_a.py::test_false": "failed"}, ran.stdout


def test_answer_patch_drops_tool_state_and_test_edits():
    patch = (make_patch("pkg/m.py", b"a = 1\n", b"a = 2\n") + make_patch(".rollway/x", b"", b"y\n")
             + make_patch("pkg/tests/test_m.py", b"x\n", b"y\n"))
    kept, dropped = answer_patch(patch, {"pkg/tests/test_m.py"})
    assert "pkg/m.py" in kept and ".rollway" not in kept and "test_m" not in kept
    assert dropped == [".rollway/x", "pkg/tests/test_m.py"]


# ---------------------------------------------------------------- end to end on toolz


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rollway tasks")
    cmd_tasks.add_arguments(parser)
    return cmd_tasks.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def toolz_instances(toolz_two_tasks) -> Path:
    """Two toolz tasks, built once per session (conftest.py)."""
    return toolz_two_tasks


@pytest.fixture
def provider() -> LocalSandboxProvider:
    return LocalSandboxProvider()


@pytest.mark.slow
def test_build_writes_swe_bench_style_instances(toolz_instances):
    rows = load_instances(toolz_instances)
    assert len(rows) == 2
    for row in rows:
        assert row["instance_id"].startswith("toolz__1.2.0__")
        assert row["repo"] == SDIST and len(row["snapshot"]["sha256"]) == 64
        assert 1 <= len(row["FAIL_TO_PASS"]) <= 5 and row["PASS_TO_PASS"]
        assert not set(row["FAIL_TO_PASS"]) & set(row["PASS_TO_PASS"])
        assert row["patch"].startswith("diff --git a/") and row["test_patch"] == ""
        # The statement names the failing tests but never shows the mutated source line.
        assert row["FAIL_TO_PASS"][0] in row["problem_statement"]
        assert "--assert=plain" in row["test_command"]  # statuses without assert rewriting (half the CPU) ...
    # ... while the statements show pytest's assert detail, as a user running the tests would see it.
    assert any(re.search(r"`: assert \S", row["problem_statement"]) for row in rows), [r["problem_statement"] for r in rows]
    for row in rows:
        changed = [ln[1:].strip() for ln in row["patch"].splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
        assert not any(line and line in row["problem_statement"] for line in changed)


@pytest.mark.slow
def test_build_writes_swe_bench_rows_over_git_by_default(toolz_instances, toolz_swebench_row):
    """The default build (the session's `toolz_swebench_row`, conftest.py): SWE-bench rows whose repository
    (a real git mirror next to the rows file) holds the clean sdist and the bug as one commit on it; the
    build is deterministic for a seed, so its row is the one the older instances file of the same seed
    converts to (same commits)."""
    import subprocess

    [row] = [json.loads(line) for line in (toolz_swebench_row / "rows.jsonl").read_text().splitlines()]
    assert row["repo"] == "pypi/toolz" and json.loads(row["FAIL_TO_PASS"]) and "mutation" not in row
    git = ["git", "-C", str(toolz_swebench_row / "mirror" / "pypi__toolz.git")]
    parent = subprocess.run([*git, "rev-parse", f"{row['base_commit']}^"], capture_output=True, text=True, check=True)
    assert parent.stdout.strip() == row["environment_setup_commit"]
    converted, mirror = rows_from_instances(toolz_instances)
    assert converted[0] == row and (Path(mirror) / "pypi__toolz.git").is_dir()
    assert converted[0]["instance_id"] == load_instances(toolz_instances)[0]["instance_id"]


@pytest.mark.slow
def test_verify_gold_resolves_and_empty_does_not(toolz_instances, capsys):
    """An instances file, converted on load, in the bubblewrap jail (the tree exported from the mirror).
    The converted rows are SWE-bench rows of the one SWE task set: their check in containers of each
    instance's image is tests/test_swebench_tasks.py's (the same loader, images and grader)."""
    assert cli(["verify", str(toolz_instances), "--json", "--sandbox", "local"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["total"], summary["gold_resolved"], summary["empty_resolved"]) == (2, 2, 0)


def local_taskset(path: Path, **fields):
    return build_taskset(TasksConfig(type="swe", path=str(path), **fields), SandboxConfig(type="local"))


@pytest.mark.slow
def test_grade_reports_apply_failure_and_test_timeout(toolz_instances, provider):
    row = load_instances(toolz_instances)[0]
    taskset = local_taskset(toolz_instances)
    inst = taskset.instances[row["instance_id"]]
    bad = make_patch(row["mutation"]["path"], b"no such text\n", b"other text\n")
    grade = asyncio.run(taskset.grade_patch(inst, bad, provider))
    assert (grade.reward, grade.stop_reason) == (0.0, "patch_failed")
    # An endless loop in the library (what a bad patch may leave) runs into the test time limit.
    init = row["mutation"]["path"].split("/")[0] + "/__init__.py"
    short = local_taskset(toolz_instances, test_timeout_s=5)
    source = Path(short.spec_for(inst).source_dir, init).read_text().splitlines()
    hang = (f"--- a/{init}\n+++ b/{init}\n@@ -{len(source)},1 +{len(source)},3 @@\n {source[-1]}\n"
            "+while True:\n+    pass\n")
    grade = asyncio.run(short.grade_patch(inst, hang, provider))
    assert (grade.reward, grade.stop_reason) == (0.0, "test_timeout"), grade.details


@pytest.mark.slow
def test_taskset_grades_the_episode_sandbox(toolz_instances, provider):
    """`tasks.type: swe` over an instances file: converted on load, the workspace is the bug's commit
    exported from the mirror, graded by the SWE-bench path."""
    taskset = local_taskset(toolz_instances)
    task = taskset.tasks()[0]
    row = {r["instance_id"]: r for r in load_instances(toolz_instances)}[task.task_id]
    assert taskset.default_tools == ("bash", "editor", "search", "finish")
    path = row["mutation"]["path"]
    clean = (Path(row["snapshot"]["path"]) / path).read_text()
    assert (Path(taskset.sandbox_spec(task).source_dir) / path).read_text() != clean

    async def episode(fix: bool, edit_tests: bool) -> float:
        sandbox = await provider.create(taskset.sandbox_spec(task), f"swe-test-{fix}-{edit_tests}")
        try:
            await sandbox.write_file(".rollway/notes.txt", "tool state, not graded\n")
            if fix:  # what a successful agent leaves behind: the original source
                await sandbox.write_file(path, clean)
            if edit_tests:  # deleting the failing test must not count
                test_file = row["FAIL_TO_PASS"][0].split("::")[0]
                await sandbox.write_file(test_file, "")
            return (await taskset.grade(task, sandbox, provider, Episode.outside_run(task))).reward
        finally:
            await sandbox.destroy()

    assert asyncio.run(episode(fix=True, edit_tests=False)) == 1.0
    assert asyncio.run(episode(fix=False, edit_tests=True)) == 0.0


def test_a_clean_suite_that_never_ends_is_named_as_such_after_one_run(tmp_path):
    """click 8.5.1's suite hung in the jail: the baseline waited out 900 s twice, then said "no test
    passes ... install the test dependencies". One timed-out clean run is enough to know, and the
    reason is the timeout. A real jail runs real pytest on a made-up library whose test sleeps."""
    from rollway.envs.swe_build import BuildError, _Workspace, run_baseline

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mod.py").write_text("def f():\n    return 1\n")
    (tmp_path / "lib" / "test_mod.py").write_text("import time\nfrom mod import f\n\n"
                                                  "def test_f():\n    assert f() == 1\n\n"
                                                  "def test_waits():\n    time.sleep(3600)\n")
    work = _Workspace(tmp_path / "lib", sandbox_root=str(tmp_path / "jail"))
    runs, run = [], work.run
    work.run = lambda *args, **kwargs: runs.append(args) or run(*args, **kwargs)  # counts the runs only
    try:
        with pytest.raises(BuildError, match="did not finish in 4 s") as raised:
            run_baseline(work, lambda line: None, timeout_s=4)
    finally:
        work.close()
    assert len(runs) == 1  # one run waited out, not the three (first, second, again without broken files)
    assert "install the test dependencies" not in str(raised.value)


def test_build_reports_a_missing_sdist(tmp_path, capsys):
    code = cli(["build", "swe", "--sdist", "toolz", "--out", str(tmp_path / "x.jsonl")])
    assert code == 1 and "pin one version" in capsys.readouterr().err


def editor_fix_calls(patch: str) -> list[str]:
    """The gold patch as editor str_replace calls (hunk context + removed lines -> context + added)."""
    calls, path, old, new = [], None, [], []

    def flush() -> None:
        if old or new:
            args = {"command": "str_replace", "path": path, "old_str": "\n".join(old), "new_str": "\n".join(new)}
            calls.append(f"<tool_call>{json.dumps({'name': 'editor', 'arguments': args})}</tool_call>")
        old.clear()
        new.clear()

    for line in patch.splitlines():
        if line.startswith("+++ b/"):
            path = line[6:]
        elif line.startswith(("diff --git", "---", "+++", "index ")):
            continue
        elif line.startswith("@@"):
            flush()
        elif line[:1] in (" ", "-"):
            old.append(line[1:])
            if line[0] == " ":
                new.append(line[1:])
        elif line[:1] == "+":
            new.append(line[1:])
    flush()
    return calls


@pytest.mark.slow
def test_scripted_editor_fix_is_resolved_through_the_pipeline_and_doing_nothing_is_not(
        toolz_instances, broker, tmp_path):
    """`rollway up` on two built tasks: the scripted policy repairs the first with editor calls
    (the gold patch as str_replace) and only calls finish on the second."""
    import re
    import sys

    import yaml

    rows = load_instances(toolz_instances)
    fix, idle = rows[0], rows[1]
    finish = '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'
    cfg = {"run": {"name": "swe-e2e", "timeout_s": 400},
           "tasks": {"type": "swe", "path": str(toolz_instances)},
           "scheduler": {"group_size": 1, "episode_deadline_s": 300},
           # byte-level tokens (scripted policy): room for long editor calls and SWE prompts
           "agent": {"max_turns": 6, "max_tokens_per_turn": 4096, "max_total_tokens": 100000},
           "reward": {"concurrency": 2},
           "policy": {"type": "scripted", "script": [
               {"when": re.escape(fix["FAIL_TO_PASS"][0]), "turns": [*editor_fix_calls(fix["patch"]), finish]},
               {"when": "", "turns": [finish]}]}}
    config = tmp_path / "swe.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert not set(fix["FAIL_TO_PASS"]) & set(idle["FAIL_TO_PASS"])
    run_dir = tmp_path / "run"
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(config), "--run-dir", str(run_dir),
                          "--bootstrap", broker.bootstrap, "runtime.processes=one", f"topics.prefix=swe{tmp_path.name[-6:]}-"])
    assert out.returncode == 0, out.stderr[-3000:]
    trajs = {json.loads(x)["episode"]["task_id"]: json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()}
    assert trajs[fix["instance_id"]]["resolved"] and trajs[fix["instance_id"]]["reward"] == 1.0
    assert all(not o["is_error"] for t in trajs[fix["instance_id"]]["turns"] for o in t["observations"])
    assert not trajs[idle["instance_id"]]["resolved"] and trajs[idle["instance_id"]]["reward"] == 0.0
