"""SWE-bench-style grading in the instance's container: filtered model patch, test patch, test command,
signed pytest report (or a parsed log for other runners).

Outcomes (Grade.details["outcome"]): `resolved`, `unresolved`, `no_report` (the tests ran but left no
valid report, or the runner could not start after the patch: a 0, since the runner was checked on the
unpatched tree first), `patch_failed` (the model's patch does not apply), `test_timeout` (the tests
ran past the limit), `env_error` (the environment, not the model: the image or container failed, the
test patch did not apply, the test command could not start on the unpatched tree). An
`env_error` is never a reward: grading raises GradingEnvError, the reward actor reports the attempt as
failed with that reason, and the scheduler re-issues it (scheduler.max_attempts). Any other failure once the
patch is applied (the container killed, a lost output) is the patch's: graded 0 (base/blame.py). `patch_failed` and
`test_timeout` are the model's doing and score 0 with that stop reason (never a failure: base/blame.py).
"""

from __future__ import annotations

import re
import shlex
import uuid
from dataclasses import dataclass
from typing import Any

from rollway.envs.base import Grade
from rollway.envs.graded_diff import graded_diff
from rollway.envs.pytest_guard import GRADE_DIR, probe_command, run_guarded, tail, uses_pytest
from rollway.envs.pytest_report import node_file
from rollway.envs.reach_check import SUSPECTED_HACK, reaching_lines
from rollway.envs.swe_rows import SWEInstance
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec

OUTCOMES = ("resolved", "unresolved", "no_report", "patch_failed", "test_timeout", "env_error")
IMPORT_ROOTS = (".", "src")
"""Where the default test command imports from (a new module there may not shadow stdlib or pytest)."""


class GradingEnvError(SandboxError):
    """Grading failed before the model's patch was applied (outcome `env_error`: the grading sandbox did
    not start, the runner fails on the unpatched tree, the test patch does not apply); retried by the
    pipeline. A failure after the patch is applied is the patch's (base/blame.py)."""

    outcome = "env_error"
    found_before_agent_code = True


# ---------------------------------------------------------------- log parsers

_PYTEST_STATUS = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_PYTEST_VERBOSE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?:\s+\[\s*\d+%\])?$")


def parse_pytest_log(text: str) -> dict[str, str]:
    """Test name -> status from `pytest -rA` summary lines (`PASSED node`, `FAILED node - msg`) and
    from `pytest -v` lines (`node PASSED [ 10%]`). A parametrized id with ` - ` in its brackets stays whole."""
    status: dict[str, str] = {}
    for line in text.splitlines():
        line = line.rstrip()
        verbose = _PYTEST_VERBOSE.match(line)
        if verbose:
            _record(status, verbose.group(1), verbose.group(2))
            continue
        if line.startswith(_PYTEST_STATUS):
            kind, _, rest = line.partition(" ")
            _record(status, _node_of(rest), kind)
    return status


def _node_of(rest: str) -> str:
    depth = 0
    for i, char in enumerate(rest):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth == 0 and rest.startswith(" - ", i):
            return rest[:i].strip()
    return rest.strip()


def _record(status: dict[str, str], name: str, kind: str) -> None:
    """XFAIL counts as passed and XPASS as failed (as SWE-bench grades); the worst status wins (a test
    that passed and then errored in teardown has errored)."""
    kind = {"XFAIL": "PASSED", "XPASS": "FAILED"}.get(kind, kind)
    if _RANK[kind] >= _RANK.get(status.get(name, ""), -1):
        status[name] = kind


_RANK = {"PASSED": 0, "SKIPPED": 0, "FAILED": 1, "ERROR": 1}


