"""rollway's older SWE instances format (`rollway tasks build swe --format instances`): a bug injected into an
unpacked source archive. Read here (`load_instances`, every field checked) for the task sets built on the
mutations themselves (envs/buglocal.py); SWE tasks run on SWE-bench rows over git (envs/swebench.py),
which converts an instances file on load (envs/swe_export.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from rollway.base.files import publish_dir
from rollway.envs.mutations import Mutation, apply_mutation
from rollway.envs.sdist import SdistError, cache_root, ensure_snapshot, parse_requirement, snapshot_dir
from rollway.envs.task_data import (
    SHA256,
    TaskDataError,
    check_line,
    check_name,
    check_rel_path,
    check_tests,
    check_text,
    read_json_lines,
    refuse,
    resolve_in_tree,
)
from rollway.sandboxes.task_tree import normalise_tree

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
    rows = read_json_lines(file)
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

    def fill(scratch: Path) -> Path:
        shutil.copytree(snapshot, scratch / "tree", symlinks=True)
        # The file to mutate must be a real file of the tree: a symlink in the snapshot would carry the
        # write to wherever it points.
        target = resolve_in_tree(task, "mutation.path", scratch / "tree", mutation.path)
        target.write_bytes(apply_mutation(target.read_bytes(), mutation))
        normalise_tree(scratch / "tree")  # the mutated file must not be the newest one (issue 39)
        return scratch / "tree"

    return publish_dir(dest, fill)
