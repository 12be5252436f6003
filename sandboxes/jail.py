"""Run one command in a fresh bubblewrap jail with wall-time, memory, process, file and output limits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass

from rollway.sandboxes.base import ExecResult, SandboxError
from rollway.sandboxes.config import LocalSandboxConfig
from rollway.sandboxes.seccomp import filter_program

JAIL_WORKSPACE = "/workspace"
"""Where the workspace appears inside every jail (and the cwd of every command) unless
`sandbox.workdir` says otherwise."""
JAIL_HOME = "/home/sandbox"
"""HOME inside a jail with `sandbox.home: persistent` (the sandbox's own `home` folder, bound read-write)."""
JAIL_UID = 65534
"""The unprivileged user (nobody) every command runs as inside the jail."""

# Host /etc entries a shell, git and Python need; everything else in /etc stays invisible.
_ETC_ENTRIES = (
    "alternatives",
    "ca-certificates",
    "group",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "passwd",
    "protocols",
    "services",
    "ssl",
)
# Top-level system folders: merged-/usr systems have symlinks here, older ones real folders.
_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

# Applied by a bash inside the jail, after bwrap created the user namespace: RLIMIT_NPROC then
# counts the processes of this jail only, so one jail's fork bomb cannot starve the others.
_LIMITS_SCRIPT = 'ulimit -c 0 -v {as_kb} -u {nproc} -f {fsize_kb} -n {nofile} || exit 125; exec bash -c "$1"'
# As root, bwrap runs as an unprivileged host user who may not reach the host folders it binds
# (a pyenv under a 0700 /root, a workspace under a private temp folder). In a private mount
# namespace that only this command sees, root first binds each folder onto STAGE_DIR/<i>.
STAGE_DIR = "/tmp/.rollway-stage"
# It also moves this process (and so every process of the jail) into the sandbox's cgroups, if any.
_STAGE_SCRIPT = (
    'set -e; stage=$1; cgroups=$2; shift 2; for f in $(echo "$cgroups" | tr , " "); do echo $$ > "$f"; done; '
    'mount -t tmpfs -o mode=0755,size=64k rollway-stage "$stage"; i=0; '
    'while [ "$1" != -- ]; do mkdir "$stage/$i"; mount --bind "$1" "$stage/$i"; i=$((i+1)); shift; done; '
    'shift; exec "$@"'
)


@dataclass(frozen=True)
class JailLimits:
    """Per-command limits; every field comes from LocalSandboxConfig unless a caller narrows it."""

    timeout_s: float
    address_space_mb: int | None
    """RLIMIT_AS of each process (`ulimit -v`); None: unlimited (a memory cgroup holds the sandbox)."""
    max_processes: int
    max_file_mb: int
    max_open_files: int
    max_output_bytes: int
    output_kill_bytes: int

    @classmethod
    def from_config(cls, cfg: LocalSandboxConfig, timeout_s: float | None = None) -> JailLimits:
        """The configured limits; address space: `address_space_mb`, else `memory_mb` (a jail with no
        cgroup; LocalSandbox.exec lifts it where the sandbox's memory cgroup holds real memory)."""
        return cls(
            timeout_s=timeout_s or cfg.exec_timeout_s,
            address_space_mb=getattr(cfg, "address_space_mb", None) or cfg.memory_mb,
            max_processes=cfg.max_processes,
            max_file_mb=cfg.max_file_mb,
            # Never above this process's own hard limit: a jail cannot raise it, and `ulimit -n` would fail.
            max_open_files=_within_own_limit(cfg.max_open_files),
            max_output_bytes=cfg.max_output_bytes,
            output_kill_bytes=max(cfg.output_kill_mb * 2**20, cfg.max_output_bytes),
        )


def _within_own_limit(max_open_files: int) -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return max_open_files if hard == resource.RLIM_INFINITY else min(max_open_files, hard)


class OutputCapture:
    """Keeps the first and last halves of a command's output, counting (not storing) the middle,
    so a command that prints gigabytes costs a bounded amount of memory and the agent still sees
    how its output began and ended (where test summaries are)."""

    def __init__(self, limit: int) -> None:
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    @property
    def omitted(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def text(self) -> str:
        if self.omitted <= 0:
            return bytes(self.head + self.tail).decode("utf-8", errors="replace")
        notice = f"\n[output truncated: {self.omitted} bytes omitted]\n"
        return (
            self.head.decode("utf-8", errors="replace") + notice + self.tail.decode("utf-8", errors="replace")
        )


def python_mounts(python: str | None) -> tuple[str, list[str]]:
    """(bin folder to put first on PATH, host folders to bind read-only) for the interpreter that
    graded repositories run their tests with: a venv needs both its own folder and its base
    interpreter's folder, bound at the same paths so the venv's symlinks resolve."""
    if python is None:
        prefix, base = sys.prefix, sys.base_prefix
    else:
        code = "import sys; print(sys.prefix); print(sys.base_prefix)"
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
        prefix, base = out.split()[:2]
    mounts = [p for p in dict.fromkeys([prefix, base]) if not (p == "/usr" or p.startswith("/usr/"))]
    return os.path.join(prefix, "bin"), mounts


def system_mount_args() -> list[str]:
    """bwrap arguments showing /usr and the top-level bin/lib folders (links or real) read-only."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    return args


def _ensure_stage_dir() -> None:
    """The stage mount point: an empty root-owned folder (recreated if a /tmp cleaner removed it)."""
    os.makedirs(STAGE_DIR, mode=0o755, exist_ok=True)
    info = os.lstat(STAGE_DIR)
    if info.st_uid != 0 or not stat.S_ISDIR(info.st_mode):
        raise SandboxError(f"{STAGE_DIR} is not a root-owned folder; remove it and retry")


class JailRunner:
    """Builds bwrap command lines and runs them with limits; one per provider, shared by its sandboxes."""

    def __init__(self, cfg: LocalSandboxConfig) -> None:
        self.cfg = cfg
        self.bwrap = shutil.which(cfg.bwrap) or cfg.bwrap
        self.python_bin, self.ro_mounts = python_mounts(cfg.python)
        self.python = cfg.python or sys.executable
        """The interpreter the jail runs tests with (task_tree.installed_copies asks it what it holds)."""
        self.ro_mounts += [p for p in cfg.ro_binds if p not in self.ro_mounts]
        # As host root, RLIMIT_NPROC is never enforced (the kernel exempts uid 0 even inside a user
        # namespace), so bwrap itself runs as an unprivileged host user.
        self.host_uid: int | None = (
            (cfg.host_uid if cfg.host_uid is not None else JAIL_UID) if os.geteuid() == 0 else None
        )
        self.seccomp = filter_program()
        """The seccomp program every jail loads (None where none is built for this architecture)."""

    def argv(
        self,
        workspace: str,
        command: str,
        limits: JailLimits,
        cgroup_procs: list[str] | None = None,
        seccomp_fd: int | None = None,
        home: str | None = None,
        hidden: list[str] | None = None,
    ) -> list[str]:
        """The full command line: [staging of host folders and cgroup join, uid switch,] bwrap,
        limits, command. `cgroup_procs`: cgroup.procs files the jail joins (root only);
        `seccomp_fd`: an open fd holding the seccomp program bwrap loads; `home`: a host folder
        bound read-write as HOME (JAIL_HOME), None: HOME=/tmp; `hidden`: paths of the bound folders
        the jail shows empty (task_tree.installed_copies)."""
        host_paths = [*self.ro_mounts, *([home] if home else []), workspace]
        if self.host_uid is None:
            sources = host_paths
        else:  # the unprivileged host user reaches each folder through the stage
            sources = [f"{STAGE_DIR}/{i}" for i in range(len(host_paths))]
        binds = list(zip(sources[: len(self.ro_mounts)], self.ro_mounts, strict=True))
        jail = [
            self.bwrap,
            *self._namespace_args(),
            *self._filesystem_args(sources[-1], binds, sources[-2] if home else None, hidden or []),
            *self._env_args(home is not None),
            *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
        ]
        as_kb = "unlimited" if limits.address_space_mb is None else limits.address_space_mb * 1024
        limits_script = _LIMITS_SCRIPT.format(
            as_kb=as_kb, nproc=limits.max_processes, fsize_kb=limits.max_file_mb * 1024, nofile=limits.max_open_files
        )
        jail += ["bash", "-c", limits_script, "rollway-jail", command]
        if self.host_uid is None:
            return jail
        _ensure_stage_dir()
        uid = str(self.host_uid)
        return [
            "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _STAGE_SCRIPT, "sh", STAGE_DIR,
            ",".join(cgroup_procs or []), *host_paths, "--", "setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", *jail,
        ]  # fmt: skip

    def _namespace_args(self) -> list[str]:
        return [
            "--unshare-all", "--unshare-user", "--uid", str(JAIL_UID), "--gid", str(JAIL_UID),
            "--cap-drop", "ALL", "--hostname", "sandbox", "--die-with-parent", "--new-session",
        ]  # fmt: skip

    def _filesystem_args(self, workspace: str, binds: list[tuple[str, str]], home: str | None = None,
                         hidden: list[str] = ()) -> list[str]:
        args = system_mount_args()
        for name in _ETC_ENTRIES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        # A bounded /tmp and /dev/shm, and a read-only /dev: bwrap's --dev is a tmpfs of half the
        # host's memory, so left writable it would let a command fill the host's memory.
        args += [
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(self.cfg.shm_mb * 2**20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            "--size", str(self.cfg.tmp_mb * 2**20), "--tmpfs", "/tmp",
        ]  # fmt: skip
        for source, dest in binds:
            args += ["--ro-bind", source, dest]
        for path in hidden:  # an empty read-only folder, an empty file
            args += ["--size", "4096", "--tmpfs", path, "--remount-ro", path] if os.path.isdir(path) else [
                "--ro-bind", "/dev/null", path]
        if home is not None:
            args += ["--bind", home, JAIL_HOME]
        # The jail's own root (where bwrap made /etc, /root, ...) is read-only too: only the
        # workspace, the sandbox's home and the private /tmp take writes.
        workdir = self.cfg.workdir
        return args + ["--bind", workspace, workdir, "--remount-ro", "/", "--chdir", workdir]

    def _env_args(self, persistent_home: bool = False) -> list[str]:
        env = {
            "PATH": f"{self.python_bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": JAIL_HOME if persistent_home else "/tmp",
            "USER": "nobody",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "VIRTUAL_ENV": os.path.dirname(self.python_bin),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            # rollway's own interpreter: its pytest plugins are rollway's test tools, not the project's
            # (and loading them costs about 0.4 s of every graded run).
            **({"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"} if self.cfg.python is None else {}),
            **self.cfg.env,
        }
        args = ["--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        return args

    async def run(
        self, workspace: str, command: str, limits: JailLimits, cgroup_procs: list[str] | None = None,
        home: str | None = None, hidden: list[str] | None = None,
    ) -> ExecResult:
        """Run `command` in a new jail; never raises for the command's own failures."""
        if self.seccomp is None:
            return await run_limited(self.argv(workspace, command, limits, cgroup_procs, home=home, hidden=hidden),
                                     limits)
        fd = os.memfd_create("rollway-seccomp", 0)  # one per command: bwrap reads it to the end
        try:
            os.write(fd, self.seccomp)
            os.lseek(fd, 0, os.SEEK_SET)
            argv = self.argv(workspace, command, limits, cgroup_procs, seccomp_fd=fd, home=home, hidden=hidden)
            return await run_limited(argv, limits, pass_fds=(fd,))
        finally:
            os.close(fd)


async def run_limited(argv: list[str], limits: JailLimits, pass_fds: tuple[int, ...] = ()) -> ExecResult:
    """Spawn `argv` in its own process group, read its merged output under the limits, and kill
    the whole group on timeout or output flood (bwrap's --die-with-parent then takes down the
    jail's pid namespace, so no process of the command survives)."""
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, pass_fds=pass_fds,
        )  # fmt: skip
    except FileNotFoundError as exc:
        raise SandboxError(f"cannot start {argv[0]!r}: {exc}; apt-get install bubblewrap util-linux") from exc
    capture = OutputCapture(limits.max_output_bytes)
    timed_out = flooded = False
    try:
        flooded = await asyncio.wait_for(_pump(proc, capture, limits.output_kill_bytes), limits.timeout_s)
    except TimeoutError:
        timed_out = True
    except BaseException:  # cancelled (worker shutting down): leave no jail behind
        _kill_group(proc.pid)
        raise
    if timed_out or flooded:
        _kill_group(proc.pid)
        await _drain(proc)
    exit_code = await proc.wait()
    output = capture.text()
    if timed_out:
        output += f"\n[timed out after {limits.timeout_s:g}s: command killed]\n"
    if flooded:
        output += f"\n[command killed: more than {limits.output_kill_bytes} bytes of output]\n"
    return ExecResult(
        exit_code=exit_code, output=output, timed_out=timed_out,
        truncated=capture.omitted > 0, duration_s=time.monotonic() - start,
    )  # fmt: skip


async def _pump(proc: asyncio.subprocess.Process, capture: OutputCapture, kill_bytes: int) -> bool:
    """Read output to EOF; True (stop early) once the command has printed more than `kill_bytes`."""
    assert proc.stdout is not None
    while chunk := await proc.stdout.read(1 << 16):
        capture.feed(chunk)
        if capture.total > kill_bytes:
            return True
    return False


async def _drain(proc: asyncio.subprocess.Process) -> None:
    """Discard what is left in the pipe after a kill: asyncio's `wait()` only returns once the pipe
    reached EOF, and a paused (full) pipe never does."""
    assert proc.stdout is not None
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            while await proc.stdout.read(1 << 16):
                pass


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
