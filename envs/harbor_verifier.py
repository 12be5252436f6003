"""Grading a Harbor task where the agent cannot reach the verifier (`[verifier] environment_mode`).

separate (rollway's default): the agent's workspace (the task's working directory) is copied out of its
container by the engine, as data (regular files, folders and links, ownership and special bits dropped,
nothing under .rollway/, bounded by the workspace's size and by a time limit of its own), into a fresh
container of the task's image that the agent never ran in. Only then are tests/ copied in and test.sh run, as `[verifier] user` with
`[verifier] env`. shared (when a task asks for it): test.sh runs in the agent's container.

In both, /tests and /logs are rollway's (KEEPER's folder JUDGE, out of the workspace), made afresh just
before test.sh: tests read-only, reward files made in advance in a sticky folder (test.sh and what it runs
may write them, not remove, replace or lock them). test.sh runs under the execute-only bash (not dumpable)
in a container whose seccomp profile refuses ptrace, so a program it runs can neither trace it nor write
its memory; the reward is read only when test.sh ended with status 0 (as the engine saw it) and no other
process of its user outlived it (docs/security/harbor.md).

No opt-out: a test.sh that wrote no reward, wrote a non-number, or exited non-zero is a graded 0 with the
reason in the details; so is a test.sh that could not run to its end (a program it ran killed it), by
base/blame.py. Only the infrastructure (the verifier's container could not start, the engine failed)
is retried instead of graded.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import shlex
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any, Literal

from rollway.base.blame import found_before_agent_code
from rollway.envs.base import Grade
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec
from rollway.sandboxes.docker import JUDGE, JUDGE_BIN, WORKSPACE, DockerSandbox, engine_errors

if TYPE_CHECKING:
    from rollway.envs.harbor import HarborTask

HARBOR_DIR = ".rollway/harbor"
"""Workspace folder behind the image's /solution link, and where tests are staged (outside the graded diff)."""
VERDICT = f"{JUDGE}/harbor"
"""Behind the image's /tests and /logs links: in rollway's own folder (KEEPER's), out of the workspace,
where no process of the judged user can rename, replace or lock what the verifier made (see _prepare_script)."""
LINKS = {"/tests": f"{VERDICT}/tests", "/logs": f"{VERDICT}/logs", "/solution": f"/workspace/{HARBOR_DIR}/solution"}
"""Absolute targets of the links rollway's image layer makes."""
CARRY = ".rollway/carry.tar"
SANDBOX_UID = 65534
"""Owner of every carried file (the docker sandbox's user)."""
VERIFIER_TIMEOUT_S = 600.0
"""test.sh's time limit when task.toml sets no [verifier] timeout_sec (Harbor's default)."""


class HarborEnvError(SandboxError):
    """The verifier could not do its work (env_error). Retried only where it was found before the agent's
    files reached a sandbox (its container did not start); a test.sh that could not be run to its end
    after that is the agent's failure, graded 0 (base/blame.py)."""


@dataclass(frozen=True)
class VerifierSettings:
    """A task's [verifier] section, checked at load (see harbor.verifier_settings)."""

    mode: Literal["separate", "shared"] = "separate"
    user: str | None = None
    """Who runs test.sh; None: the sandbox's unprivileged user."""
    env: dict[str, str] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    """SandboxSpec limits of the verifier's own container ([verifier.environment], else [environment])."""


async def copy_folder(sandbox: Sandbox, files: list[tuple[str, Path]], dest: str) -> None:
    """Each (relative name, host file) byte for byte (binary fixtures too), executable bits kept."""
    for rel, path in files:
        await sandbox.write_bytes(f"{dest}/{rel}", path.read_bytes(), executable=path.stat().st_mode & 0o111 != 0)


