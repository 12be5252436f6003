"""Task rows are data, never paths or code the host trusts: checks every loader applies to a row's fields.

A rows file may come from anyone (a downloaded dataset, a shared instances file). Its fields end up in host
paths (cache folders, mirror lookups, files rewritten by `rollway tasks verify` as root), in Dockerfiles,
image tags, git and pip arguments, and in shell commands. Each check here refuses a value that could
leave its place (absolute paths, `..`, a leading `-` read as an option, newlines that start a new
Dockerfile instruction) with a TaskDataError naming the task and the field, so `tasks verify`, `eval` and
`up` all refuse the file when they load it, before anything touches the host.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

MAX_ROW_CHARS = 32 * 2**20
"""One row's size in its file (JSON text): SWE-bench's largest rows are a few MB; beyond this a row is
refused rather than held (and copied into every message about the task)."""
MAX_TESTS = 100_000
"""Test ids per FAIL_TO_PASS / PASS_TO_PASS list."""
MAX_LINE_CHARS = 4096
"""A single-line field: an id, a name, a path, one test id."""

SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")
"""Instance ids: a folder name, part of a sandbox name and of an image tag (`__`, `.`, `-` as in SWE-bench)."""
REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}(/[A-Za-z0-9][A-Za-z0-9._-]{0,99})?")
"""`OWNER/NAME` or `NAME`: a path under the mirror folder and a part of image tags."""
COMMIT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:+-]{0,199}")
"""A git revision or a rollway `sdist-sha256:HEX`: never an option (no leading `-`), no spaces."""
IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}")
"""A docker image reference."""
CONTAINER_DIR = re.compile(r"/[A-Za-z0-9._/+-]{0,254}")
"""An absolute folder inside an image (`repo_dir`): used in Dockerfiles and shell commands unquoted."""
SHA256 = re.compile(r"[0-9a-f]{64}")


class TaskDataError(ValueError):
    """A task row holds a value rollway refuses to use; the message names the task, the field and the fix."""


def refuse(task: str, field: str, problem: str) -> TaskDataError:
    return TaskDataError(f"task {task!r}, field {field!r}: {problem}; fix the rows file (task data is used as "
                         "paths, names and arguments, so it must stay inside its task's tree)")


def check_text(task: str, field: str, value: Any, max_chars: int = MAX_ROW_CHARS) -> str:
    """Free text (a problem statement, a patch): a string without NUL bytes, bounded."""
    if not isinstance(value, str):
        raise refuse(task, field, f"expected text, got {type(value).__name__}")
    if "\0" in value:
        raise refuse(task, field, "contains a NUL byte")
    if len(value) > max_chars:
        raise refuse(task, field, f"is {len(value)} characters long (at most {max_chars})")
    return value


def check_line(task: str, field: str, value: Any) -> str:
    """One line: no newline, carriage return or other control character (they split commands, log lines
    and Dockerfile instructions)."""
    text = check_text(task, field, value, MAX_LINE_CHARS)
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise refuse(task, field, f"{text[:80]!r} contains a newline or another control character")
    return text


def check_name(task: str, field: str, value: Any, pattern: re.Pattern[str] = SAFE_ID) -> str:
    """A value that becomes part of a path, a tag or an argument: it must match `pattern` whole."""
    text = check_line(task, field, value)
    if not pattern.fullmatch(text) or ".." in text:
        raise refuse(task, field, f"{text[:80]!r} is not a safe name (allowed: {pattern.pattern}, no '..')")
    return text


def check_rel_path(task: str, field: str, value: Any) -> str:
    """A path inside the task's tree: relative, no `..`, no backslash or drive tricks; returned normalised."""
    text = check_line(task, field, value)
    path = PurePosixPath(text)
    if not text or path.is_absolute() or text.startswith("~") or "\\" in text:
        raise refuse(task, field, f"{text!r} must be a relative path inside the task's tree")
    if ".." in path.parts:
        raise refuse(task, field, f"{text!r} may not contain '..'")
    if str(path) in ("", "."):
        raise refuse(task, field, f"{text!r} names the tree itself, not a file in it")
    return str(path)


def check_tests(task: str, field: str, value: Any) -> list[str]:
    """A FAIL_TO_PASS / PASS_TO_PASS list: test ids, one line each; the file part of a pytest node id
    (before `::`) is a path inside the tree. (Commands quote them; this keeps them single lines.)"""
    if not isinstance(value, list):
        raise refuse(task, field, f"expected a list of test ids, got {type(value).__name__}")
    if len(value) > MAX_TESTS:
        raise refuse(task, field, f"lists {len(value)} tests (at most {MAX_TESTS})")
    tests = [check_line(task, f"{field}[{i}]", t) for i, t in enumerate(value)]
    for i, test in enumerate(tests):
        if "::" in test:
            check_rel_path(task, f"{field}[{i}]", test.split("::", 1)[0])
        if test.startswith("-"):
            raise refuse(task, f"{field}[{i}]", f"{test[:80]!r} starts with '-' (it would be read as an option)")
    return tests


def resolve_in_tree(task: str, field: str, root: Path, rel: str) -> Path:
    """Host path of `rel` under `root`, refusing one that leaves the tree through a symlink (a planted
    link in a snapshot would make a write land on any host file)."""
    clean = check_rel_path(task, field, rel)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, clean))
    if not real.startswith(real_root + os.sep):
        raise refuse(task, field, f"{clean!r} leads out of the task's tree (through a symlink)")
    if os.path.islink(os.path.join(real_root, clean)):
        raise refuse(task, field, f"{clean!r} is a symlink; the file itself must be in the tree")
    return Path(real)


def read_task_text(path: Path) -> str:
    """A task data file's text (a rows file, a task folder's file); TaskDataError naming it when not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TaskDataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def parse_row_json(where: str, text: str) -> Any:
    """JSON text of a rows file (`where`: the file, and the line); TaskDataError naming it when invalid."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise TaskDataError(f"{where} is not valid JSON ({str(exc)[:100]})") from None


def read_json_lines(path: Path) -> list[Any]:
    """The rows of a JSON Lines file (blank lines skipped), each checked for size and parsed; TaskDataError
    naming the file and the line of the first that is too long or not JSON."""
    rows = []
    for number, line in enumerate(read_task_text(path).splitlines(), start=1):
        if line.strip():
            check_row_size(f"{path} line {number}", line)
            rows.append(parse_row_json(f"{path} line {number}", line))
    return rows


def check_row_size(where: str, line: str) -> None:
    if len(line) > MAX_ROW_CHARS:
        raise TaskDataError(f"{where}: a row of {len(line)} characters (at most {MAX_ROW_CHARS}); split or trim it")
