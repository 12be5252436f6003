"""`check()` for local sandboxes: attack a throwaway jail and report which protections held."""

from __future__ import annotations

import shutil
import subprocess
from typing import TYPE_CHECKING, Any

from rollway.sandboxes.base import SandboxError

if TYPE_CHECKING:
    from rollway.sandboxes.local import LocalSandboxProvider


def bwrap_version(bwrap: str = "bwrap") -> str:
    """`bubblewrap 0.8.0` or raise SandboxError naming the fix."""
    path = shutil.which(bwrap)
    if path is None:
        raise SandboxError(
            "bubblewrap (bwrap) is not installed: apt-get install bubblewrap, or set sandbox.type=docker"
        )
    return subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.strip()


async def probe_local(provider: LocalSandboxProvider) -> dict[str, Any]:
    """The containment suite (sandboxes/containment.py) against throwaway jails, plus which
    mechanisms this machine gave the jail: every boolean is True when the attack was contained."""
    from rollway.sandboxes.containment import run_suite

    report: dict[str, Any] = {
        "type": "local",
        "bwrap_version": bwrap_version(provider.config.bwrap),
        "host_uid": provider.runner.host_uid,
        "cgroups": provider.cgroup_kind or "none (not root, or no writable memory/pids/cpu controllers)",
        "address_space": _address_space(provider),
        "seccomp": "bpf filter" if provider.runner.seccomp is not None else "none (not x86_64)",
        "workspace_cap": "tmpfs" if provider.workspace_cap else "none (needs root with mount rights)",
    }
    report.update(await run_suite(provider))
    return report


def _address_space(provider: LocalSandboxProvider) -> str:
    """Each jailed process's RLIMIT_AS (sandbox.address_space_mb) in words."""
    limit = provider.address_space_mb(provider.config.memory_mb)
    if limit is None:
        return "unlimited (the memory cgroup holds real memory)"
    return f"{limit} MB per process"