def parse_unittest_log(text: str) -> dict[str, str]:
    """Test name -> status from unittest's verbose runner (`python -m unittest -v`, Django's runtests):
    `test_x (pkg.mod.Class) ... ok`. The name is `test_x (pkg.mod.Class)`, as SWE-bench keys Django tests."""
    status: dict[str, str] = {}
    mapping = {"ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "expected failure": "PASSED",
               "unexpected success": "FAILED"}
    for line in text.splitlines():
        match = re.match(r"^(\w+) \(([\w.]+)\)(?: .*?)? \.\.\. ?(.*)$", line.rstrip())
        if not match:
            continue
        verdict = match.group(3).strip()
        kind = "SKIPPED" if verdict.startswith("skipped") else mapping.get(verdict)
        if kind:
            status[f"{match.group(1)} ({match.group(2)})"] = kind
    return status


PARSERS = {"pytest": parse_pytest_log, "unittest": parse_unittest_log}


def parse_test_log(text: str, parser: str = "auto") -> dict[str, str]:
    """Statuses by the named parser; `auto` merges both (their line shapes do not overlap)."""
    if parser == "auto":
        return {**parse_unittest_log(text), **parse_pytest_log(text)}
    if parser not in PARSERS:
        raise ValueError(f"log_parser {parser!r} is unknown; use one of {', '.join(PARSERS)} or auto")
    return PARSERS[parser](text)


# ---------------------------------------------------------------- the test command


def test_files_of(inst: SWEInstance) -> list[str]:
    """Files the instance's tests live in: pytest node ids' files, and files the test patch touches."""
    files = {node_file(t) for t in inst.fail_to_pass + inst.pass_to_pass if "::" in t}
    files |= set(re.findall(r"^diff --git a/(\S+) b/", inst.test_patch, flags=re.M))
    return sorted(files)


def test_command(inst: SWEInstance) -> str:
    """The row's own test command, else pytest (-rA) on the test files, with the workspace's import
    roots first on the path (an image's editable install may point at its repository copy; a new
    module there named like one of the standard library or pytest is dropped from the graded diff)."""
    if inst.test_command:
        return inst.test_command
    files = test_files_of(inst)
    if not files:
        raise GradingEnvError(f"instance {inst.instance_id}: no test_command and no pytest node ids to run; add a "
                              "test_command to the row")
    return ("PYTHONDONTWRITEBYTECODE=1 COLUMNS=250 PYTHONPATH=.:src${PYTHONPATH:+:$PYTHONPATH} python -m pytest -rA "
            "--tb=short -p no:cacheprovider " + " ".join(shlex.quote(f) for f in files))


def answer_patch(patch: str, protected: set[str], runner_files: frozenset[str] = frozenset()) -> tuple[str, list[str]]:
    """The graded part of an agent's diff and the files left out: tool state, bytecode, files the test
    patch or the graded tests own (reset to the instance's version, as SWE-bench resets them), and files
    that change how the tests run (see envs/graded_diff.py)."""
    diff = graded_diff(patch, protected, IMPORT_ROOTS, runner_files)
    return diff.patch, diff.ignored + diff.tests + diff.runner + diff.unsafe


# ---------------------------------------------------------------- grading


APPLY_TIMEOUT_S = 60.0
"""Time limit of applying one patch (the model's, then the tests')."""


@dataclass
class GradeSettings:
    timeout_s: float = 120.0
    all_failed: bool = False
    """List every failed expected test in the details (default: the first 20)."""

    @property
    def time_limit_s(self) -> float:
        """The most one grading can run under its steps' limits: the runner's check on the unpatched tree,
        two patches applied, the graded run."""
        return 2 * self.timeout_s + 2 * APPLY_TIMEOUT_S


def _apply(path: str) -> str:
    """git apply, then patch with fuzz (SWE-bench's order); the ceiling keeps git out of enclosing repos."""
    return (f'GIT_CEILING_DIRECTORIES="$(dirname "$PWD")" git apply --whitespace=nowarn {path} 2>&1 || '
            f"patch --batch --fuzz=5 -p1 -i {path} 2>&1")


