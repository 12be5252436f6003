"""The containment suite: a hostile agent's attacks, run against any sandbox type (`rollway sandbox check`
and tests/test_containment.py). Each attack is bounded by seconds and returns True when it was contained."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from rollway.sandboxes.base import ExecResult, Sandbox, SandboxError, SandboxProvider, SandboxSpec
from rollway.sandboxes.config import SandboxConfig

_NETWORK = """
import socket
reached = []
for address in [("1.1.1.1", 80), ("8.8.8.8", 53), ("172.17.0.1", 2375)]:
    try:
        socket.create_connection(address, timeout=2).close()
        reached.append(address[0])
    except OSError:
        pass
print(*reached or ["isolated"])
print(*[name for _, name in socket.if_nameindex()])
"""
_FORKER = """
import os, time
for _ in range({n}):
    try:
        pid = os.fork()
    except OSError:
        print("blocked")
        break
    if pid == 0:
        time.sleep(2)
        os._exit(0)
else:
    print("unlimited")
"""
# k processes each touch `per` MB (less than the whole-sandbox cap, so a per-process limit lets
# each through), hold it for 3 s and then report; all allocate at once, so those that report held
# their block at the same time. The sum held must stay under the cap (the rest are refused or killed).
_MEMORY_BOMB = """
import os, sys, time
k, per = {k}, {per}
r, w = os.pipe()
for _ in range(k):
    if os.fork() == 0:
        os.close(r)
        try:
            block = b"x" * (per << 20)
            time.sleep(3)
            os.write(w, b"h")
        except MemoryError:
            pass
        os._exit(0)
os.close(w)
held, deadline = 0, time.time() + 10
while time.time() < deadline:
    chunk = os.read(r, 64)
    if not chunk:
        break
    held += len(chunk)
print("held", held)
"""
# n busy processes for `secs` of wall time; prints the CPU seconds they got per wall second.
_CPU_HOG = """
import os, time
n, secs = {n}, {secs}
start = time.time()
for _ in range(n):
    if os.fork() == 0:
        while time.time() - start < secs:
            pass
        os._exit(0)
for _ in range(n):
    os.wait()
t = os.times()
print("ratio", round((t.children_user + t.children_system) / (time.time() - start), 3))
"""
# Writes `chunk` MB files into DIR until a write fails or `limit` MB are written; prints MB written.
_FILL = (
    'n=0; while [ $n -lt {limit} ]; do head -c {chunk}M /dev/zero > "{dir}/fill.$n" 2>/dev/null || break; '
    "n=$((n+{chunk})); done; sync; du -sm {dir} 2>/dev/null | tail -1; echo written $n"
)
# Raw system calls a contained agent must not make (errno printed, 0 = the call succeeded).
_SYSCALLS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def probe(name, nr, *args):
    rc = libc.syscall(nr, *args)
    print(name, 0 if rc >= 0 else ctypes.get_errno())
probe("unshare_user", 272, 0x10000000)
probe("unshare_mount", 272, 0x00020000)
probe("mount", 165, b"none", b"/tmp", b"tmpfs", 0, None)
probe("keyctl", 250, 0, 0, 0, 0, 0)
probe("add_key", 248, b"user", b"rollway", b"x", 1, -2)
probe("bpf", 321, 0, 0, 0)
child = os.fork()
if child == 0:
    import time
    time.sleep(30)
    os._exit(0)
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
probe("ptrace_attach", 101, 16, child, 0, 0)
probe("process_vm_readv", 310, child, iov, 1, iov, 1, 0)
os.kill(child, 9)
"""


BASE_FILES = {"README.md": "base snapshot\n"}
"""Every attack's sandbox starts from this base (so a diff can show the base survived)."""


async def run_suite(provider: SandboxProvider) -> dict[str, Any]:
    """Create a throwaway sandbox, run every attack in it (each in a fresh one where an attack may
    wreck it), and report {row: contained}; raises SandboxError when the sandbox cannot run at all."""
    cfg: SandboxConfig = provider.config  # type: ignore[attr-defined]
    report: dict[str, Any] = {}
    for name, attack in ATTACKS.items():
        box = await provider.create(SandboxSpec(files=BASE_FILES), f"check-{uuid.uuid4().hex[:10]}")
        try:
            if name == "workspace_writable":
                smoke = await box.exec("echo ready")
                if smoke.output.strip() != "ready":
                    raise SandboxError(
                        f"the sandbox cannot run a command here: {smoke.output.strip()[-500:]}"
                    )
            report[name] = await attack(box, cfg)
        finally:
            await box.destroy()
    report["all_protections_hold"] = all(v for v in report.values() if isinstance(v, bool))
    return report


