"""Choose the sandbox provider named by `sandbox.type`."""

from __future__ import annotations

import os
import subprocess

from rollway.base.registry import Registry
from rollway.sandboxes.base import SandboxError, SandboxProvider
from rollway.sandboxes.config import LocalSandboxConfig, SandboxConfig
from rollway.sandboxes.jail import system_mount_args
from rollway.sandboxes.probes import bwrap_version

SANDBOXES = Registry("sandbox provider", "sandbox.type", "rollway.sandboxes.base:SandboxProvider")
"""`sandbox.type` -> SandboxProvider class and its config class; plugins (`python:MODULE:CLASS`) need no entry."""
SANDBOXES.add("local", "rollway.sandboxes.local:LocalSandboxProvider", "rollway.sandboxes.config:LocalSandboxConfig")
SANDBOXES.add("docker", "rollway.sandboxes.fleet:FleetSandboxProvider", "rollway.sandboxes.config:DockerSandboxConfig")
SANDBOXES.add("sim", "rollway.sandboxes.sim:SimSandboxProvider", "rollway.sandboxes.config:SimSandboxConfig")


def build_sandbox_provider(cfg: SandboxConfig) -> SandboxProvider:
    """The provider for `cfg.type`. For `local`, fails here (not at the first episode) when
    bubblewrap is missing or cannot create its namespaces, with the fix in the message.
    `python:MODULE:CLASS`: your own SandboxProvider subclass, constructed with this config."""
    if cfg.type == "local":
        bwrap_version(cfg.bwrap)
        _check_namespaces(cfg)
    return SANDBOXES.load(cfg.type)(cfg)


def _check_namespaces(cfg: LocalSandboxConfig) -> None:
    """One empty jail with the namespaces every exec uses (about 20 ms)."""
    argv = [cfg.bwrap, "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
            *system_mount_args(), "--", "/usr/bin/true"]  # fmt: skip
    if os.geteuid() == 0:
        uid = str(cfg.host_uid if cfg.host_uid is not None else 65534)
        argv = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        raise SandboxError(
            f"bubblewrap cannot create namespaces here: {proc.stderr.strip()}. Enable unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces=10000; "
            "in a container, run it with --privileged or a seccomp profile allowing unshare), "
            "or set sandbox.type=docker"
        )
