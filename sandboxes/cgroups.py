"""Whole-sandbox limits for local jails: one cgroup per sandbox (memory, processes, CPU quota).

Every command of a sandbox runs in a fresh jail, so per-process rlimits alone would let N processes
use N times the memory; a cgroup holds all of a sandbox's processes (and its tmpfs pages) to one
budget. cgroup v2 (a unified hierarchy with the memory, pids and cpu controllers enabled) is used
where the host has it; otherwise the v1 controllers `memory`, `pids` and `cpu` (this machine: v1,
the v2 mount has no controllers). Needs root; without it `available()` is False and the jail keeps
only its per-process limits (`rollway sandbox check` then reports the rows that fail)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

from rollway.sandboxes.base import SandboxError

ROOT = Path("/sys/fs/cgroup")
GROUP = "rollway"
"""Parent cgroup of every sandbox's cgroup (one child per sandbox name)."""
_V1 = ("memory", "pids", "cpu")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def mechanism() -> str | None:
    """ "v2", "v1" or None (no writable cgroup controllers for memory, pids and cpu)."""
    if os.geteuid() != 0:
        return None
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists() and {"memory", "pids", "cpu"} <= set(controllers.read_text().split()):
        return "v2" if os.access(ROOT, os.W_OK) else None
    if all((ROOT / c / "cgroup.procs").exists() and os.access(ROOT / c, os.W_OK) for c in _V1):
        return "v1"
    return None  # e.g. root in a container: cgroupfs is mounted read-only


def swap_held(kind: str) -> bool:
    """Whether a sandbox's cgroup holds swap too (`ensure` sets swap to none), or the host has none:
    only then does the memory limit bound everything a sandbox's processes can make the host keep."""
    try:
        no_swap = any(line.split()[:2] == ["SwapTotal:", "0"] for line in open("/proc/meminfo"))
    except OSError:
        no_swap = False
    if kind == "v1":
        return no_swap or (ROOT / "memory" / "memory.memsw.limit_in_bytes").exists()
    return no_swap or any(ROOT.glob("*/memory.swap.max"))


class SandboxCgroup:
    """The cgroup(s) of one sandbox; any worker on the machine finds them again by sandbox name."""

    def __init__(self, name: str, kind: str) -> None:
        if not _NAME_RE.match(name):
            raise SandboxError(f"sandbox name {name!r} cannot name a cgroup")
        self.kind = kind
        if kind == "v2":
            self.dirs = [ROOT / GROUP / name]
        else:
            self.dirs = [ROOT / c / GROUP / name for c in _V1]

    @property
    def procs_files(self) -> list[str]:
        """Files a process writes its pid to in order to join (children inherit membership)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def ensure(self, memory_mb: int, max_processes: int, cpus: float) -> None:
        """Create the cgroup(s) with these limits (idempotent; cheap when they exist)."""
        if all(d.is_dir() for d in self.dirs):
            return
        memory = str(memory_mb * 2**20)
        quota, period = int(cpus * 100_000), 100_000
        if self.kind == "v2":
            parent = self.dirs[0].parent
            parent.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):  # enable the controllers for the children
                (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            d = self.dirs[0]
            d.mkdir(exist_ok=True)
            _write(d / "memory.max", memory)
            _write(d / "memory.swap.max", "0", optional=True)
            _write(d / "pids.max", str(max_processes))
            _write(d / "cpu.max", f"{quota} {period}")
            return
        mem, pids, cpu = self.dirs
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        _write(mem / "memory.limit_in_bytes", memory)
        _write(mem / "memory.memsw.limit_in_bytes", memory, optional=True)  # no swap either
        _write(pids / "pids.max", str(max_processes))
        _write(cpu / "cpu.cfs_period_us", str(period))
        _write(cpu / "cpu.cfs_quota_us", str(quota))

    def remove(self) -> None:
        """Kill what is left in the cgroup(s) and remove them; silent when already gone."""
        for d in self.dirs:
            for _ in range(50):
                if not d.exists():
                    break
                for pid in _pids(d):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                try:
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError:  # busy: processes still exiting
                    time.sleep(0.02)


def _pids(d: Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _write(path: Path, value: str, optional: bool = False) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        if not optional:
            raise SandboxError(f"cannot set {path} to {value}: {exc}") from exc
