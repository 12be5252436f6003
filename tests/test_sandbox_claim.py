"""The default turn claim of a sandbox with a host workspace (`Sandbox.claim_turn`, used by sandboxes that
keep no private storage beside the workspace, e.g. the simulated one): the agent writes that workspace,
so a `.rollway` or `turns` it turned into a symlink must never carry the mark's `mkdir` to a host folder.
The sandbox here is the simulated one (real files, no jail): the attack is the planted link itself."""

from __future__ import annotations

import asyncio
import os

import pytest

from rollway.sandboxes.base import SandboxError, SandboxSpec
from rollway.sandboxes.config import SimSandboxConfig
from rollway.sandboxes.sim import SimSandboxProvider


def _box(tmp_path):
    provider = SimSandboxProvider(SimSandboxConfig(type="sim", root=str(tmp_path / "root")))
    return asyncio.run(provider.create(SandboxSpec(), "claim"))


def test_a_turn_is_claimed_once(tmp_path):
    box = _box(tmp_path)
    assert asyncio.run(box.claim_turn("a0-t0")) is True
    assert asyncio.run(box.claim_turn("a0-t0")) is False
    assert asyncio.run(box.claim_turn("a0-t1")) is True


@pytest.mark.parametrize("link", [".rollway", ".rollway/turns"])
def test_a_symlinked_marks_folder_is_refused_not_followed(tmp_path, link):
    box = _box(tmp_path)
    host = tmp_path / "host-folder"
    host.mkdir()
    workspace = box.workspace_path
    if link == ".rollway/turns":
        os.mkdir(os.path.join(workspace, ".rollway"))
    os.symlink(host, os.path.join(workspace, link))
    with pytest.raises(SandboxError, match="not a plain folder"):
        asyncio.run(box.claim_turn("a0-t0"))
    assert list(host.iterdir()) == []  # nothing was made through the link


def test_a_key_that_is_a_path_is_refused(tmp_path):
    box = _box(tmp_path)
    with pytest.raises(ValueError):
        asyncio.run(box.claim_turn("../escape"))