async def _alive(box: Sandbox) -> bool:
    result = await box.exec("echo alive", timeout_s=10)
    return result.output.strip() == "alive"


async def workspace_writable(box: Sandbox, cfg: SandboxConfig) -> bool:
    written = await box.exec("echo ok > probe.txt && cat probe.txt")
    return written.output == "ok\n" and await box.read_file("probe.txt") == "ok\n"


async def network_isolated(box: Sandbox, cfg: SandboxConfig) -> bool:
    """No route out (public addresses, the Docker bridge's gateway) and no interface but loopback."""
    result = await box.exec(f"python3 -c '{_NETWORK}'", timeout_s=30)
    return result.output.split() == ["isolated", "lo"]


async def outside_write_blocked(box: Sandbox, cfg: SandboxConfig) -> bool:
    targets = ["/x", "/usr/x", "/etc/x", "/root/x", "/var/x", "/home/x", "/bin/x", "/rollway/x", "/proc/x"]
    result = await box.exec("; ".join(f"touch {t} 2>/dev/null && echo WROTE {t}" for t in targets) + "; true")
    return "WROTE" not in result.output


async def unprivileged(box: Sandbox, cfg: SandboxConfig) -> bool:
    ident = await box.exec("id -u; grep CapEff /proc/self/status")
    words = ident.output.split()
    return words[:1] == ["65534"] and words[-1:] == ["0000000000000000"]


async def rm_rf_root(box: Sandbox, cfg: SandboxConfig) -> bool:
    """Everything the agent may delete is its own workspace; the system, the base snapshot (the diff
    still works) and the sandbox itself survive."""
    await box.exec("rm -rf --no-preserve-root / 2>/dev/null; true", timeout_s=20)
    system = await box.exec("test -x /bin/sh && test -d /usr/lib && echo intact")
    diff = await box.diff()  # the base snapshot survived: the deleted README shows as deleted
    return system.output.strip() == "intact" and await _alive(box) and "-base snapshot" in diff


async def fork_bomb(box: Sandbox, cfg: SandboxConfig) -> bool:
    """A bash fork bomb for 3 s, then the sandbox must answer at once; a counted fork loop must hit
    the process limit."""
    await box.exec(":(){ :|:& };:", timeout_s=3)
    start = time.monotonic()
    alive = await _alive(box)
    forks = await box.exec(f"python3 -c '{_FORKER.format(n=cfg.max_processes + 16)}'")
    return alive and time.monotonic() - start < 15 and "blocked" in forks.output


async def output_flood(box: Sandbox, cfg: SandboxConfig) -> bool:
    """`yes` is cut at the output limit and stopped (with everything it started: a side process
    appending to a marker file stops growing)."""
    marker = "sh -c 'while :; do echo x >> flood.mark; sleep 0.1; done' >/dev/null 2>&1 &"
    flood = await box.exec(f"{marker} yes", timeout_s=20)
    bounded = flood.truncated and len(flood.output) <= cfg.max_output_bytes + 300 and flood.duration_s < 15
    return bounded and await _stopped(box, "flood.mark")


async def sleep_forever(box: Sandbox, cfg: SandboxConfig) -> bool:
    """A command that sleeps forever, with a setsid'd helper that would outlive it, is killed at
    its timeout, helper included."""
    helper = "setsid sh -c 'while :; do echo x >> alive.mark; sleep 0.1; done' >/dev/null 2>&1 </dev/null &"
    slow = await box.exec(f"{helper} sleep infinity", timeout_s=1)
    return slow.timed_out and slow.duration_s < 6 and await _stopped(box, "alive.mark")


async def _stopped(box: Sandbox, marker: str) -> bool:
    first = await box.exec(f"wc -c < {marker} 2>/dev/null || echo 0")
    await asyncio.sleep(0.6)
    second = await box.exec(f"wc -c < {marker} 2>/dev/null || echo 0")
    return first.output == second.output


async def file_size(box: Sandbox, cfg: SandboxConfig) -> bool:
    """One file larger than `max_file_mb` cannot be written."""
    big = await box.exec(f"head -c {cfg.max_file_mb + 1}M /dev/zero > big.bin; echo rc=$?; rm -f big.bin")
    return "rc=0" not in big.output and "rc=" in big.output


