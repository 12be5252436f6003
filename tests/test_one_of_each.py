"""One of each (issue 26 item 7): one process launcher (base/process.py), one HTTP client library
(aiohttp; base/http.py for sync callers), one `free_port`, and run-folder paths spelled only in
base/run_dir.py. These read the source, so a second launcher or a hand-written path fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from rollway.base.run_dir import RunDir

ROOT = Path(__file__).resolve().parent.parent


def package_files() -> list[Path]:
    """Every module of rollway's packages (pyproject's package-dir), tests and scripts excluded."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return sorted(p for folder in set(dirs.values()) for p in (ROOT / folder).rglob("*.py"))


def offenders(pattern: str, files: list[Path], allowed: set[str] = frozenset()) -> list[str]:
    regex = re.compile(pattern)
    found = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        if rel in allowed:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            # `# in-sandbox`: a line of a script that runs inside a sandbox, where rollway is not installed
            if regex.search(line) and not line.lstrip().startswith("#") and not line.endswith("# in-sandbox"):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_children_are_started_only_by_the_launcher() -> None:
    found = offenders(r"subprocess\.Popen\(|\bPopen\(", package_files(), {"base/process.py"})
    assert not found, "start child processes with rollway.base.process.Child:\n" + "\n".join(found)


def test_one_free_port_and_one_health_wait() -> None:
    found = offenders(r"def free_port\b|^def wait_ready\b", package_files(), {"base/process.py"})
    assert not found, "use rollway.base.process.free_port and Child.wait_ready:\n" + "\n".join(found)


def test_no_urllib_http_client() -> None:
    # audit/grader_attacks.py: programs the grader check runs inside sandboxes as the agent (a harness
    # program's own HTTP call), not clients of rollway's
    found = offenders(r"urllib\.request|urllib\.error|http\.client|\brequests\.(get|post)\(|import requests\b",
                      package_files(), {"audit/grader_attacks.py"})
    assert not found, "HTTP clients use aiohttp (sync code: rollway.base.http):\n" + "\n".join(found)


def run_folder_names() -> set[str]:
    """The first path component of every file and folder RunDir names (from its properties)."""
    run = RunDir("/run")
    names = set()
    for attr in dir(RunDir):
        if isinstance(getattr(RunDir, attr), property):
            value = getattr(run, attr)
            if isinstance(value, Path) and value.is_relative_to(run.path):
                names.add(value.relative_to(run.path).parts[0])
    return names


RUN_FOLDER_USERS = ["runners", "audit", "reports", "bench", "learning/metrics.py", "learning/checkpoint.py",
                    "base/logging.py"]
"""Where run folders are read and written outside the stages (issue 26 item 7's list)."""


def test_run_folder_paths_are_spelled_only_in_run_dir() -> None:
    names = run_folder_names()
    assert {"summary.json", "trajectories.jsonl", "logs", "checkpoints", "metrics.jsonl"} <= names
    files = sorted(p for entry in RUN_FOLDER_USERS for p in
                   ((ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir() else [ROOT / entry]))
    literal = "|".join(re.escape(n) for n in sorted(names))
    found = offenders(rf"\brun_dir / [\"']|/ [\"']({literal})[\"']", files)
    assert not found, "name run-folder files through RunDir (base/run_dir.py):\n" + "\n".join(found)
