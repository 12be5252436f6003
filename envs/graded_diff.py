"""The graded part of an agent's diff: what may change the code under test, never how the tests run.

The agent is an adversary. Its diff is applied to a fresh copy of the task's tree and the tests are
run there, so anything in it that pytest or Python read *before or around* the tests could turn a
failure into a pass: conftest.py, sitecustomize.py, .pth files, pytest configuration, plugin modules,
installed-distribution metadata (entry points autoload plugins), a module that shadows the standard
library or pytest itself on the import path. Such sections are dropped (and listed in the grade's
details), as are symlinks and submodules (which can point at test files or out of the tree), paths
under `.git/`, and any section whose paths cannot be parsed (fail closed).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

# Workspace paths never graded: tool state and bytecode (not the agent's answer).
IGNORED = re.compile(r"(^|/)(\.rollway|__pycache__|\.pytest_cache)(/|$)|\.py[co]$")

# Files whose content configures pytest or Python start-up wherever they sit.
RUNNER_NAMES = frozenset({
    "conftest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini", ".pytest.ini", "pytest.toml",
    ".pytest.toml", "tox.ini", "setup.cfg", "pyproject.toml",
})  # fmt: skip
# Top-level modules the test runner imports before (or while) it loads the grade report plugin: a file
# of that name on the import path would run the agent's code first (and could read the report key).
RUNNER_MODULES = frozenset({
    "pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "exceptiongroup", "tomli", "pygments",
    "colorama", "rollway", "rollway_grade_report",
}) | frozenset(sys.stdlib_module_names) - {"test"}  # fmt: skip
_DIST_META = re.compile(r"\.(dist-info|egg-info|egg-link)$")
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_HEADER = re.compile(rf"^diff --git ({_QUOTED}|a/\S+) ({_QUOTED}|b/\S+)$")
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "r": "\r", "v": "\v"}


@dataclass
class GradedDiff:
    """An agent's diff split into the graded part and what was left out (each list holds paths)."""

    patch: str = ""
    ignored: list[str] = field(default_factory=list)
    """Tool state and bytecode (not part of the answer)."""
    tests: list[str] = field(default_factory=list)
    """The graded test files and anything else in their folders (reset to the instance's version, as
    SWE-bench resets test files: expected-output data and helpers there are the tests' too)."""
    runner: list[str] = field(default_factory=list)
    """Files that change how the tests run (conftest.py, pytest config, plugins, shadowing modules...)."""
    unsafe: list[str] = field(default_factory=list)
    """Symlinks, submodules, paths under .git/ and sections whose paths could not be read."""

    def details(self, keep: int = 50) -> dict[str, Any]:
        """For a grade's details: each list cut to `keep` paths (an agent can create any number of
        files), with the full counts."""
        lists = {"ignored_files": self.ignored, "dropped_test_files": self.tests,
                 "dropped_runner_files": self.runner, "dropped_unsafe_files": self.unsafe}
        out: dict[str, Any] = {name: [p[:300] for p in paths[:keep]] for name, paths in lists.items()}
        out["dropped_counts"] = {name: len(paths) for name, paths in lists.items() if len(paths) > keep}
        return out


def unquote(name: str) -> str:
    """A path as git prints it: plain, or C-quoted ("a/d\\303\\251j\\303\\240.py") with octal bytes."""
    if not name.startswith('"'):
        return name
    out, body, i = bytearray(), name[1:-1], 0
    while i < len(body):
        char = body[i]
        if char != "\\":
            out += char.encode()
            i += 1
        elif body[i + 1 : i + 2].isdigit():
            out.append(int(body[i + 1 : i + 4], 8))
            i += 4
        else:
            out += _ESCAPES.get(body[i + 1], body[i + 1]).encode()
            i += 2
    return out.decode("utf-8", errors="replace")


def section_paths(section: str) -> list[str] | None:
    """Every path a section names (header, rename/copy lines, ---/+++), prefixes removed; None when
    the header cannot be read (the section is then dropped, never applied unchecked)."""
    lines = section.splitlines()
    header = _HEADER.match(lines[0]) if lines and lines[0].startswith("diff --git ") else None
    paths: list[str] = []
    if header:
        paths += [unquote(header.group(1))[2:], unquote(header.group(2))[2:]]
    elif not (lines and lines[0].startswith("--- ")):
        return None
    for line in _header_lines(lines):
        for prefix in ("rename from ", "rename to ", "copy from ", "copy to "):
            if line.startswith(prefix):
                paths.append(unquote(line[len(prefix):]))
        if line.startswith(("--- ", "+++ ")):
            name = unquote(line[4:].split("\t")[0].strip())
            if name != "/dev/null":
                paths.append(name.split("/", 1)[1] if "/" in name else name)
    return [p for p in dict.fromkeys(paths) if p] or None


