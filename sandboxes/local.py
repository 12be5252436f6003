"""Local sandboxes: a host workspace folder per episode, every command run in a fresh bubblewrap jail."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

import structlog

from rollway.sandboxes import cgroups, hostfs
from rollway.sandboxes.base import (
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxGone,
    SandboxProvider,
    SandboxSpec,
    claim_in_folder,
)
from rollway.sandboxes.config import LocalSandboxConfig
from rollway.sandboxes.jail import JailLimits, JailRunner
from rollway.sandboxes.task_tree import drop_caches, installed_copies, retime_tree

DEFAULT_ROOT = "/tmp/rollway-sandboxes"
"""Stable, so every worker process on this machine finds the workspaces the others created."""

log = structlog.get_logger(__name__)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_READY = "READY"
_LIMITS = "limits.json"
"""Beside the workspace: the limits the sandbox's spec set (memory_mb, cpus, workspace_mb)."""
_HIDDEN = "hidden.json"
"""Beside the workspace: the clean copies of its libraries the jail hides (task_tree.installed_copies)."""
# Interpreter caches would only add noise (and binary hunks) to an agent's diff; `.rollway/` holds
# tool state (the editor's undo history), not the agent's work.
_EXCLUDES = "__pycache__/\n*.py[cod]\n.pytest_cache/\n/.rollway/\n"
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,  # the host user's diff.noprefix & co must not shape the diff
    "GIT_AUTHOR_NAME": "rollway", "GIT_AUTHOR_EMAIL": "rollway@localhost",
    "GIT_COMMITTER_NAME": "rollway", "GIT_COMMITTER_EMAIL": "rollway@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}  # fmt: skip


@functools.cache
def machine_id() -> str:
    """This machine, as local sandbox handles name it: /etc/machine-id (where there is one) with the host
    name (a container image may carry a copied machine-id; two hosts may share a name, rarely both)."""
    try:
        with open("/etc/machine-id") as f:
            ident = f.read().strip()
    except OSError:
        ident = ""
    return f"{ident}:{socket.gethostname()}" if ident else socket.gethostname()


class LocalSandbox(Sandbox):
    """A workspace folder `<root>/<name>/workspace` plus, beside it and out of the jail's reach, the
    git repository `<root>/<name>/base.git` holding the base snapshot (so an agent cannot rewrite
    the base its diff is measured against)."""

    def __init__(self, provider: LocalSandboxProvider, box_dir: Path) -> None:
        self._provider = provider
        self.box_dir = box_dir
        self.workspace = box_dir / "workspace"
        self.git_dir = box_dir / "base.git"

    @property
    def handle(self) -> dict[str, Any]:
        return {"kind": "local", "path": str(self.workspace), "name": self.box_dir.name, "machine": machine_id()}

    @property
    def workspace_path(self) -> str | None:
        return str(self.workspace)

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        if not self.workspace.is_dir():
            raise SandboxError(f"sandbox {self.box_dir.name} was destroyed; create a new one")
        limits = JailLimits.from_config(self._provider.config, timeout_s)
        memory_mb = self._provider.box_limits(self.box_dir)[0]
        cgroup = self._provider.cgroup(self.box_dir.name)
        limits = dataclasses.replace(limits, address_space_mb=self._provider.address_space_mb(memory_mb))
        procs = cgroup.procs_files if cgroup is not None else None
        home = self.box_dir / "home"
        if self._provider.config.home == "persistent" and not home.is_dir():
            await asyncio.to_thread(self._provider.make_home, home)  # a sandbox made before homes existed
        return await self._provider.runner.run(str(self.workspace), command, limits, procs,
                                               home=str(home) if self._provider.config.home == "persistent" else None,
                                               hidden=self._hidden())

    def _hidden(self) -> list[str]:
        """The clean copies of the workspace's libraries the jail hides (found when the sandbox was made)."""
        try:
            return json.loads((self.box_dir / _HIDDEN).read_text())
        except FileNotFoundError:
            return []

    async def read_file(self, path: str) -> str:
        resolve_inside(self.workspace, path)  # the messages for absolute paths, `..`, links out
        return await asyncio.to_thread(self._read, path)

    def _read(self, path: str) -> str:
        """Only a regular file, never blocking (a FIFO the agent made), bounded by the sandbox's file size."""
        try:
            data = hostfs.read_regular(str(self.workspace), hostfs.inside(str(self.workspace), path),
                                       self._provider.config.max_file_mb * 2**20)
        except (hostfs.NotARegularFile, FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:
            raise SandboxError(f"{path!r} is not a file in the workspace ({err.strerror or err})") from None
        return data.decode("utf-8", errors="replace")

    async def write_file(self, path: str, content: str) -> None:
        await asyncio.to_thread(self._write, path, content.encode("utf-8"))

    async def write_bytes(self, path: str, data: bytes, executable: bool = False) -> None:
        await asyncio.to_thread(self._write, path, data, executable)

    def _write(self, path: str, data: bytes, executable: bool = False) -> None:
        """Through descriptors (hostfs): never onto a FIFO or device the agent made, never through a link
        (one the agent swaps in after `resolve_inside` looked is refused). What is written is given to the
        jail user (it must be able to edit it)."""
        root = os.path.realpath(self.workspace)
        rel = os.path.relpath(resolve_inside(self.workspace, path), root)
        try:
            hostfs.write_regular(root, rel, data, 0o755 if executable else None, owner=self._provider.runner.host_uid)
        except hostfs.NotARegularFile as err:
            raise SandboxError(f"cannot write {rel!r}: {err.strerror}") from None

    async def diff(self) -> str:
        return await asyncio.to_thread(self._diff)

    def _diff(self) -> str:
        """Stage the workspace into a throwaway copy of the base index (concurrent diffs and the
        base snapshot stay untouched) and diff it against the base commit."""
        with tempfile.NamedTemporaryFile(dir=self.box_dir, prefix="index.") as index:
            shutil.copy2(self.git_dir / "index", index.name)  # keep mtime: git's racy-clean check needs it
            env = {"GIT_INDEX_FILE": index.name}
            self._git(["add", "--all", "."], env)
            return self._git(
                ["diff", "--cached", "--binary", "--no-renames", "--no-ext-diff", "--no-textconv",
                 "--no-color", "--src-prefix=a/", "--dst-prefix=b/", "HEAD"], env,
            )  # fmt: skip

    def _git(self, args: list[str], env: dict[str, str] | None = None) -> str:
        return run_git(self.git_dir, self.workspace, args, env)

    async def claim_turn(self, key: str) -> bool:
        """The marks live beside the workspace, out of the jail's sight (`ls` in the workspace and a
        re-run of the episode see nothing)."""
        return claim_in_folder(self.box_dir / "turns", key)

    async def destroy(self) -> None:
        self._provider._limits.pop(str(self.box_dir), None)
        cgroup = self._provider.cgroup(self.box_dir.name, create=False)
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)
        await asyncio.to_thread(remove_tree, self.box_dir)