async def grade_in_sandbox(sandbox: Sandbox, inst: SWEInstance, patch: str, settings: GradeSettings) -> Grade:
    """Grade `patch` in `sandbox`, a fresh copy of the instance's starting tree. The test runner is
    checked on the unpatched tree first, so that a failure after the patch is the patch's (a 0), never
    an infrastructure failure the agent could choose to cause."""
    command = test_command(inst)
    try:
        runner_files = await check_runner(sandbox, inst, command, settings.timeout_s)
    except GradingEnvError:
        raise
    except SandboxError as exc:  # before the patch: the environment's
        raise GradingEnvError(f"env_error: the test runner of {inst.instance_id} could not be checked on the "
                              f"unpatched tree: {exc}") from exc
    diff = graded_diff(patch, set(test_files_of(inst)), IMPORT_ROOTS, runner_files)
    details: dict[str, Any] = {**diff.details(), "patch_chars": len(diff.patch)}
    reaching = reaching_lines(diff.patch, repo=inst.repo)
    if reaching:  # no test runs: code that reaches into the runner could rewrite what a run records
        details.update(outcome=SUSPECTED_HACK, suspected_reward_hack=[r.as_dict() for r in reaching])
        return Grade(0.0, False, stop_reason=SUSPECTED_HACK, details=details)
    if diff.patch.strip():
        await sandbox.write_file(f"{GRADE_DIR}/model.patch", diff.patch)
        applied = await sandbox.exec(_apply(f"{GRADE_DIR}/model.patch"), timeout_s=APPLY_TIMEOUT_S)
        if applied.exit_code != 0:
            details["apply_output"] = tail(applied.output, 2000)
            return _typed("patch_failed", details, settings, applied.output[-300:])
    if inst.test_patch.strip():
        await sandbox.write_file(f"{GRADE_DIR}/test.patch", inst.test_patch)
        applied = await sandbox.exec(_apply(f"{GRADE_DIR}/test.patch"), timeout_s=APPLY_TIMEOUT_S)
        if applied.exit_code != 0:
            raise GradingEnvError(f"env_error: test_patch of {inst.instance_id} does not apply to its base: "
                                  f"{applied.output[-300:]}")
    keep = None if settings.all_failed else 20
    if uses_pytest(command):
        return await _run_pytest(sandbox, inst, command, details, settings, keep)
    return await _run_logged(sandbox, inst, command, details, settings, keep)


async def check_runner(sandbox: Sandbox, inst: SWEInstance, command: str, timeout_s: float) -> frozenset[str]:
    """On the unpatched tree: a pytest command starts, loads its configuration and the report plugin
    and writes a signed report (its plugin modules inside the workspace are returned: the agent's edits
    to them are not graded); another command's program exists. Raises GradingEnvError when not (the
    environment's fault, retried)."""
    if not uses_pytest(command):
        problem = await probe_command(sandbox, command)
        if problem:
            raise GradingEnvError(f"env_error: the test command of {inst.instance_id} could not start: {problem}")
        return frozenset()
    probe = await run_guarded(sandbox, command, timeout_s, probe=True)
    if probe.report is None:
        raise GradingEnvError(f"env_error: the test command of {inst.instance_id} could not start pytest with "
                              f"rollway's report on the unpatched tree ({probe.problem}, exit {probe.exit_code}): "
                              f"{probe.output[-300:]}")
    return frozenset(probe.plugin_files)


async def _run_pytest(sandbox: Sandbox, inst: SWEInstance, command: str, details: dict[str, Any],
                      settings: GradeSettings, keep: int | None) -> Grade:
    """The graded run; statuses come only from the signed report (a run that leaves none scores 0)."""
    ran = await run_guarded(sandbox, command, settings.timeout_s)
    details["report"] = "signed"
    if ran.timed_out:
        details["timeout_s"] = settings.timeout_s
        return _typed("test_timeout", details, settings, f"tests ran past {settings.timeout_s:g}s")
    if ran.report is None:
        # The runner started on the unpatched tree (check_runner): the patched code stopped it.
        details.update(outcome="no_report", reason=f"no valid test report ({ran.problem}, exit {ran.exit_code})",
                       log_tail=tail(ran.output))
        return Grade(0.0, False, details=details)
    details["exit_code"] = ran.exit_code
    return verdict(inst, ran.statuses, details, ran.output, keep)


