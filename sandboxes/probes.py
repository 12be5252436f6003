"""`check()` for local sandboxes: attack a throwaway jail and report which protections held."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rollway.sandboxes.base import SandboxError, SandboxSpec
from rollway.sandboxes.jail import JailLimits

if TYPE_CHECKING:
    from rollway.sandboxes.local import LocalSandbox, LocalSandboxProvider

_CONNECT = "import socket; socket.create_connection(('{ip}', {port}), timeout=2)"
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


def bwrap_version(bwrap: str = "bwrap") -> str:
    """`bubblewrap 0.8.0` or raise SandboxError naming the fix."""
    path = shutil.which(bwrap)
    if path is None:
        raise SandboxError(
            "bubblewrap (bwrap) is not installed: apt-get install bubblewrap, or set sandbox.type=docker"
        )
    return subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.strip()


async def probe_local(provider: LocalSandboxProvider) -> dict[str, Any]:
    """Run each attack in a jail over a scratch workspace; every boolean is True when it was stopped."""
    report: dict[str, Any] = {"type": "local", "bwrap_version": bwrap_version(provider.config.bwrap)}
    box = await provider.create(SandboxSpec(), f"check-{uuid.uuid4().hex[:12]}")
    try:
        smoke = await box.exec("echo ready")
        if smoke.output.strip() != "ready":
            raise SandboxError(
                "bubblewrap cannot create its namespaces here (user namespaces disabled?): "
                f"{smoke.output.strip()}; enable them (sysctl kernel.unprivileged_userns_clone=1, "
                "user.max_user_namespaces>0) or set sandbox.type=docker"
            )
        report.update(await _probe_filesystem(box))
        report.update(await _probe_identity(box))
        report.update(await _probe_limits(box))
    finally:
        await box.destroy()
    report["host_uid"] = provider.runner.host_uid
    report["all_protections_hold"] = all(v for v in report.values() if isinstance(v, bool))
    return report


async def _probe_filesystem(box: LocalSandbox) -> dict[str, bool]:
    outside = f"{box.box_dir}/escaped"  # host folder right beside the workspace
    written = await box.exec("echo ok > probe.txt && cat probe.txt")
    attempts = await box.exec(f"touch /usr/x || touch /etc/x || touch /x || touch {outside} || echo blocked")
    network = await box.exec(
        f'python -c "{_CONNECT.format(ip="1.1.1.1", port=80)}" || python -c "{_CONNECT.format(ip="8.8.8.8", port=53)}"'
        " || echo isolated"
    )
    usr = await box.exec("touch /usr/rollway-probe")
    return {
        "network_isolated": network.output.strip().endswith("isolated"),
        "readonly_system": usr.exit_code != 0,
        "workspace_writable": written.output == "ok\n",
        "outside_write_blocked": attempts.output.strip().endswith("blocked")
        and not box.box_dir.joinpath("escaped").exists(),
    }


async def _probe_identity(box: LocalSandbox) -> dict[str, bool]:
    ident = await box.exec("id -u; grep CapEff /proc/self/status")
    lines = ident.output.split()
    return {
        "unprivileged_user": lines[:1] == ["65534"],
        "capabilities_dropped": lines[-1:] == ["0000000000000000"],
    }


async def _probe_limits(box: LocalSandbox) -> dict[str, bool]:
    cfg = box._provider.config
    memory = await box.exec(f"python -c 'bytearray({cfg.memory_mb + 64} * 2**20)'")
    forks = await box.exec(f"python -c '{_FORKER.format(n=cfg.max_processes + 16)}'")
    slow = await box.exec("sleep 30", timeout_s=1)
    flood = await box.exec("yes")
    # Same mechanism as the configured limit, at 1 MB so the probe need not write hundreds of MB.
    small_files = replace(JailLimits.from_config(cfg), max_file_mb=1)
    fsize = await box._provider.runner.run(
        str(box.workspace), "head -c 2M /dev/zero > big.bin; echo rc=$?", small_files
    )
    return {
        "memory_limited": "MemoryError" in memory.output,
        "process_limited": "blocked" in forks.output,
        "time_limited": slow.timed_out and slow.duration_s < 5,
        "output_limited": flood.truncated and len(flood.output) <= cfg.max_output_bytes + 200,
        "file_size_limited": "rc=0" not in fsize.output,
    }
