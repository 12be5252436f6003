"""The pytest command used to build and grade SWE tasks, and the parser of its `-rA` summary."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

# -rA prints one summary line per test; the message after " - " is the first line of the crash.
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S.*)$")
_SECTION = re.compile(r"^=+ (.*?) =+$")


@dataclass
class PytestReport:
    """Per-test outcomes of one pytest run, keyed by node id."""

    outcomes: dict[str, str] = field(default_factory=dict)
    """node id -> "passed" / "failed" / "error" / "xfail" / "xpass"."""
    messages: dict[str, str] = field(default_factory=dict)
    """node id -> first line of the failure message, when pytest printed one."""
    collection_errors: dict[str, str] = field(default_factory=dict)
    """File (or directory) that failed to import or collect -> message."""

    def passed(self) -> set[str]:
        return {node for node, outcome in self.outcomes.items() if outcome == "passed"}


def parse_pytest_output(text: str) -> PytestReport:
    """Read the `short test summary info` section that `pytest -rA` prints at the end."""
    report = PytestReport()
    in_summary = False
    for line in text.splitlines():
        section = _SECTION.match(line)
        if section:
            in_summary = "short test summary info" in section.group(1)
            continue
        match = _SUMMARY_LINE.match(line) if in_summary else None
        if not match:
            continue
        kind, (node, message) = match.group(1), _split_node(match.group(2))
        if kind == "ERROR" and "::" not in node:
            report.collection_errors[node] = message
            continue
        # A test can error in teardown after passing: the worst outcome wins.
        outcome = kind.lower()
        if report.outcomes.get(node) not in (None, "passed"):
            continue
        report.outcomes[node] = outcome
        if message:
            report.messages[node] = message
    return report


def _split_node(rest: str) -> tuple[str, str]:
    """Node id and message of `nodeid - message`; a " - " inside parametrize brackets is the id's."""
    depth = 0
    for i, char in enumerate(rest):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth == 0 and rest.startswith(" - ", i):
            return rest[:i].strip(), rest[i + 3 :].strip()
    return rest.strip(), ""


def pytest_command(files: list[str], python: str = "python", python_path: tuple[str, ...] = (".",),
                   rewrite_asserts: bool = False) -> str:
    """Shell command that runs these test files from the repository root.

    The project's own `addopts` are cleared (they often name plugins that are not installed), the
    cache is off (nothing written outside the tree), bytecode is not written (a mutation that keeps
    a file's size and mtime second could otherwise reuse a stale .pyc), and the terminal is wide so
    failure messages are not cut. Asserts are plain (`--assert=plain`): a test's status does not depend
    on pytest rewriting its asserts, only its failure message does, and rewriting every test module anew
    in a fresh tree is about half the CPU of a run (toolz's 15 test files: 1.3 core-seconds against 0.65).
    Rows are built and graded with the same command, so their expected statuses agree with it;
    `rewrite_asserts` is for a run whose failure messages someone reads (a built row's statement)."""
    env = f"PYTHONDONTWRITEBYTECODE=1 COLUMNS=250 PYTHONPATH={shlex.quote(':'.join(python_path))}"
    # Marks registered by plugins we lack (pytest-cov's no_cover) must not abort under filterwarnings=error.
    asserts = "" if rewrite_asserts else "--assert=plain "
    args = ("-q -rA --tb=short --no-header -p no:cacheprovider -o addopts= " + asserts +
            "-W ignore::pytest.PytestUnknownMarkWarning")
    return f"{env} {shlex.quote(python)} -m pytest {args} {' '.join(shlex.quote(f) for f in files)}"


def node_file(node_id: str) -> str:
    """The test file part of a node id."""
    return node_id.split("::", 1)[0]