async def _run_logged(sandbox: Sandbox, inst: SWEInstance, command: str, details: dict[str, Any],
                      settings: GradeSettings, keep: int | None) -> Grade:
    """A non-pytest runner (Django's runtests, unittest): statuses parsed from its log, which the
    tested code could forge by printing (said in the details; see docs/security/grading.md)."""
    ran = await sandbox.exec(f"mkdir -p {GRADE_DIR}; {command} > {GRADE_DIR}/test.log 2>&1; echo exit=$?",
                             timeout_s=settings.timeout_s)
    details["report"] = "log (forgeable by the tested code)"
    if ran.timed_out:
        details["timeout_s"] = settings.timeout_s
        return _typed("test_timeout", details, settings, f"tests ran past {settings.timeout_s:g}s")
    log = await sandbox.read_file(f"{GRADE_DIR}/test.log")
    exit_code = _exit_code(ran.output)
    if exit_code in (126, 127):
        # The runner's program was there before the patch (check_runner): the patch broke it.
        details.update(outcome="no_report", reason=f"the test command could not start after the patch "
                       f"(exit {exit_code})", log_tail=tail(log))
        return Grade(0.0, False, details=details)
    return verdict(inst, parse_test_log(log, inst.log_parser), details, log, keep)


def _exit_code(output: str) -> int | None:
    match = re.search(r"exit=(\d+)\s*$", output)
    return int(match.group(1)) if match else None


def verdict(inst: SWEInstance, status: dict[str, str], details: dict[str, Any], log: str = "",
            keep: int | None = 20) -> Grade:
    """Resolved when every FAIL_TO_PASS and PASS_TO_PASS test passed; a test missing from the log failed."""
    details["fail_to_pass"] = _count(inst.fail_to_pass, status, keep)
    details["pass_to_pass"] = _count(inst.pass_to_pass, status, keep)
    details["tests_in_log"] = len(status)
    resolved = not details["fail_to_pass"]["failed"] and not details["pass_to_pass"]["failed"]
    if not resolved:
        details["log_tail"] = tail(log)
    details["outcome"] = "resolved" if resolved else "unresolved"
    return Grade(1.0 if resolved else 0.0, resolved, details=details)


def _count(expected: list[str], status: dict[str, str], keep: int | None) -> dict[str, Any]:
    failed = [t for t in expected if status.get(t) != "PASSED"]
    return {"passed": len(expected) - len(failed), "total": len(expected), "failed": failed[:keep]}


def _typed(outcome: str, details: dict[str, Any], settings: GradeSettings, why: str) -> Grade:
    details["outcome"] = outcome
    return Grade(0.0, False, stop_reason=outcome, details=details)


async def grade_instance(inst: SWEInstance, patch: str, provider: SandboxProvider, spec: SandboxSpec,
                         settings: GradeSettings, owner: str = "") -> Grade:
    """Grade `patch` in a fresh sandbox built from `spec` (the instance's image); the sandbox is always
    destroyed. A sandbox that cannot be made or dies is `env_error`. `owner` (an episode's id and attempt)
    starts the sandbox's name, so the run's reaper finds it when a killed worker leaves it behind."""
    lead = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', owner)[:80]}-" if owner else ""
    name = f"{lead}grade-{re.sub(r'[^A-Za-z0-9_.-]', '_', inst.instance_id)[:50]}-{uuid.uuid4().hex[:8]}"
    try:
        sandbox = await provider.create(spec, name)
    except SandboxError as exc:
        raise GradingEnvError(f"env_error: grading sandbox for {inst.instance_id} could not start: {exc}") from exc
    try:
        return await grade_in_sandbox(sandbox, inst, patch, settings)
    finally:
        await sandbox.destroy()