class LocalSandboxProvider(SandboxProvider):
    """Creates bubblewrap sandboxes under `config.root`; any provider on the same machine with the
    same root can attach to them."""

    def __init__(self, config: LocalSandboxConfig | None = None) -> None:
        self.config = config or LocalSandboxConfig()
        self.root = Path(self.config.root or DEFAULT_ROOT)
        self.runner = JailRunner(self.config)
        self.workspace_cap = os.geteuid() == 0
        """Whether workspaces are size-capped tmpfs mounts (root with mount rights)."""
        self.cgroup_kind = cgroups.mechanism()
        """"v2"/"v1" when whole-sandbox cgroups work here (root), else None (per-process limits only)."""
        self.memory_held = self.cgroup_kind is not None and cgroups.swap_held(self.cgroup_kind)
        """Whether the sandbox's cgroup bounds all the memory its processes can use (swap too)."""
        self._limits: dict[str, tuple[int, float, int]] = {}

    def cgroup(self, name: str, create: bool = True) -> cgroups.SandboxCgroup | None:
        """The sandbox's cgroup, created with its limits (box_limits) on first use."""
        if self.cgroup_kind is None:
            return None
        group = cgroups.SandboxCgroup(name, self.cgroup_kind)
        if create:
            memory_mb, cpus, _ = self.box_limits(self._box_dir(name))
            group.ensure(memory_mb, self.config.max_processes, cpus)
        return group

    def address_space_mb(self, memory_mb: int) -> int | None:
        """RLIMIT_AS of each process of a sandbox whose memory is `memory_mb`: `sandbox.address_space_mb`
        where set; else none where its memory cgroup holds real memory (every page a process writes,
        tmpfs pages too, is charged there, so reserving address space gains a hostile program
        nothing), and `memory_mb` where no cgroup can, or where it cannot hold swap (the per-process
        bound is then the only one)."""
        if self.config.address_space_mb is not None:
            return self.config.address_space_mb
        return None if self.cgroup_kind is not None and self.memory_held else memory_mb

    def box_limits(self, box_dir: Path) -> tuple[int, float, int]:
        """(memory_mb, cpus, workspace_mb) of one sandbox: those its spec set (kept in `limits.json`
        beside the workspace, so every worker that attaches applies them), else sandbox.*."""
        cfg = self.config
        key = str(box_dir)
        if key not in self._limits:
            try:
                own = json.loads((box_dir / _LIMITS).read_text())
            except FileNotFoundError:
                own = {}
            self._limits[key] = (own.get("memory_mb") or cfg.memory_mb, own.get("cpus") or cfg.cpus,
                                 own.get("workspace_mb") or cfg.workspace_mb)
        return self._limits[key]

    def give_to_jail(self, path: Path) -> None:
        """Hand a host-created file to the host user the jail runs as (no-op when not root)."""
        if self.runner.host_uid is not None:
            os.lchown(path, self.runner.host_uid, self.runner.host_uid)

    async def create(self, spec: SandboxSpec, name: str) -> LocalSandbox:
        """Build the workspace, run setup, snapshot the base. Idempotent per name: a redelivered
        init message gets the finished sandbox back; a half-built one is rebuilt from scratch."""
        box_dir = self._box_dir(name)
        if (box_dir / _READY).exists():
            return LocalSandbox(self, box_dir)
        await asyncio.to_thread(self._prepare, spec, box_dir)
        hidden = await asyncio.to_thread(installed_copies, box_dir / "workspace", self.runner.python)
        (box_dir / _HIDDEN).write_text(json.dumps(hidden))  # beside the workspace: out of the jail's reach
        sandbox = LocalSandbox(self, box_dir)
        try:
            for command in spec.setup_commands:
                result = await sandbox.exec(command)
                if result.exit_code != 0 or result.timed_out:
                    raise SandboxError(
                        f"setup command {command!r} failed (exit {result.exit_code}, timed out: "
                        f"{result.timed_out}); fix the task's setup_commands. Output:\n{result.output[-2000:]}"
                    )
            # No agent command has run yet: the tree is the task's, and its caches and (retimed once the
            # snapshot has read every file) its times say nothing.
            await asyncio.to_thread(drop_caches, box_dir / "workspace")
            await asyncio.to_thread(self._snapshot, box_dir)
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    def _box_dir(self, name: str) -> Path:
        if not _NAME_RE.match(name):
            raise SandboxError(f"sandbox name {name!r} must match {_NAME_RE.pattern} (it names a folder)")
        return self.root / name

    def _prepare(self, spec: SandboxSpec, box_dir: Path) -> None:
        """Fresh folder with the source copy and extra files, owned by the jail's host user."""
        self._ensure_root()
        remove_tree(box_dir)
        box_dir.mkdir(mode=0o711)
        workspace = box_dir / "workspace"
        if spec.source_dir and not os.path.isdir(spec.source_dir):
            raise SandboxError(f"source_dir {spec.source_dir!r} is not a folder")
        workspace.mkdir()
        self._limits.pop(str(box_dir), None)
        own = {"memory_mb": spec.memory_mb, "cpus": spec.cpus, "workspace_mb": spec.workspace_mb}
        if any(own.values()):
            (box_dir / _LIMITS).write_text(json.dumps(own))
        if self.workspace_cap:  # a tmpfs of workspace_mb on the folder
            try:
                mount_tmpfs(workspace, self.box_limits(box_dir)[2])
            except SandboxError as exc:  # root without mount rights (a container): no cap, said once
                self.workspace_cap = False
                log.warning("local workspaces are not size-capped", reason=str(exc))
        if spec.source_dir:
            shutil.copytree(spec.source_dir, workspace, symlinks=True, dirs_exist_ok=True)
        workspace.chmod(0o755)
        for rel, content in spec.files.items():
            root = os.path.realpath(workspace)
            try:
                hostfs.write_regular(root, os.path.relpath(resolve_inside(workspace, rel), root), content.encode())
            except hostfs.NotARegularFile as err:
                raise SandboxError(f"cannot write the task file {rel!r}: {err.strerror}") from None
        if self.runner.host_uid is not None:
            for path in [workspace, *workspace.rglob("*")]:
                self.give_to_jail(path)
        if self.config.home == "persistent":
            self.make_home(box_dir / "home")

    def make_home(self, home: Path) -> None:
        """The sandbox's HOME folder (sandbox.home: persistent), beside the workspace, owned by the jail user."""
        home.mkdir(mode=0o700, exist_ok=True)
        self.give_to_jail(home)

    def _ensure_root(self) -> None:
        """The root is traversable (not listable) by others: the unprivileged jail user must reach
        its workspace through it."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.root.stat().st_uid != os.geteuid():
            raise SandboxError(f"{self.root} belongs to another user; set sandbox.root to a folder of yours")
        self.root.chmod(0o711)

    def _snapshot(self, box_dir: Path) -> None:
        git_dir, workspace = box_dir / "base.git", box_dir / "workspace"
        git_dir.mkdir(mode=0o700)
        run_git(git_dir, workspace, ["init", "--quiet"])
        (git_dir / "info").mkdir(exist_ok=True)
        (git_dir / "info" / "exclude").write_text(_EXCLUDES)
        run_git(git_dir, workspace, ["add", "--all", "."])
        run_git(git_dir, workspace, ["commit", "--quiet", "--allow-empty", "--no-verify", "-m", "base"])
        retime_tree(workspace)  # after `git add`, which read every file in path order (access times)
        (box_dir / _READY).touch()

    async def attach(self, handle: dict[str, Any]) -> LocalSandbox:
        if handle.get("kind") != "local":
            raise SandboxError(
                f"handle {handle!r} is not a local sandbox; set sandbox.type to match its kind"
            )
        if handle.get("machine") != machine_id():
            # A local sandbox is a folder on the machine that made it: a same-named folder here is another one.
            raise SandboxError(f"handle of local sandbox {handle.get('name')!r} was made on machine "
                               f"{handle.get('machine')!r}, not this one ({machine_id()!r}): a local sandbox "
                               "stays on its machine; run the agent and reward stages there, or use sandbox.type=docker "
                               "with a fleet of engines (docs/deployment.md)")
        box_dir = self._box_dir(str(handle.get("name")))
        if Path(handle.get("path", "")) != box_dir / "workspace":
            raise SandboxError(f"handle path {handle.get('path')!r} is not under sandbox.root {self.root}; "
                               "workers sharing sandboxes need the same sandbox.root")  # fmt: skip
        # A handle comes from a message: the folder must be a real one directly under the root (a symlink
        # there could lead destroy's rmtree and every exec to any folder on the host).
        if box_dir.is_symlink() or Path(os.path.realpath(box_dir)).parent != Path(os.path.realpath(self.root)):
            raise SandboxError(f"handle {handle!r} names {box_dir}, which leads out of sandbox.root {self.root}; "
                               "refusing to use it")
        if not (box_dir / _READY).exists():
            raise SandboxGone(f"sandbox {box_dir} does not exist (destroyed, or created on another machine)")
        return LocalSandbox(self, box_dir)

    async def check(self) -> dict[str, Any]:
        from rollway.sandboxes.probes import probe_local

        return await probe_local(self)


def resolve_inside(workspace: Path, path: str) -> Path:
    """Host path of workspace-relative `path`; refuses anything that would leave the workspace
    (absolute paths, `..`, symlinks pointing out), because tools run these on the host as root."""
    if not path or PurePosixPath(path).is_absolute():
        raise SandboxError(f"path {path!r} must be relative to the workspace root ({workspace.name}/)")
    if ".." in PurePosixPath(path).parts:
        raise SandboxError(f"path {path!r} may not contain '..'")
    root = os.path.realpath(workspace)
    real = os.path.realpath(os.path.join(root, path))
    if real != root and not real.startswith(root + os.sep):
        raise SandboxError(f"path {path!r} resolves outside the workspace (through a symlink)")
    return Path(real)


def run_git(git_dir: Path, work_tree: Path, args: list[str], env: dict[str, str] | None = None) -> str:
    """Host git on the snapshot repository; the jail never sees `git_dir`."""
    cmd = ["git", "-c", "safe.directory=*", "-c", "core.autocrlf=false", "-c", "core.quotepath=false",
           f"--git-dir={git_dir}", f"--work-tree={work_tree}", *args]  # fmt: skip
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(git_dir),
        **_GIT_ENV,
        **(env or {}),
    }
    proc = subprocess.run(cmd, cwd=work_tree, env=full_env, capture_output=True)
    if proc.returncode != 0:
        raise SandboxError(f"git {' '.join(args)} failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode("utf-8", errors="replace")


def mount_tmpfs(folder: Path, size_mb: int) -> None:
    """Mount a tmpfs of `size_mb` on `folder` (root only): the local workspace's size cap. Its
    pages are memory, charged to the sandbox's cgroup when a jail writes them."""
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755,nosuid,nodev",
                           "rollway-workspace", str(folder)], capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SandboxError(f"cannot mount the workspace tmpfs on {folder}: {proc.stderr.strip()}; "
                           "the workspace size cap needs root with mount rights")  # fmt: skip


def _unmount_below(path: Path) -> None:
    """Lazily unmount every mount at or below `path` (workspace tmpfs), deepest first."""
    prefix = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as info:
            points = [line.split()[4] for line in info]
    except OSError:
        return
    below = [p for p in points if p == prefix or p.startswith(prefix + "/")]
    for point in sorted(set(below), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def remove_tree(path: Path) -> None:
    """rmtree that also clears folders the jail made read-only and unmounts workspace tmpfs;
    silent when already gone."""
    if os.geteuid() == 0 and path.exists():
        _unmount_below(path)

    def unlock(func: Any, failed: str, _exc: Any) -> None:
        os.chmod(os.path.dirname(failed), 0o700)
        func(failed)

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onerror=unlock)
