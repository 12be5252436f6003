"""SWE task set: repair a bug injected into a library snapshot; graded by FAIL_TO_PASS and PASS_TO_PASS tests."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import TasksConfig
from rollway.envs.graded_diff import graded_diff
from rollway.envs.mutations import Mutation, apply_mutation
from rollway.envs.pytest_guard import GRADE_DIR, run_guarded, tail
from rollway.envs.pytest_report import node_file, pytest_command
from rollway.envs.sdist import SdistError, cache_root, ensure_snapshot, parse_requirement, snapshot_dir
from rollway.envs.split import select_tasks
from rollway.envs.swe_grading import GradingEnvError
from rollway.envs.task_data import (
    SHA256,
    TaskDataError,
    check_line,
    check_name,
    check_rel_path,
    check_row_size,
    check_tests,
    check_text,
    refuse,
    resolve_in_tree,
)
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec

SWE_SYSTEM_PROMPT = """You are a software engineer fixing a bug in a Python repository.
The repository is checked out in your working directory. Tools run there; nothing else persists.
Work like this:
1. Read the issue and run the failing tests to see the failure yourself.
2. Locate the cause in the library source (not in the tests): search, read the code.
3. Make the smallest change that fixes it. Do not edit or delete tests.
4. Re-run the failing tests and the rest of the affected test files.
5. Call finish when the tests pass. Your final workspace changes are what gets graded."""

def load_instances(path: str | os.PathLike[str],
                   cache_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Instances from a JSONL file written by `rollway tasks build swe`, every field checked (task data
    names host paths: see `check_instance`); TaskDataError naming the task and field of the first bad one."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"instances file {file} does not exist; create it with "
                                "`rollway tasks build swe --sdist NAME==VERSION --out FILE`")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if line.strip():
            check_row_size(f"{file} line {number}", line)
            rows.append(json.loads(line))
    if not rows:
        raise ValueError(f"{file} holds no instances; rebuild it with `rollway tasks build swe`")
    seen: set[str] = set()
    for row in rows:
        check_instance(row, cache_dir)
        if row["instance_id"] in seen:
            raise TaskDataError(f"instance_id {row['instance_id']!r} appears twice in {file}")
        seen.add(row["instance_id"])
    return rows


def check_instance(row: Any, cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Refuse a row whose fields could leave their place: ids and names that become folder names, paths
    that must stay inside the snapshot, a snapshot that must be rollway's own (under the cache)."""
    if not isinstance(row, dict):
        raise TaskDataError(f"an instance is {type(row).__name__}, not an object; rebuild the instances file")
    task = check_name("?", "instance_id", row.get("instance_id"))
    for key in ("problem_statement", "patch", "test_patch", "bug_patch"):
        if key in row:
            check_text(task, key, row[key])
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        check_tests(task, key, row.get(key))
    if not row["FAIL_TO_PASS"]:
        raise refuse(task, "FAIL_TO_PASS", "is empty (an instance needs a failing test)")
    for key in ("test_files", "python_path"):
        values = row.get(key, [] if key == "test_files" else ["."])
        if not isinstance(values, list):
            raise refuse(task, key, f"expected a list of paths, got {type(values).__name__}")
        for i, value in enumerate(values):
            if value != ".":
                check_rel_path(task, f"{key}[{i}]", value)
    _check_mutation(task, row.get("mutation"))
    snapshot = row.get("snapshot")
    if not isinstance(snapshot, dict):
        raise refuse(task, "snapshot", "is missing; rebuild the instances file")
    for field, value in (("repo", row.get("repo")), ("snapshot.sdist", snapshot.get("sdist"))):
        try:
            parse_requirement(check_line(task, field, value))
        except SdistError as exc:
            raise refuse(task, field, str(exc)) from exc
    sha = check_name(task, "snapshot.sha256", snapshot.get("sha256"), SHA256)
    if snapshot.get("path") is not None:
        recorded = Path(check_line(task, "snapshot.path", snapshot["path"]))
        expected = snapshot_dir(cache_dir, snapshot["sdist"], sha)
        if os.path.realpath(recorded) != os.path.realpath(expected):
            raise refuse(task, "snapshot.path", f"{recorded} is not rollway's snapshot folder {expected} (snapshots "
                         "live in the cache: pass the cache the instances were built with, tasks.cache_dir or "
                         "--cache, or drop the field to fetch the archive again)")


