"""Build the configured sandbox provider."""

from __future__ import annotations

from rollway.sandboxes.base import SandboxProvider
from rollway.sandboxes.config import SandboxConfig


def build_sandbox_provider(cfg: SandboxConfig) -> SandboxProvider:
    if cfg.type == "local":
        from rollway.sandboxes.local import LocalSandboxProvider

        return LocalSandboxProvider(cfg)
    if cfg.type == "sim":
        from rollway.sandboxes.sim import SimSandboxProvider

        return SimSandboxProvider(cfg)
    raise NotImplementedError(f"sandbox.type={cfg.type!r} is not built yet")
