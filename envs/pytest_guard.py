"""Test runs whose result the tested code cannot forge by printing, writing files or exiting early.

pytest loads rollway's report plugin (`-p rollway_grade_report`, injected through PYTEST_ADDOPTS, so it
works inside a row's own test command). At import, before any conftest or code under test, the plugin
reads a random key the grader wrote for this run and deletes the key file; at the end of the session it
writes the per-test outcomes it saw from pytest's own hooks, signed with HMAC-SHA256 under that key. The
grader trusts only a report whose signature checks: fake `PASSED` lines on stdout, a report or log
written into the workspace, `os._exit(0)` or `sys.exit(0)` at import all leave no valid report (a 0).

Residual risk: the code under test runs in the pytest process itself, so code written to attack this
harness (reading the key from the plugin's closure, patching pytest's report objects in memory) can
still forge; see docs/security/grading.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import shlex
from dataclasses import dataclass, field
from typing import Any

from rollway.sandboxes.base import Sandbox, SandboxError

GRADE_DIR = ".rollway/grade"
PLUGIN_DIR = f"{GRADE_DIR}/plugin"
PLUGIN_MODULE = "rollway_grade_report"
REPORT_FILE = f"{GRADE_DIR}/report.json"
KEY_FILE = f"{GRADE_DIR}/key"
PROBE_TIMEOUT_S = 120.0
"""At least this long for the check on the unpatched tree (an infrastructure check, not the agent's time)."""
REPORT_MAX_BYTES = 64 * 2**20
LOG_CHARS = 1500
"""Characters of the run's output kept in a grade's details (a Trajectory must stay well under 1 MB)."""

# Runs inside the grading sandbox as a pytest plugin; only the standard library and pytest.
PLUGIN_SOURCE = '''"""rollway's signed grade report (see rollway.envs.pytest_guard)."""
import hashlib
import hmac
import json
import os

import pytest

_RANK = {"PASSED": 0, "SKIPPED": 0, "FAILED": 1, "ERROR": 1}


def _take_key():
    path = os.path.join(os.environ["ROLLWAY_GRADE_DIR"], "key")
    with open(path, "rb") as handle:
        key = handle.read()
    os.unlink(path)  # read once, before any conftest or tested module is imported
    return key


def _status(report):
    """SWE-bench's reading: XFAIL passes, XPASS fails; an xfail only counts when the test is marked so
    (a tested function calling pytest.xfail() must not turn its failure into a pass)."""
    marked = "xfail" in report.keywords
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            return ("PASSED" if marked else "FAILED") if report.skipped else "FAILED"
        if report.passed:
            return "PASSED"
        if report.skipped:
            return "SKIPPED"
        return "FAILED" if report.when == "call" else "ERROR"
    return "ERROR" if report.failed else None


def _install():
    key = _take_key()

    def write(config, tests, errors, exitstatus, collected):
        root = str(config.rootpath) + os.sep
        plugins = sorted({os.path.relpath(f, root) for p in config.pluginmanager.get_plugins()
                          for f in [getattr(p, "__file__", None) or ""] if f.startswith(root)})
        body = json.dumps({"tests": tests, "collection_errors": errors, "plugins": plugins,
                           "exitstatus": int(exitstatus), "collected": collected})
        mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
        with open(os.path.join(os.environ["ROLLWAY_GRADE_DIR"], "report.json"), "w") as handle:
            json.dump({"body": body, "mac": mac}, handle)

    class Recorder:
        def __init__(self, config):
            self.config, self.tests, self.errors = config, {}, []

        # Each report is read right after pytest's own makereport hooks (xfail handling included) built
        # it, before any wrapper registered later (by code under test, during collection) can rewrite it.
        # An in-process attacker who hooks in ahead of this one still wins: docs/security/grading.md.
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            outcome = yield
            report = outcome.get_result()
            status = _status(report)
            if status and _RANK[status] >= _RANK.get(self.tests.get(report.nodeid, ""), -1):
                self.tests[report.nodeid] = status

        def pytest_collectreport(self, report):
            if report.failed:
                self.errors.append(report.nodeid)

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session, exitstatus):
            write(self.config, self.tests, self.errors, exitstatus, session.testscollected)

    def pytest_configure(config):
        if os.environ.get("ROLLWAY_GRADE_PROBE"):
            # The runner check: pytest, this plugin, the configuration and the initial conftests
            # loaded; stop before any test module is imported.
            write(config, {}, [], 0, 0)
            pytest.exit("rollway runner check done", returncode=0)
        config.pluginmanager.register(Recorder(config), "rollway-grade-recorder")

    return pytest_configure


pytest_configure = _install()
'''


@dataclass
class GuardedRun:
    """One test run in the grading sandbox: its signed report (None when missing or forged) and output."""

    report: dict[str, Any] | None
    exit_code: int | None
    output: str
    timed_out: bool = False
    problem: str = ""
    """Why `report` is None: `missing` (none written) or `bad_signature`."""
    plugin_files: list[str] = field(default_factory=list)

    @property
    def statuses(self) -> dict[str, str]:
        return dict(self.report["tests"]) if self.report else {}


def uses_pytest(command: str) -> bool:
    """Whether a test command runs pytest (then its result comes from the signed report)."""
    return re.search(r"(^|[\s/;&|(])(py\.test|pytest)(\s|$)", command) is not None


def guarded(command: str, probe: bool = False) -> str:
    """`command` with the report plugin on the import path and in PYTEST_ADDOPTS; its own PYTHONPATH
    assignments keep the plugin folder first. `probe` stops once pytest is configured (the runner check:
    no test module is imported)."""
    plugin_dir = '"$ROLLWAY_GRADE_DIR/plugin"'
    command = re.sub(r"(?<![\w$])PYTHONPATH=", f"PYTHONPATH={plugin_dir}:", command)
    probe_env = " ROLLWAY_GRADE_PROBE=1" if probe else ""
    return (f'export ROLLWAY_GRADE_DIR="$PWD/{GRADE_DIR}"{probe_env}; '
            f'export PYTHONPATH={plugin_dir}${{PYTHONPATH:+:$PYTHONPATH}} '
            f'PYTEST_ADDOPTS="-p {PLUGIN_MODULE}${{PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}}"; {command}')


async def run_guarded(sandbox: Sandbox, command: str, timeout_s: float, probe: bool = False) -> GuardedRun:
    """Run `command` (a pytest command) with a fresh key; read back and check the signed report."""
    key = secrets.token_hex(32)
    await sandbox.write_file(f"{PLUGIN_DIR}/{PLUGIN_MODULE}.py", PLUGIN_SOURCE)
    await sandbox.exec(f"rm -f {REPORT_FILE}", timeout_s=30)
    await sandbox.write_file(KEY_FILE, key)
    timeout_s = max(timeout_s, PROBE_TIMEOUT_S) if probe else timeout_s
    ran = await sandbox.exec(f"{guarded(command, probe)} 2>&1; echo rollway-exit=$?", timeout_s=timeout_s)
    exit_code = _exit_code(ran.output)
    if ran.timed_out:
        return GuardedRun(None, exit_code, ran.output, timed_out=True, problem="timed_out")
    # A regular file of sane size only (the tested code may leave a FIFO, a symlink or gigabytes there).
    fits = await sandbox.exec(f"test -f {REPORT_FILE} && ! test -L {REPORT_FILE} && "
                              f"test $(stat -c %s {REPORT_FILE}) -le {REPORT_MAX_BYTES}", timeout_s=30)
    try:
        text = await sandbox.read_file(REPORT_FILE) if fits.exit_code == 0 else None
    except SandboxError:
        text = None
    if text is None:
        return GuardedRun(None, exit_code, ran.output, problem="missing")
    report = verify_report(text, key.encode())
    if report is None:
        return GuardedRun(None, exit_code, ran.output, problem="bad_signature")
    return GuardedRun(report, exit_code, ran.output, plugin_files=list(report.get("plugins", [])))


def verify_report(text: str, key: bytes) -> dict[str, Any] | None:
    """The report body when its signature checks under `key`, else None."""
    try:
        outer = json.loads(text)
        body, mac = outer["body"], outer["mac"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(body, str) or not isinstance(mac, str):
        return None
    if not hmac.compare_digest(hmac.new(key, body.encode(), hashlib.sha256).hexdigest(), mac):
        return None
    return json.loads(body)


def _exit_code(output: str) -> int | None:
    match = re.search(r"rollway-exit=(\d+)\s*$", output)
    return int(match.group(1)) if match else None


async def probe_command(sandbox: Sandbox, command: str) -> str | None:
    """Whether a non-pytest test command's program exists here (checked on the unpatched tree): None
    when it does, else what is wrong. Commands too complex to read are not probed."""
    try:
        words = [w for w in shlex.split(command) if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)]
    except ValueError:
        return None
    if not words or any(c in command for c in ";&|`$("):
        return None
    program = shlex.quote(words[0])
    check = f"test -x {program}" if "/" in words[0] else f"command -v {program}"
    ran = await sandbox.exec(f"{check} >/dev/null 2>&1", timeout_s=30)
    return None if ran.exit_code == 0 else f"{words[0]!r} is not a program in the grading sandbox"


def bounded_patch(patch: str, keep: int = 20000) -> dict[str, Any]:
    """A diff as a grade carries it: whole up to `keep` characters, else its head, with length and sha256."""
    out: dict[str, Any] = {"chars": len(patch), "sha256": hashlib.sha256(patch.encode()).hexdigest()}
    out["text"] = patch if len(patch) <= keep else patch[:keep]
    out["truncated"] = len(patch) > keep
    return out


def tail(text: str, chars: int = LOG_CHARS) -> str:
    return text[-chars:]
