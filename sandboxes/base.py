"""The sandbox interface: an isolated workspace per episode that any worker can reattach to."""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command run inside a sandbox."""

    exit_code: int
    output: str
    """stdout and stderr interleaved, already truncated to the configured size (with a notice)."""
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0


def claim_in_folder(folder: Path, key: str) -> bool:
    """`mkdir folder/key` (atomic): True when this call made it, False when it existed."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        (folder / key).mkdir()
    except FileExistsError:
        return False
    return True


def open_workspace_folder(workspace: str | os.PathLike[str], parts: tuple[str, ...] | list[str], *,
                          create: bool = False, owner: int | None = None) -> int:
    """A descriptor of the folder `workspace/parts...` (the caller closes it), for host-side writes,
    removals and sockets in a folder the agent can write to: each part is opened relative to the one
    before with O_NOFOLLOW, so a part the agent made a link (to a host folder) is refused, not followed,
    race-free (a swap after the open changes nothing: the descriptor stays on the folder it opened).
    `create`: missing parts are made (mode 0755, given to `owner` when set). The workspace root itself is
    the host's own path and is opened as given."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            if not part or "/" in part or part in (".", ".."):
                raise SandboxError(f"{part!r} is not one plain folder name")
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(part, owner, owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as err:
                raise SandboxError(f"the workspace's {'/'.join(parts)} is not a plain folder at {part!r} "
                                   f"({err.strerror}): rollway never writes through a link there") from err
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_in_folder(folder_fd: int, name: str) -> None:
    """Remove the entry `name` of the folder open at `folder_fd` (a link itself, never its target);
    silent when it is gone."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder_fd)


def claim_in_workspace(workspace: Path, key: str) -> bool:
    """`mkdir .rollway/turns/<key>` in a workspace the agent writes to, as `claim_in_folder`, but never
    through a link (`open_workspace_folder`): a `.rollway` or `turns` the agent made a symlink (to a host
    folder) is refused, not followed, race-free."""
    if not key or "/" in key or key in (".", ".."):
        raise ValueError(f"turn key {key!r} must be one plain name")
    fd = open_workspace_folder(workspace, (".rollway", "turns"), create=True)
    try:
        try:
            os.mkdir(key, 0o755, dir_fd=fd)
        except FileExistsError:
            return False
        return True
    finally:
        os.close(fd)


class SandboxError(RuntimeError):
    """The sandbox cannot be created or used; the message names the fix."""


class OutputLost(SandboxError):
    """A command's output stream ended before the command's last line (the engine's race, moby#27289; the
    client's own loss of buffered bytes was one cause, fixed). The command may have done its work, so it is not run
    again here; a caller that can play its whole check again in a fresh sandbox (`tasks verify`, `sandbox
    check`, the grader check's setup) does. In an episode base/blame.py decides, as for any SandboxError."""


OUTPUT_LOST_PLAYS = 3
"""Plays of a whole check while the engine loses a command's output (`again_while_output_lost`)."""
T = TypeVar("T")


def output_lost(exc: BaseException) -> OutputLost | None:
    """The engine's lost output behind `exc`: `exc` itself or an error it was raised from (a grader that
    turns a command of its own check into GradingEnvError keeps the loss as the cause)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OutputLost):
            return seen
        seen = seen.__cause__
    return None


async def again_while_output_lost(play: Callable[[], Awaitable[T]], on_lost: Callable[[OutputLost], None]) -> T:
    """`play()`, a whole check in a fresh sandbox of its own (`tasks verify`, `sandbox check`, a grader check
    row), played again while the engine loses a command's output (raised as is, or as the cause of the
    error a grader raised), up to OUTPUT_LOST_PLAYS plays; `on_lost` is told of each loss that is played
    again, the last one propagates."""
    for _ in range(OUTPUT_LOST_PLAYS - 1):
        try:
            return await play()
        except Exception as exc:
            lost = output_lost(exc)
            if lost is None:
                raise
            on_lost(lost)
    return await play()


class EngineUnreachable(SandboxError):
    """The engine that holds (or was to hold) the sandbox does not answer, or this worker does not know it
    (a handle naming an engine absent from its `sandbox.engines`): a failure observed from outside the
    sandbox, which nothing the agent did can cause. The attempt fails as infrastructure and is re-issued
    (placed on an engine that answers); it is never graded."""

    infrastructure = True
    """Observed from outside the sandbox: never the agent's doing (base/blame.py)."""


class EngineOutOfDisk(SandboxError):
    """The engine answers but cannot write to its data root ("no space left on device": a container's files,
    an image's layers). The engine's problem, not the episode's (a sandbox's own writes go to tmpfs, never
    there): the fleet places the sandbox on another engine and skips this one for a while; where it
    reaches a stage, the attempt fails as infrastructure and is re-issued."""

    infrastructure = True


class SandboxGone(SandboxError):
    """The sandbox named by a handle no longer exists. rollway destroys a sandbox only when its
    attempt ends (graded, failed, or a duplicate), so a turn that finds it gone is a redelivery of
    an attempt that already ended (or the sandbox lives on another machine or engine)."""

    infrastructure = True
    """Observed from outside the sandbox: never the agent's doing (base/blame.py)."""


