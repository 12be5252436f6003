"""SWE-bench-family rows (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym) from JSONL or Parquet, read into one shape.

Field differences between the formats (what `normalise_row` maps):

- SWE-bench / SWE-Gym: `instance_id, repo, base_commit, problem_statement, hints_text, patch` (the gold
  fix), `test_patch, FAIL_TO_PASS, PASS_TO_PASS` (JSON strings in SWE-bench, lists in SWE-Gym),
  `version, environment_setup_commit`. SWE-Gym has no `environment_setup_commit`.
- SWE-smith: `instance_id, repo` (`swesmith/OWNER__NAME.COMMIT8`, a mirror of the clean repository at that
  commit), `patch` (the diff that INTRODUCES the bug), `FAIL_TO_PASS, PASS_TO_PASS` (lists),
  `image_name, problem_statement`; no `base_commit`, no `test_patch`. The starting tree is the clean
  commit with `patch` applied; the gold fix is `patch` reversed.
- R2E-Gym: `repo_name, docker_image, commit_hash, problem_statement, parsed_commit_content` (JSON: the
  fixing commit, with `old_commit_hash` its parent), `expected_output_json` (JSON: test name -> status
  after the fix), `execution_result_content`; no `instance_id` (made as `REPO__COMMIT`). Every test
  expected to pass after the fix must pass (all go to FAIL_TO_PASS; R2E does not split them). The gold
  fix is a `patch` column when present, else rendered from the structured `parsed_commit_content.file_diffs`
  (R2E-Gym's ParsedCommit layout, `envs/r2e_diffs.py`): non-test files make the gold patch, test files
  (R2E's rule) the `test_patch`.

rollway extensions any row may carry: `image_name`, `test_command`, `install` (a command run in the
repository when its image is built), `log_parser` (`pytest` or `unittest`), `repo_dir`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollway.envs.r2e_diffs import patch_from_file_diffs
from rollway.envs.task_data import (
    COMMIT,
    CONTAINER_DIR,
    IMAGE,
    REPO,
    SAFE_ID,
    check_name,
    check_row_size,
    check_tests,
    check_text,
    parse_row_json,
    read_json_lines,
    read_task_text,
)

FORMATS = ("swebench", "swe-gym", "swe-smith", "r2e-gym")


class RowError(ValueError):
    """A row cannot be read as an instance; the message names the row and the missing field."""


@dataclass
class SWEInstance:
    """One task in the SWE-bench schema, whatever format it was read from.

    Invariant: the starting tree is the repository at `base_commit` with `pre_patch` applied (empty
    except for SWE-smith rows); `patch` turns that tree into the fixed one."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str = ""
    """Gold fix (git diff); empty when the format ships none."""
    test_patch: str = ""
    """Applied after the model's patch, before the tests run (new or changed tests)."""
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    hints_text: str = ""
    version: str = ""
    environment_setup_commit: str = ""
    pre_patch: str = ""
    """Applied to `base_commit` to make the starting tree (SWE-smith's bug patch)."""
    image_name: str | None = None
    """The row's own image (SWE-smith `image_name`, R2E-Gym `docker_image`); used when it exists locally."""
    test_command: str | None = None
    install: str = ""
    log_parser: str = "auto"
    repo_dir: str = "/testbed"
    source_format: str = "swebench"

    def to_row(self) -> dict[str, Any]:
        """The row in SWE-bench's schema (lists as lists), with rollway's extensions."""
        row = asdict(self)
        row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = row.pop("fail_to_pass"), row.pop("pass_to_pass")
        return row


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a JSONL, JSON (a list) or Parquet file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"instances file {file} does not exist; pass a SWE-bench-schema JSONL or Parquet "
                                "file, or build one with `rollway tasks build swe`")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(file).to_pylist()
    elif file.suffix == ".json":
        rows = parse_row_json(str(file), read_task_text(file))
        if not isinstance(rows, list):
            raise RowError(f"{file} must hold a JSON list of rows")
    else:
        rows = read_json_lines(file)
    if file.suffix in (".parquet", ".json"):
        for number, row in enumerate(rows, start=1):
            check_row_size(f"{file} row {number}", json.dumps(row, default=str))
    if not rows:
        raise RowError(f"{file} holds no rows")
    return rows


def detect_format(row: dict[str, Any]) -> str:
    """Which of FORMATS a row is in, from the fields it has."""
    if "repo_name" in row and ("expected_output_json" in row or "parsed_commit_content" in row):
        return "r2e-gym"
    if str(row.get("repo", "")).startswith("swesmith/") or ("image_name" in row and "base_commit" not in row):
        return "swe-smith"
    if "environment_setup_commit" not in row and "base_commit" in row:
        return "swe-gym"
    return "swebench"