async def verify(task: HarborTask, sandbox: Sandbox, provider: SandboxProvider, spec: SandboxSpec,
                 tests: list[tuple[str, Path]], carry_timeout_s: float | None = None) -> Grade:
    """Grade the agent's work in `sandbox` (made from `spec`) with the task's tests (files of tests/). In
    separate mode the workspace's carry into the verifier (copied out, rewritten as data, unpacked) has
    `carry_timeout_s` in all (default: the sandbox's limit for rollway's own work over the workspace,
    `keeper_timeout_s`, which `HarborTaskSet.grading_time_limit_s` counts so that the scheduler waits for
    it), the verifier's start not counted: past it the grade is 0."""
    settings: VerifierSettings = task.verifier
    details: dict[str, Any] = {"task": task.name, "verifier_mode": settings.mode}
    if settings.mode == "shared":
        return await run_tests(task, sandbox, tests, details)
    if not isinstance(sandbox, DockerSandbox):
        raise found_before_agent_code(SandboxError("tasks.type=harbor needs sandbox.type=docker (the verifier runs "
                                                   "in the task's image)"))
    limit_mb = provider.limits(spec)[2]  # type: ignore[attr-defined]  # the agent's volume held no more
    if carry_timeout_s is None:
        carry_timeout_s = provider.config.keeper_timeout_s  # type: ignore[attr-defined]  # as its keeper's commands
    started = time.monotonic()
    carried = await asyncio.to_thread(export_workspace, provider, sandbox, limit_mb << 20, started + carry_timeout_s)
    if isinstance(carried, str):  # the agent's doing (its files' size or number): graded
        details.update(outcome=carried, limit_mb=limit_mb, carry_timeout_s=carry_timeout_s)
        return Grade(0.0, False, details=details)
    left = carry_timeout_s - (time.monotonic() - started)
    verifier = await start_verifier(task, provider, spec, sandbox.name, limit_mb)
    try:
        outcome, problem = await import_workspace(verifier, carried, left)
        if outcome is not None:  # the agent's files could not be unpacked (in time): its doing, graded
            details.update(outcome=outcome, error=problem, carry_timeout_s=carry_timeout_s)
            return Grade(0.0, False, details=details)
        return await run_tests(task, verifier, tests, details)
    finally:
        await verifier.destroy()


async def start_verifier(task: HarborTask, provider: SandboxProvider, spec: SandboxSpec, agent_name: str,
                         workspace_mb: int) -> Sandbox:
    """A new container of the task's image (never a pooled one: its own workspace size), room for the
    carried tar and its unpacked files. Failing to start is the infrastructure's failure."""
    own = task.verifier.resources  # [verifier.environment], else the agent's limits
    verifier_spec = SandboxSpec(image=spec.image, memory_mb=own.get("memory_mb") or spec.memory_mb,
                                cpus=own.get("cpus") or spec.cpus, workspace_mb=2 * workspace_mb + 64)
    name = f"{agent_name[:60]}-verify-{uuid.uuid4().hex[:6]}"  # a retried grade never meets an old one
    try:
        return await provider.create(verifier_spec, name)
    except SandboxError as exc:
        raise found_before_agent_code(HarborEnvError(f"env_error: the verifier sandbox of Harbor task {task.name} "
                                                     f"could not start: {exc}")) from exc


def export_workspace(provider: Any, sandbox: DockerSandbox, limit_bytes: int, deadline: float = math.inf) -> bytes | str:
    """The agent's workspace as a tar of plain data (see `as_data`), read by the engine (no process of
    the agent takes part); else the outcome that stopped it: `workspace_too_large` when the archive passes
    `limit_bytes` (plus tar headers), `workspace_carry_timeout` when it is not done by `deadline`
    (time.monotonic(): a workspace of many small files is slow to archive and rewrite well within its size).
    Returned, not raised: nothing of the agent's making may pass for the engine's failure here."""
    limit = limit_bytes + (64 << 20)
    with tempfile.TemporaryFile() as raw:
        with engine_errors("copy the workspace out", sandbox.name):
            stream, _stat = sandbox.client.api.get_archive(sandbox.container_id, WORKSPACE)  # its own engine's
            size = 0
            for chunk in stream:
                size += len(chunk)
                stop = ("workspace_too_large" if size > limit
                        else "workspace_carry_timeout" if time.monotonic() > deadline else None)
                if stop is not None:
                    stream.close()  # its connection too, once this frame is gone: the engine then ends its archive
                    return stop
                raw.write(chunk)
        # Out of engine_errors, which makes any error in it the engine's (retried): what the agent's files make
        # of the rewrite is not.
        raw.seek(0)
        carried = as_data(raw, deadline)
        return "workspace_carry_timeout" if carried is None else carried


def as_data(raw: IO[bytes], deadline: float = math.inf) -> bytes | None:
    """The archive of /workspace rewritten as data: names made relative, nothing under .rollway/ (where
    /logs and /tests point), only regular files, folders, links and hard links to kept files; owner set
    to the sandbox user, set-id and sticky bits dropped; nothing below a link (a link to /tmp cannot
    carry files there). None when not done by `deadline` (time.monotonic())."""
    out = io.BytesIO()
    links: set[str] = set()
    kept: set[str] = set()
    with tarfile.open(fileobj=raw, mode="r|") as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
            if time.monotonic() > deadline:
                return None
            name = _carried_name(member.name)
            if name is None or any(str(parent) in links for parent in PurePosixPath(name).parents):
                continue
            if member.islnk():
                target = _carried_name(member.linkname)
                if target not in kept:
                    continue
                member.linkname = target
            elif member.issym():
                links.add(name)
            elif not (member.isfile() or member.isdir()):
                continue  # devices, fifos
            member.name, member.mode = name, member.mode & 0o777
            member.uid = member.gid = SANDBOX_UID
            member.uname = member.gname = ""
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
            if member.isfile():
                kept.add(name)
    return out.getvalue()