async def memory_bomb(box: Sandbox, cfg: SandboxConfig) -> bool:
    """Processes that each stay under the cap but together exceed it: the sandbox as a whole is
    held to `memory_mb` (a per-process limit alone lets all of them through); one process asking
    for more than the cap fails too."""
    per = max(8, cfg.memory_mb // 2)
    k = 4
    result = await box.exec(f"python3 -c '{_MEMORY_BOMB.format(k=k, per=per)}'", timeout_s=20)
    words = result.output.split()
    held = int(words[words.index("held") + 1]) if "held" in words else 0
    single = await box.exec(f'python3 -c \'b = b"x" * ({cfg.memory_mb + 64} << 20); print("allocated")\'')
    return held * per <= cfg.memory_mb and "allocated" not in single.output and await _alive(box)


async def cpu_hog(box: Sandbox, cfg: SandboxConfig) -> bool:
    """Many busy processes get at most `cpus` cores between them. Many, so that even on a busy host
    (where the scheduler splits the cores among all runnable processes) they would get more than
    the quota without one."""
    n = max(8, 4 * math.ceil(cfg.cpus))
    result = await box.exec(f"python3 -c '{_CPU_HOG.format(n=n, secs=2)}'", timeout_s=15)
    words = result.output.split()
    if "ratio" not in words:
        return False
    return float(words[words.index("ratio") + 1]) <= cfg.cpus * 1.2 + 0.1


async def disk_fill(box: Sandbox, cfg: SandboxConfig) -> bool:
    """Files written into the workspace until it is full: at most `workspace_mb` land there. The
    workspace's pages count against the sandbox's memory, so with `workspace_mb` above `memory_mb`
    the memory cap ends the attack first (the writer is killed): contained as well."""
    chunk = max(1, min(16, cfg.max_file_mb // 2))
    fill = _FILL.format(limit=cfg.workspace_mb + 4 * chunk, chunk=chunk, dir=".")
    result = await box.exec(fill, timeout_s=60)
    if "written" not in result.output.split():
        return result.exit_code in (137, -9) and not result.timed_out
    return _written(result) <= cfg.workspace_mb


async def shm_fill(box: Sandbox, cfg: SandboxConfig) -> bool:
    """/dev/shm holds at most `shm_mb`, and /dev takes no files (or is capped the same way)."""
    chunk = max(1, min(16, cfg.shm_mb // 4))
    shm = await box.exec(
        _FILL.format(limit=cfg.shm_mb + 4 * chunk, chunk=chunk, dir="/dev/shm"), timeout_s=30
    )
    dev = await box.exec(_FILL.format(limit=cfg.shm_mb + 4 * chunk, chunk=chunk, dir="/dev"), timeout_s=30)
    return all(_written(r) <= cfg.shm_mb for r in (shm, dev))


def _written(result: ExecResult) -> int:
    words = result.output.split()
    return int(words[words.index("written") + 1]) if "written" in words else 10**9


async def syscalls_refused(box: Sandbox, cfg: SandboxConfig) -> bool:
    """Nested user namespaces, mount namespaces, mount, the kernel keyring, bpf, and ptrace and
    process_vm_readv (even of the command's own child) are refused."""
    result = await box.exec(f"python3 -c '{_SYSCALLS}'")
    rows = dict(line.split() for line in result.output.splitlines() if len(line.split()) == 2)
    nested = await box.exec("unshare -U -r true 2>/dev/null && echo NESTED; true")
    return len(rows) == 8 and all(v != "0" for v in rows.values()) and "NESTED" not in nested.output


ATTACKS: dict[str, Callable[[Sandbox, SandboxConfig], Awaitable[bool]]] = {
    "workspace_writable": workspace_writable,
    "unprivileged_user": unprivileged,
    "network_isolated": network_isolated,
    "outside_write_blocked": outside_write_blocked,
    "rm_rf_root_contained": rm_rf_root,
    "fork_bomb_contained": fork_bomb,
    "output_flood_stopped": output_flood,
    "sleep_forever_killed": sleep_forever,
    "file_size_limited": file_size,
    "memory_capped_per_sandbox": memory_bomb,
    "cpu_quota": cpu_hog,
    "workspace_size_capped": disk_fill,
    "dev_shm_capped": shm_fill,
    "syscalls_refused": syscalls_refused,
}
"""Row name in the report -> attack; every row must hold for both `local` and `docker`."""
