"""Grading a Harbor task where the agent cannot reach the verifier (`[verifier] environment_mode`).

separate (rollway's default): the agent's workspace (the task's working directory) is copied out of its
container by the engine, as data (regular files, folders and links, ownership and special bits dropped,
nothing under .rollway/, bounded by the workspace's size), into a fresh container of the task's image that
the agent never ran in. Only then are tests/ copied in and test.sh run, as `[verifier] user` with
`[verifier] env`; the reward is read from /logs/verifier, a folder the verifier made itself just before.
shared (when a task asks for it): test.sh runs in the agent's container, but /logs is removed and made
afresh by the verifier, which refuses to run (graded 0) unless /logs/verifier was new and empty.

No opt-out: a test.sh that wrote no reward, wrote a non-number, or exited non-zero is a graded 0 with the
reason in the details. Only the infrastructure (the verifier's container could not start, the engine
failed) raises HarborEnvError, which the pipeline retries instead of grading.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import shlex
import tarfile
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any, Literal

from rollway.envs.base import Grade
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec
from rollway.sandboxes.docker import WORKSPACE, DockerSandbox, engine_errors

if TYPE_CHECKING:
    from rollway.envs.harbor import HarborTask

HARBOR_DIR = ".rollway/harbor"
"""Workspace folder behind the image's /tests, /logs and /solution links (outside the graded diff)."""
LINKS = {"/tests": f"{HARBOR_DIR}/tests", "/logs": f"{HARBOR_DIR}/logs", "/solution": f"{HARBOR_DIR}/solution"}
CARRY = ".rollway/carry.tar"
NOT_FRESH = 97
"""Exit status of the test command when /logs/verifier existed before the verifier made it."""
SANDBOX_UID = 65534
"""Owner of every carried file (the docker sandbox's user)."""


class HarborEnvError(SandboxError):
    """The verifier's infrastructure failed (env_error); retried by the pipeline, never a reward."""


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
                 tests: list[tuple[str, Path]]) -> Grade:
    """Grade the agent's work in `sandbox` (made from `spec`) with the task's tests (files of tests/)."""
    settings: VerifierSettings = task.verifier
    details: dict[str, Any] = {"task": task.name, "verifier_mode": settings.mode}
    if settings.mode == "shared":
        return await run_tests(task, sandbox, tests, details)
    if not isinstance(sandbox, DockerSandbox):
        raise SandboxError("tasks.type=harbor needs sandbox.type=docker (the verifier runs in the task's image)")
    limit_mb = provider.limits(spec)[2]  # type: ignore[attr-defined]  # the agent's volume held no more
    carried = await asyncio.to_thread(export_workspace, provider, sandbox, limit_mb << 20)
    if carried is None:
        details.update(outcome="workspace_too_large", limit_mb=limit_mb)
        return Grade(0.0, False, details=details)
    verifier = await start_verifier(task, provider, spec, sandbox.name, limit_mb)
    try:
        problem = await import_workspace(verifier, carried)
        if problem is not None:  # the agent's files could not be unpacked: its doing, graded
            details.update(outcome="workspace_not_carried", error=problem)
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
        raise HarborEnvError(f"env_error: the verifier sandbox of Harbor task {task.name} could not start: {exc}") from exc


def export_workspace(provider: Any, sandbox: DockerSandbox, limit_bytes: int) -> bytes | None:
    """The agent's workspace as a tar of plain data (see `as_data`), read by the engine (no process of
    the agent takes part); None when the archive passes `limit_bytes` (plus tar headers)."""
    limit = limit_bytes + (64 << 20)
    with engine_errors("copy the workspace out", sandbox.name), tempfile.TemporaryFile() as raw:
        stream, _stat = sandbox.client.api.get_archive(sandbox.container_id, WORKSPACE)  # its own engine's
        size = 0
        for chunk in stream:
            size += len(chunk)
            if size > limit:
                return None
            raw.write(chunk)
        raw.seek(0)
        return as_data(raw)


def as_data(raw: IO[bytes]) -> bytes:
    """The archive of /workspace rewritten as data: names made relative, nothing under .rollway/ (where
    /logs and /tests point), only regular files, folders, links and hard links to kept files; owner set
    to the sandbox user, set-id and sticky bits dropped; nothing below a link (a link to /tmp cannot
    carry files there)."""
    out = io.BytesIO()
    links: set[str] = set()
    kept: set[str] = set()
    with tarfile.open(fileobj=raw, mode="r|") as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
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