def _check_mutation(task: str, mutation: Any) -> None:
    if not isinstance(mutation, dict):
        raise refuse(task, "mutation", "is missing or not an object; rebuild the instances file")
    check_rel_path(task, "mutation.path", mutation.get("path"))
    for key in ("start", "end", "line"):
        if not isinstance(mutation.get(key), int) or mutation[key] < 0:
            raise refuse(task, f"mutation.{key}", "must be a non-negative integer")
    for key in ("original", "replacement", "operator", "function"):
        check_text(task, f"mutation.{key}", mutation.get(key), 4096)


def prepare_buggy_copy(instance: dict[str, Any], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The task's starting tree (snapshot + injected bug), made once per instance under the cache."""
    mutation = Mutation.from_dict(instance["mutation"])
    task = check_name("?", "instance_id", instance["instance_id"])
    # Same instance content, same folder, in every process (hash() is salted per process).
    tag = hashlib.sha256(json.dumps([instance["snapshot"]["sha256"], instance["mutation"]]).encode()).hexdigest()[:12]
    dest = cache_root(cache_dir) / "buggy" / f"{task}-{tag}"
    if dest.is_dir():
        return dest
    snapshot = ensure_snapshot(instance["snapshot"], cache_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".prepare-"))
    try:
        shutil.copytree(snapshot, tmp / "tree", symlinks=True)
        # The file to mutate must be a real file of the tree: a symlink in the snapshot would carry the
        # write to wherever it points.
        target = resolve_in_tree(task, "mutation.path", tmp / "tree", mutation.path)
        target.write_bytes(apply_mutation(target.read_bytes(), mutation))
        try:
            os.rename(tmp / "tree", dest)  # atomic: workers racing here all see a complete copy
        except OSError:
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def answer_patch(patch: str, test_files: list[str], python_path: tuple[str, ...] = (".",),
                 runner_files: frozenset[str] = frozenset()) -> tuple[str, list[str]]:
    """The part of an agent's diff that is graded, and the files left out: tool state, bytecode, the
    graded test files themselves (tests are reset, as in SWE-bench, so editing them cannot pass) and
    files that change how the tests run (conftest.py, pytest config, .pth...: envs/graded_diff.py)."""
    diff = graded_diff(patch, set(test_files), python_path, runner_files)
    return diff.patch, diff.ignored + diff.tests + diff.runner + diff.unsafe


def _count(expected: list[str], statuses: dict[str, str]) -> dict[str, Any]:
    failed = [t for t in expected if statuses.get(t) != "PASSED"]
    return {"passed": len(expected) - len(failed), "total": len(expected), "failed": failed[:20]}


async def grade_patch(instance: dict[str, Any], patch: str, provider: SandboxProvider, *,
                      test_timeout_s: float = 120.0, cache_dir: str | None = None) -> Grade:
    """Apply `patch` to a fresh sandbox of the buggy tree and run the instance's tests there.

    Reward 1.0 only when every FAIL_TO_PASS and PASS_TO_PASS test passes in pytest's signed report
    (envs/pytest_guard.py). The grading sandbox is destroyed before returning, whatever happens."""
    spec = SandboxSpec(source_dir=str(prepare_buggy_copy(instance, cache_dir)))
    sandbox = await provider.create(spec, f"grade-{_safe(instance['instance_id'])}-{uuid.uuid4().hex[:8]}")
    try:
        return await _grade_in(sandbox, instance, patch, test_timeout_s)
    finally:
        await sandbox.destroy()


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:60]