def _carried_name(name: str) -> str | None:
    """`workspace/a/b` -> `a/b`; None for the root, anything under .rollway/, odd names."""
    parts = PurePosixPath(name).parts
    if len(parts) < 2 or parts[0] != PurePosixPath(WORKSPACE).name:
        return None
    rest = parts[1:]
    if rest[0] == ".rollway" or any(part in ("..", ".", "") for part in rest):
        return None
    return "/".join(rest)


async def import_workspace(verifier: Sandbox, carried: bytes, timeout_s: float) -> tuple[str | None, str]:
    """The carried tar unpacked into the verifier's workspace by its unprivileged user (modes kept,
    owner the user), within `timeout_s` (at least a second): (None, "") when it worked, else the outcome
    (`workspace_not_carried`, `workspace_carry_timeout`) and the end of tar's output."""
    await verifier.write_bytes(CARRY, carried)
    out = await verifier.exec(f"tar -C {WORKSPACE} -xpf {CARRY} --no-same-owner; rc=$?; rm -f {CARRY}; exit $rc",
                              timeout_s=max(1.0, timeout_s))
    if out.timed_out:
        return "workspace_carry_timeout", out.output[-1000:]
    return (None, "") if out.exit_code == 0 else ("workspace_not_carried", out.output[-1000:])


def _prepare_script(stage: str) -> str:
    """Run as KEEPER: /tests and /logs made afresh in JUDGE (whatever was there moved aside: in shared mode
    the agent could leave files in a folder open to it), the staged tests copied in read-only, and the files
    test.sh writes made in advance, owned by KEEPER and open to every user for writing only: in a sticky
    folder, so that no process of the judged user can remove, replace, chmod or lock them."""
    old = "old-$(date +%s%N)"
    return (f"set -e; mkdir -p -m 0755 {VERDICT}; cd {VERDICT}; for d in tests logs; do [ ! -e $d ] || mv $d $d-{old}; "
            f"done; mkdir -m 0755 tests logs; mkdir -m 1777 logs/verifier logs/agent; "
            f"cp -R {WORKSPACE}/{stage}/. tests/; chmod -R u+rwX,go+rX,go-w tests; "
            f"cd logs/verifier; touch {' '.join(_WRITTEN)}; chmod 0666 {' '.join(_WRITTEN)}")


_WRITTEN = ("reward.txt", "reward.json", "test-stdout.txt")
"""Made by the keeper before test.sh runs; a reward file counts as written when it is not empty."""
LEFT = "rollway-left"
STARTED = "rollway-test-started"
"""Printed by the verifier's shell just before test.sh: what follows ran the task's and the agent's code."""


def test_command(settings: VerifierSettings) -> str:
    """test.sh with [verifier] env, run by the execute-only bash (not dumpable: no program it runs may
    rewrite it through /proc/PID/mem); then the number of other live processes of this user (a program of
    the agent's that outlived test.sh could rewrite the reward after test.sh wrote it) and the status."""
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in settings.env.items())
    # Only bash builtins after test.sh (no fork): pids of this shell, `timeout` above it and the wrapper above
    # that are skipped; every other process of this uid that is not a zombie counts.
    scan = ("read -r _ _ _ w _ < /proc/$PPID/stat; n=0; for s in /proc/[0-9]*/status; do p=${s#/proc/}; p=${p%/status}; "
            "case \" $$ $PPID $w \" in *\" $p \"*) continue;; esac; u=; st=; "
            "while read -r k v _; do case $k in Uid:) u=$v;; State:) st=$v;; esac; done < $s 2>/dev/null; "
            f"[ \"$u\" = \"$UID\" ] && [ \"$st\" != Z ] && n=$((n+1)); done; echo {LEFT}=$n")
    return (f"echo {STARTED}; env {env} {JUDGE_BIN}/bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1; rc=$?; "
            f"{scan}; echo rollway-exit=$rc; exit $rc")