def _header_lines(lines: list[str]) -> list[str]:
    """The lines outside hunks (hunk bodies skipped by their line counts): a second `--- `/`+++ ` pair
    smuggled after a hunk is a file header to `patch` and `git apply`, so it is read as one here too."""
    out, old_left, new_left = [], 0, 0
    for line in lines:
        if old_left > 0 or new_left > 0:
            kind = line[:1]
            old_left -= kind in (" ", "-", "")
            new_left -= kind in (" ", "+", "")
            continue
        hunk = _HUNK.match(line)
        if hunk:
            old_left, new_left = int(hunk.group(1) or 1), int(hunk.group(2) or 1)
        else:
            out.append(line)
    return out


def is_unsafe(section: str, paths: list[str]) -> bool:
    """A symlink or submodule (mode 120000/160000), or a path under `.git` or leaving the tree."""
    if re.search(r"(?m)^(new file mode|new mode|index [0-9a-f]+\.\.[0-9a-f]+) 1[26]0000\b", section):
        return True
    return any(part in (".git", ".gitmodules", "..") for p in paths for part in PurePosixPath(p).parts) or any(
        p.startswith("/") for p in paths)


def in_test_dir(path: str, test_dirs: frozenset[str]) -> bool:
    """Under a folder that holds graded test files (their data, helpers and fixtures are the tests' too;
    the repository root, where some projects keep a test file, does not count)."""
    parents = {str(p) for p in PurePosixPath(path).parents}
    return any(d in parents for d in test_dirs if d not in ("", "."))


def is_runner_file(path: str, import_roots: tuple[str, ...] = (".",), new: bool = True) -> bool:
    """Whether `path` can change how the tests run rather than the code they test. A *new* top-level
    module named like the standard library or pytest would shadow it (an existing one, as in pytest's own
    repository, is the code under test)."""
    pure = PurePosixPath(path)
    if pure.name in RUNNER_NAMES or pure.suffix == ".pth" or any(_DIST_META.search(p) for p in pure.parts):
        return True
    for root in import_roots if new else ():
        rel = pure if root in (".", "") else _relative(pure, root)
        if rel is not None and rel.parts and _module_name(rel.parts[0]) in RUNNER_MODULES:
            return True
    return False


def _relative(path: PurePosixPath, root: str) -> PurePosixPath | None:
    try:
        return path.relative_to(root.strip("/"))
    except ValueError:
        return None


def _module_name(part: str) -> str:
    return part.split(".", 1)[0] if part.endswith((".py", ".pyc", ".so", ".pyd")) or "." in part[1:] else part


def _creates(section: str) -> bool:
    """A section that adds a file (or renames/copies one into place)."""
    return bool(re.search(r"(?m)^(new file mode |rename to |copy to |--- /dev/null|@@ -0,0 )", section))


def split_sections(patch: str) -> list[str]:
    """The per-file sections of a diff (git style; a plain unified diff splits on its `--- ` lines)."""
    splitter = r"(?m)^(?=diff --git )" if re.search(r"(?m)^diff --git ", patch) else r"(?m)^(?=--- )"
    return [chunk for chunk in re.split(splitter, patch) if chunk.strip()]


def graded_diff(patch: str, test_files: set[str] | frozenset[str], import_roots: tuple[str, ...] = (".",),
                runner_files: set[str] | frozenset[str] = frozenset()) -> GradedDiff:
    """Split `patch` into the graded part and the files left out. `runner_files` names more files that
    configure the run (plugin modules the instance's own configuration loads)."""
    out, kept = GradedDiff(), []
    test_dirs = frozenset(str(PurePosixPath(t).parent) for t in test_files)
    for section in split_sections(patch):
        paths = section_paths(section)
        if paths is None:
            out.unsafe.append(section.splitlines()[0][:200])
        elif is_unsafe(section, paths):
            out.unsafe.append(paths[-1])
        elif all(IGNORED.search(p) for p in paths):
            out.ignored.append(paths[-1])
        elif any(p in test_files or in_test_dir(p, test_dirs) for p in paths):
            out.tests.append(paths[-1])
        elif any(p in runner_files or is_runner_file(p, import_roots, _creates(section)) for p in paths):
            out.runner.append(paths[-1])
        else:
            kept.append(section)
    out.patch = "".join(kept)
    return out