async def _grade_in(sandbox: Sandbox, instance: dict[str, Any], patch: str, timeout_s: float) -> Grade:
    f2p, p2p = instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"]
    roots = tuple(instance.get("python_path", ["."]))
    command = pytest_command(sorted({node_file(t) for t in f2p + p2p}), python_path=roots)
    # The runner is checked on the unpatched tree: a run the patch breaks is then the patch's 0.
    probe = await run_guarded(sandbox, command, timeout_s, probe=True)
    if probe.report is None:
        raise GradingEnvError(f"env_error: pytest did not start on the unpatched tree of {instance['instance_id']} "
                              f"({probe.problem}, exit {probe.exit_code}): {probe.output[-300:]}")
    diff = graded_diff(patch, set(instance["test_files"]), roots, frozenset(probe.plugin_files))
    details: dict[str, Any] = {**diff.details(), "patch_chars": len(diff.patch), "report": "signed"}
    if diff.patch.strip():
        await sandbox.write_file(f"{GRADE_DIR}/answer.patch", diff.patch)
        applied = await sandbox.exec(
            # The ceiling stops git from finding an enclosing repository, where it would skip paths.
            f'GIT_CEILING_DIRECTORIES="$(dirname "$PWD")" git apply --whitespace=nowarn {GRADE_DIR}/answer.patch 2>&1 '
            f"|| patch -p1 --batch --forward < {GRADE_DIR}/answer.patch 2>&1", timeout_s=60)
        if applied.exit_code != 0:
            details["apply_output"] = tail(applied.output, 2000)
            return Grade(0.0, False, stop_reason="apply_failed", details=details)
    ran = await run_guarded(sandbox, command, timeout_s)
    if ran.timed_out:
        details["timeout_s"] = timeout_s
        return Grade(0.0, False, stop_reason="test_timeout", details=details)
    if ran.report is None:
        details.update(outcome="no_report", reason=f"no valid test report ({ran.problem}, exit {ran.exit_code})",
                       log_tail=tail(ran.output))
        return Grade(0.0, False, details=details)
    details["fail_to_pass"] = _count(f2p, ran.statuses)
    details["pass_to_pass"] = _count(p2p, ran.statuses)
    resolved = not details["fail_to_pass"]["failed"] and not details["pass_to_pass"]["failed"]
    details["outcome"] = "resolved" if resolved else "unresolved"
    if not resolved:
        details["log_tail"] = tail(ran.output)
    return Grade(1.0 if resolved else 0.0, resolved, details=details)


def task_prompt(instance: dict[str, Any]) -> str:
    return (f"Repository: {instance['repo']} (source distribution, checked out in the working directory).\n\n"
            f"Issue:\n{instance['problem_statement']}\n\n"
            "Run a failing test with e.g. `python -m pytest -q "
            f"{instance['FAIL_TO_PASS'][0]}`.")


class SWETaskSet(TaskSet):
    """Tasks from an instances file; each episode starts from the buggy tree of its instance."""

    system_prompt = SWE_SYSTEM_PROMPT
    default_tools = ("bash", "editor", "search", "finish")

    def __init__(self, cfg: TasksConfig) -> None:
        if not cfg.path:
            raise ValueError("tasks.type=swe needs tasks.path, the instances file written by "
                             "`rollway tasks build swe ... --out FILE`")
        self.cfg = cfg
        self.instances = {row["instance_id"]: row for row in load_instances(cfg.path, cfg.cache_dir)}
        self._tasks = select_tasks(
            [Task(iid, task_prompt(row), {"repo": row["repo"]}) for iid, row in self.instances.items()], cfg)

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec(source_dir=str(prepare_buggy_copy(self.instances[task.task_id], self.cfg.cache_dir)))

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        return await grade_patch(self.instances[task.task_id], await sandbox.diff(), provider,
                                 test_timeout_s=self.cfg.test_timeout_s, cache_dir=self.cfg.cache_dir)