async def run_tests(task: HarborTask, box: Sandbox, tests: list[tuple[str, Path]], details: dict[str, Any]) -> Grade:
    """tests/test.sh run in `box` and graded (see the module docstring)."""
    if not isinstance(box, DockerSandbox):
        raise SandboxError("tasks.type=harbor needs sandbox.type=docker (the verifier runs in the task's image)")
    stage = f".rollway-tests-{uuid.uuid4().hex}"  # a new name: nothing the agent left can be in its way
    await copy_folder(box, tests, stage)
    await box.keeper_exec(_prepare_script(stage), "the Harbor verifier's folders")
    await box.exec(f"rm -rf {stage}")
    settings: VerifierSettings = task.verifier
    timeout_s = task.timeout("verifier", VERIFIER_TIMEOUT_S)
    command = test_command(settings)
    if settings.user is None:
        ran = await box.exec(command, timeout_s=timeout_s)
    else:
        ran = await box.exec_as(settings.user, command, timeout_s=timeout_s)
    if ran.timed_out:
        details.update(outcome="test_timeout", timeout_s=timeout_s)
        return Grade(0.0, False, stop_reason="test_timeout", details=details)
    if settings.user is not None:  # the sandbox user's leftovers die with its command (the exec wrapper)
        await box.exec_as(settings.user, "kill -9 -1 2>/dev/null; true")
    exits = re.findall(r"rollway-exit=(\d+)", ran.output)
    left = re.findall(rf"{LEFT}=(\d+)", ran.output)
    if not exits and STARTED in ran.output:  # test.sh started: its shell was killed by what it ran
        details.update(outcome="test_failed", exit_code=ran.exit_code, error="the verifier's shell ended before "
                       "test.sh's status was written (killed by a program test.sh ran)")
        return Grade(0.0, False, details=details)
    if not exits:
        raise HarborEnvError(f"env_error: tests/test.sh of {task.name} could not be started as [verifier] user "
                             f"{settings.user or 'the sandbox user'} (exit code {ran.exit_code}, "
                             f"{len(ran.output)} bytes of output): {ran.output[-500:]}")
    if not ended_as_reported(ran.exit_code, int(exits[-1])):
        details.update(outcome="test_failed", exit_code=ran.exit_code, reported=int(exits[-1]))
        return Grade(0.0, False, details=details)
    if left and int(left[-1]) > 0:
        details.update(outcome="processes_outlived_test", left=int(left[-1]), test_output=await _output_tail(box))
        return Grade(0.0, False, details=details)
    listed = await box.keeper_exec(LIST_REWARDS, "list the reward files")
    return await _graded(box, int(exits[-1]), re.findall(r"rollway-wrote=(\S+)", listed.output), details)


def ended_as_reported(engine_status: int, reported: int) -> bool:
    """The status the engine saw for the verifier's command is the one its last line reports: a process that
    killed the verifier's shell after writing such a line into its output (were it able to) would differ."""
    return engine_status == reported


LIST_REWARDS = (f"for f in reward.txt reward.json; do [ -s {VERDICT}/logs/verifier/$f ] && echo rollway-wrote=$f; "
                "done; true")
"""Which reward files test.sh wrote (not empty; run once no process of the verifier is left)."""


async def _graded(box: DockerSandbox, exit_code: int, written: list[str], details: dict[str, Any]) -> Grade:
    """The reward test.sh wrote (files in `written`), or 0 with the reason (no reward, not a number, a
    non-zero exit)."""
    try:
        reward = await _read_reward(box, written)
    except ValueError as exc:
        details.update(outcome="bad_reward", error=str(exc), test_output=await _output_tail(box))
        return Grade(0.0, False, details=details)
    if exit_code != 0 or reward is None:
        details.update(outcome="test_failed" if exit_code != 0 else "no_reward", exit_code=exit_code,
                       reward_written=reward, test_output=await _output_tail(box))
        return Grade(0.0, False, details=details)
    details.update(outcome="resolved" if reward >= 1.0 else "unresolved", reward=reward)
    return Grade(reward, reward >= 1.0, details=details)


async def _read_reward(box: DockerSandbox, written: list[str]) -> float | None:
    """reward.txt (a number) or reward.json ({"reward": number}), the first that test.sh wrote as a
    regular file; None when it wrote neither. A failed read is the engine's failure and propagates."""
    for name in ("reward.txt", "reward.json"):
        if name not in written:
            continue
        text = (await box.keeper_exec(f"head -c 4096 {VERDICT}/logs/verifier/{name}", f"read {name}")).output.strip()
        try:
            reward = float(json.loads(text)["reward"]) if name.endswith(".json") else float(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{name} holds {text[:100]!r}, not a number") from exc
        if not math.isfinite(reward):  # nan or inf would reach every advantage of its group
            raise ValueError(f"{name} holds {text[:100]!r}, not a finite number")
        return reward
    return None


async def _output_tail(box: DockerSandbox) -> str:
    try:
        return (await box.keeper_exec(f"tail -c 1500 {VERDICT}/logs/verifier/test-stdout.txt", "read the test output")).output
    except SandboxError:
        return ""