class Sandbox(ABC):
    """One episode's isolated workspace.

    The framework creates it in the init actor, reattaches to it by `handle` in whichever agent or
    reward worker handles a later message (so all state must live in the sandbox, not in this
    object), and destroys it in the reward actor.
    """

    @property
    @abstractmethod
    def handle(self) -> dict[str, Any]:
        """Plain data (msgpack-able) from which `SandboxProvider.attach` rebuilds this object."""

    @property
    def workspace_path(self) -> str | None:
        """Host folder holding the workspace when it is a local folder (tools may read it
        directly, e.g. for code search); None when it lives elsewhere (a container)."""
        return None

    @abstractmethod
    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run a shell command in the workspace (cwd = workspace root)."""

    @abstractmethod
    async def read_file(self, path: str) -> str:
        """Read a file; `path` is relative to the workspace root (absolute paths are refused)."""

    @abstractmethod
    async def write_file(self, path: str, content: str) -> None:
        """Create or replace a file in the workspace (parents created)."""

    async def write_bytes(self, path: str, data: bytes, executable: bool = False) -> None:
        """Create or replace a file with exactly these bytes (binary task files: Harbor tests/ and
        solution/), parents created; `executable` sets its x bits. Default: base64 chunks through
        `exec` (a command line holds at most 128 KiB); the built-in sandboxes write directly."""
        import base64
        import shlex

        target = shlex.quote(path)
        encoded = base64.b64encode(data).decode()
        chunks = [encoded[i:i + 65536] for i in range(0, len(encoded), 65536)] or [""]
        for i, chunk in enumerate(chunks):
            redirect = ">" if i == 0 else ">>"
            result = await self.exec(f"mkdir -p \"$(dirname {target})\" && printf %s '{chunk}' | base64 -d {redirect} "
                                     f"{target}")
            if result.exit_code != 0:
                raise SandboxError(f"writing {path} failed: {result.output[-500:]}")
        if executable:
            await self.exec(f"chmod +x {target}")

    @abstractmethod
    async def diff(self) -> str:
        """Unified diff (git style, a/ b/ prefixes) of the workspace against its base snapshot."""

    @abstractmethod
    async def destroy(self) -> None:
        """Remove the workspace and everything it holds; safe to call twice."""

    async def claim_turn(self, key: str) -> bool:
        """Atomically mark that the tool calls of turn `key` start now in this sandbox; False when
        the mark already exists (the turn is being run a second time after a crash or a rebalance,
        on a workspace its first run may have changed). The agent calls it before every turn's tools.
        Default: `mkdir` (atomic) under the workspace's `.rollway/turns/` (excluded from diffs), on
        the host folder when there is one, else by a command; sandboxes with private storage beside
        the workspace keep the marks there instead."""
        if self.workspace_path is not None:
            return claim_in_workspace(Path(self.workspace_path), key)
        result = await self.exec(f"mkdir -p .rollway/turns && mkdir .rollway/turns/{key} 2>/dev/null")
        return result.exit_code == 0


@dataclass
class SandboxSpec:
    """What to build a sandbox from: a source folder to copy, or nothing (empty workspace)."""

    source_dir: str | None = None
    """Folder copied into the workspace as its base snapshot."""
    image: str | None = None
    """Container image (docker sandboxes)."""
    files: dict[str, str] = field(default_factory=dict)
    """Extra files written into the workspace after the copy (path -> content)."""
    setup_commands: list[str] = field(default_factory=list)
    """Commands run once in the new sandbox before the base snapshot is taken."""
    memory_mb: int | None = None
    """This sandbox's memory limit instead of `sandbox.memory_mb` (a task's own limit, e.g. Harbor's
    [environment] memory_mb); None: the configured one."""
    cpus: float | None = None
    """This sandbox's CPU quota instead of `sandbox.cpus` (capped at the host's cores for docker)."""
    workspace_mb: int | None = None
    """This sandbox's workspace size cap instead of `sandbox.workspace_mb` (Harbor's storage_mb)."""

    def limits_over(self, memory_mb: int, cpus: float, workspace_mb: int) -> tuple[int, float, int]:
        """(memory_mb, cpus, workspace_mb): this spec's own limits where set, else the given defaults."""
        return (self.memory_mb or memory_mb, self.cpus or cpus, self.workspace_mb or workspace_mb)


class SandboxProvider(ABC):
    """Creates sandboxes of one kind. Chosen by `sandbox.type` through `build_sandbox_provider`."""

    engine: str | None = "local"
    """The engine its creations count against in metrics (`rollway_sandboxes_creating`); None for a fleet,
    which counts each on the engine it chose."""

    @abstractmethod
    async def create(self, spec: SandboxSpec, name: str) -> Sandbox:
        """Create a sandbox for one episode attempt; `name` is unique per attempt."""

    @abstractmethod
    async def attach(self, handle: dict[str, Any]) -> Sandbox:
        """Rebuild a sandbox object from its handle (another worker may have created it)."""

    async def close(self) -> None:
        """Release what the provider itself holds (e.g. a warm pool) when its stage stops; the
        sandboxes it created stay (other workers may still use them)."""

    @abstractmethod
    async def check(self) -> dict[str, Any]:
        """Which protections hold here, e.g. {"network_isolated": True, ...}; raises SandboxError
        naming the fix when this kind of sandbox cannot run at all."""