async def import_workspace(verifier: Sandbox, carried: bytes) -> str | None:
    """The carried tar unpacked into the verifier's workspace by its unprivileged user (modes kept,
    owner the user); None when it worked, else tar's complaint."""
    await verifier.write_bytes(CARRY, carried)
    out = await verifier.exec(f"tar -C {WORKSPACE} -xpf {CARRY} --no-same-owner; rc=$?; rm -f {CARRY}; exit $rc")
    return None if out.exit_code == 0 else out.output[-1000:]


def _prepare_script() -> str:
    """Run as the sandbox user: /tests and /logs made afresh (links planted in their place removed); logs/
    open to a [verifier] user of another uid, who makes logs/verifier itself."""
    unlink = " ".join(f"[ -L {d} ] && rm -f {d};" for d in (".rollway", HARBOR_DIR, LINKS["/logs"], LINKS["/tests"]))
    return (f"{unlink} mkdir -p {HARBOR_DIR} && chmod -R u+rwX {LINKS['/logs']} 2>/dev/null; "
            f"rm -rf {LINKS['/tests']} {LINKS['/logs']} && mkdir -p {LINKS['/logs']}/agent && chmod 777 {LINKS['/logs']}")


def test_command(settings: VerifierSettings) -> str:
    """Make /logs/verifier (failing if anything is there), then test.sh with [verifier] env."""
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in settings.env.items())
    return (f"mkdir /logs/verifier && [ -z \"$(ls -A /logs/verifier)\" ] || exit {NOT_FRESH}; "
            f"env {env} bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1; echo rollway-exit=$?")


LIST_REWARDS = ("for f in reward.txt reward.json; do [ -f /logs/verifier/$f ] && [ ! -L /logs/verifier/$f ] "
                "&& echo rollway-wrote=$f; done; true")
"""Which reward files test.sh left as regular files (run once no process of the verifier is left)."""


async def run_tests(task: HarborTask, box: Sandbox, tests: list[tuple[str, Path]], details: dict[str, Any]) -> Grade:
    """tests/test.sh run in `box` and graded (see the module docstring)."""
    prepared = await box.exec(_prepare_script())
    if prepared.exit_code != 0:
        details.update(outcome="verifier_folder_not_fresh", error=prepared.output[-500:])
        return Grade(0.0, False, details=details)
    await copy_folder(box, tests, LINKS["/tests"])
    settings: VerifierSettings = task.verifier
    timeout_s = task.timeout("verifier", 600.0)
    command = test_command(settings)
    if settings.user is None:
        ran = await box.exec(command, timeout_s=timeout_s)
    else:
        ran = await box.exec_as(settings.user, command, timeout_s=timeout_s)  # type: ignore[attr-defined]
    if ran.timed_out:
        details.update(outcome="test_timeout", timeout_s=timeout_s)
        return Grade(0.0, False, stop_reason="test_timeout", details=details)
    exits = re.findall(r"rollway-exit=(\d+)", ran.output)
    if not exits and ran.exit_code == NOT_FRESH:
        details.update(outcome="verifier_folder_not_fresh")
        return Grade(0.0, False, details=details)
    if not exits:
        raise HarborEnvError(f"env_error: tests/test.sh of {task.name} could not be started as [verifier] user "
                             f"{settings.user or 'the sandbox user'} (exit code {ran.exit_code}, "
                             f"{len(ran.output)} bytes of output): {ran.output[-500:]}")
    if settings.user is not None:  # the sandbox user's leftovers die with its command (the exec wrapper)
        await box.exec_as(settings.user, "kill -9 -1 2>/dev/null; true")  # type: ignore[attr-defined]
    listed = await box.exec(LIST_REWARDS)
    return await _graded(box, int(exits[-1]), re.findall(r"rollway-wrote=(\S+)", listed.output), details)


async def _graded(box: Sandbox, exit_code: int, written: list[str], details: dict[str, Any]) -> Grade:
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


async def _read_reward(box: Sandbox, written: list[str]) -> float | None:
    """reward.txt (a number) or reward.json ({"reward": number}), the first that test.sh wrote as a
    regular file; None when it wrote neither. A failed read is the engine's failure and propagates."""
    for name in ("reward.txt", "reward.json"):
        if name not in written:
            continue
        text = (await box.read_file(f"{LINKS['/logs']}/verifier/{name}")).strip()
        try:
            return float(json.loads(text)["reward"]) if name.endswith(".json") else float(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{name} holds {text[:100]!r}, not a number") from exc
    return None


async def _output_tail(box: Sandbox) -> str:
    try:
        return (await box.read_file(f"{LINKS['/logs']}/verifier/test-stdout.txt"))[-1500:]
    except SandboxError:
        return ""
