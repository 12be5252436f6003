"""The containment suite against BOTH sandboxes on this machine: bubblewrap and the real Docker engine
(started by scripts/setup-docker.sh). Every attack must be contained by both."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from docker_engine import count_containers, ensure_engine

from rollway.sandboxes.base import SandboxProvider, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.containment import ATTACKS, BASE_FILES
from rollway.sandboxes.factory import build_sandbox_provider

# Small limits keep every attack to seconds: the memory bomb touches 4 x 128 MB, the disk fill
# writes at most 64 MB + 32 MB.
LIMITS = dict(memory_mb=256, max_processes=64, cpus=0.1, workspace_mb=64, shm_mb=16, max_file_mb=16,
              tmp_mb=32, exec_timeout_s=10, max_output_bytes=4000, output_kill_mb=8)  # fmt: skip


@pytest.fixture(scope="module")
def providers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SandboxProvider]:
    ensure_engine()
    root = tmp_path_factory.mktemp("containment")
    return {
        kind: build_sandbox_provider(SandboxConfig(type=kind, root=str(root), **LIMITS))  # type: ignore[arg-type]
        for kind in ("local", "docker")
    }


@pytest.mark.parametrize("kind", ["local", "docker"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_is_contained(providers: dict[str, SandboxProvider], kind: str, attack: str) -> None:
    provider = providers[kind]
    prefix = f"ct-{uuid.uuid4().hex[:8]}"
    before = count_containers(prefix)

    async def go() -> bool:
        box = await provider.create(SandboxSpec(files=BASE_FILES), prefix)
        try:
            return await ATTACKS[attack](box, provider.config)  # type: ignore[attr-defined]
        finally:
            await box.destroy()

    assert asyncio.run(go()) is True, f"{attack} was not contained by the {kind} sandbox"
    assert count_containers(prefix) == before == 0  # nothing leaked
    if kind == "local":
        assert not Path(provider.config.root, prefix).exists()  # type: ignore[attr-defined]