def _row_name(row: dict[str, Any]) -> str:
    """The row's id for an error message, quoted: control characters in it are shown escaped, not sent to a
    terminal (the rows file is not checked yet when it is named)."""
    return repr(str(row.get("instance_id") or row.get("repo_name") or "?")[:200])


def _tests(row: dict[str, Any], key: str) -> list[str]:
    """A test list stored as a list or as a JSON string (SWE-bench keeps JSON strings) of test ids."""
    value = row.get(key)
    if value is None or value == "":
        return []
    if isinstance(value, str):
        value = parse_row_json(f"row {_row_name(row)}: {key}", value)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RowError(f"row {_row_name(row)}: {key} must be a list of test ids (strings), or JSON text of one")
    return value


def _need(row: dict[str, Any], key: str, fmt: str, kind: type = object) -> Any:
    if row.get(key) in (None, ""):
        raise RowError(f"row {_row_name(row)} ({fmt} format) has no {key!r}; add it or pass tasks.row_format to "
                       "read the row as another format")
    if not isinstance(row[key], kind):
        raise RowError(f"row {_row_name(row)} ({fmt} format): {key} must be a {kind.__name__}")
    return row[key]


def _extensions(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("test_command", "install", "log_parser", "repo_dir", "image_name")
    return {k: row[k] for k in keys if row.get(k) not in (None, "")}


_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_PARSER = re.compile(r"[A-Za-z0-9_]{1,32}")


def check_swe_instance(inst: SWEInstance) -> SWEInstance:
    """Refuse fields that would leave their place: the id and repo name host folders (mirror lookups) and
    image tags, commits are git arguments, repo_dir and labels go into Dockerfiles and shell commands.
    TaskDataError names the task and the field."""
    task = check_name("?", "instance_id", inst.instance_id, SAFE_ID)
    check_name(task, "repo", inst.repo, REPO)
    check_name(task, "base_commit", inst.base_commit, COMMIT)
    if inst.environment_setup_commit:
        check_name(task, "environment_setup_commit", inst.environment_setup_commit, COMMIT)
    if inst.version:
        check_name(task, "version", inst.version, _VERSION)
    if inst.image_name is not None:
        check_name(task, "image_name", inst.image_name, IMAGE)
    check_name(task, "repo_dir", inst.repo_dir, CONTAINER_DIR)
    check_name(task, "log_parser", inst.log_parser, _PARSER)
    check_tests(task, "FAIL_TO_PASS", inst.fail_to_pass)
    check_tests(task, "PASS_TO_PASS", inst.pass_to_pass)
    for key in ("problem_statement", "patch", "test_patch", "pre_patch", "hints_text"):
        check_text(task, key, getattr(inst, key))
    # Commands: the task's own, run in its sandbox or its (network-less) image build; only kept whole.
    for key in ("install", "test_command"):
        if getattr(inst, key) is not None:
            check_text(task, key, getattr(inst, key), 1 << 16)
    return inst


def normalise_row(row: dict[str, Any], fmt: str = "auto") -> SWEInstance:
    """One row of any supported format as an SWEInstance, its fields checked (`check_swe_instance`)."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    return check_swe_instance(_normalise(row, fmt))


def _normalise(row: dict[str, Any], fmt: str) -> SWEInstance:
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt in ("swebench", "swe-gym"):
        return SWEInstance(
            instance_id=_need(row, "instance_id", fmt), repo=_need(row, "repo", fmt),
            base_commit=_need(row, "base_commit", fmt), problem_statement=row.get("problem_statement") or "",
            patch=row.get("patch") or "", test_patch=row.get("test_patch") or "",
            fail_to_pass=_tests(row, "FAIL_TO_PASS"), pass_to_pass=_tests(row, "PASS_TO_PASS"),
            hints_text=row.get("hints_text") or "", version=str(row.get("version") or ""),
            environment_setup_commit=row.get("environment_setup_commit") or "", source_format=fmt,
            **_extensions(row))
    if fmt == "swe-smith":
        return _swe_smith(row)
    if fmt == "r2e-gym":
        return _r2e_gym(row)
    raise RowError(f"unknown row format {fmt!r}; use one of {', '.join(FORMATS)} or auto")


def _swe_smith(row: dict[str, Any]) -> SWEInstance:
    repo = _need(row, "repo", "swe-smith", str)
    # swesmith/OWNER__NAME.COMMIT8: the mirror of OWNER/NAME, cut at that commit.
    match = re.fullmatch(r"(?:swesmith/)?(.+?)\.([0-9a-f]{7,40})", repo)
    base = row.get("base_commit") or (match.group(2) if match else None)
    if not base:
        raise RowError(f"row {_row_name(row)} (swe-smith): repo {repo!r} does not end in .COMMIT and the "
                       "row has no base_commit")
    bug = _need(row, "patch", "swe-smith", str)
    ext = _extensions(row)
    return SWEInstance(
        instance_id=_need(row, "instance_id", "swe-smith"), repo=match.group(1) if match else repo,
        base_commit=base, problem_statement=row.get("problem_statement") or "", patch=reverse_patch(bug),
        pre_patch=bug, fail_to_pass=_tests(row, "FAIL_TO_PASS"), pass_to_pass=_tests(row, "PASS_TO_PASS"),
        source_format="swe-smith", **ext)


def _json_field(row: dict[str, Any], key: str) -> dict[str, Any]:
    """An object stored as one or as JSON text ({} when absent)."""
    value = row.get(key)
    value = parse_row_json(f"row {_row_name(row)}: {key}", value) if isinstance(value, str) and value.strip() \
        else (value or {})
    if not isinstance(value, dict):
        raise RowError(f"row {_row_name(row)}: {key} must be a JSON object")
    return value


def _r2e_gym(row: dict[str, Any]) -> SWEInstance:
    commit = _json_field(row, "parsed_commit_content")
    base = row.get("base_commit") or commit.get("old_commit_hash")
    if not base:
        raise RowError(f"R2E-Gym row {_row_name(row)}@{str(row.get('commit_hash'))[:40]!r}: parsed_commit_content has "
                       "no old_commit_hash (the commit the task starts from)")
    expected = _json_field(row, "expected_output_json")
    must_pass = sorted(name for name, status in expected.items() if str(status).upper() in ("PASSED", "PASS"))
    diffs = commit.get("file_diffs") or []
    if not isinstance(diffs, list):
        raise RowError(f"row {_row_name(row)}: parsed_commit_content.file_diffs must be a list")
    try:  # the structured diffs are the row author's: any shape other than R2E-Gym's is this row's error
        gold, tests = patch_from_file_diffs(diffs)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as err:
        raise RowError(f"row {_row_name(row)}: parsed_commit_content.file_diffs is not in R2E-Gym's layout "
                       f"({type(err).__name__}: {str(err)[:100]})") from None
    patch = row.get("patch") or gold
    name = _need(row, "repo_name", "r2e-gym")
    ext = _extensions(row)
    if row.get("docker_image"):
        ext.setdefault("image_name", row["docker_image"])
    return SWEInstance(
        instance_id=row.get("instance_id") or f"{name}__{row.get('commit_hash', base)}", repo=name,
        base_commit=base, problem_statement=row.get("problem_statement") or "", patch=patch,
        test_patch=row.get("test_patch") or ("" if row.get("patch") else tests),
        fail_to_pass=_tests(row, "FAIL_TO_PASS") or must_pass,
        pass_to_pass=_tests(row, "PASS_TO_PASS"), source_format="r2e-gym", **ext)


def load_swe_instances(path: str | os.PathLike[str], fmt: str = "auto") -> list[SWEInstance]:
    """Every row of the file, normalised; RowError naming the first bad row."""
    instances = [normalise_row(row, fmt) for row in read_rows(path)]
    seen: set[str] = set()
    for inst in instances:
        if inst.instance_id in seen:
            raise RowError(f"instance_id {inst.instance_id!r} appears twice in {path}")
        seen.add(inst.instance_id)
    return instances


_HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$")


def reverse_patch(patch: str) -> str:
    """The diff that undoes `patch` (file headers, hunk ranges and +/- lines swapped; in each run of
    changed lines the removals come first, as diff tools write them)."""
    out: list[str] = []
    removed: list[str] = []
    added: list[str] = []

    def flush() -> None:
        out.extend(removed + added)
        removed.clear()
        added.clear()

    lines = patch.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            flush()
            old, new = line[4:], lines[i + 1][4:]
            out += ["--- " + _swap_prefix(new, "b/", "a/"), "+++ " + _swap_prefix(old, "a/", "b/")]
            i += 2
            continue
        hunk = _HUNK.match(line.rstrip("\n"))
        if line.startswith("+"):
            removed.append("-" + line[1:])
        elif line.startswith("-"):
            added.append("+" + line[1:])
        else:
            flush()
            if hunk:
                out.append(f"@@ -{hunk.group(2)} +{hunk.group(1)} @@{hunk.group(3)}\n")
            elif line.startswith("diff --git ") and len(line.split()) == 4:
                parts = line.split()
                out.append(f"diff --git {_swap_prefix(parts[3], 'b/', 'a/')} {_swap_prefix(parts[2], 'a/', 'b/')}\n")
            elif line.startswith("new file mode"):
                out.append(line.replace("new file", "deleted file", 1))
            elif line.startswith("deleted file mode"):
                out.append(line.replace("deleted file", "new file", 1))
            else:
                out.append(line)
        i += 1
    flush()
    return "".join(out)


def _swap_prefix(path: str, old: str, new: str) -> str:
    return new + path[len(old):] if path.startswith(old) else path
