"""A hostile agent against the framework's own git and against forged sandbox handles, in both sandboxes.

The agent writes git configuration wherever git might read it (HOME, XDG, the workspace's `.git/config`, a
nested repository, `.gitattributes`) naming a clean filter, an fsmonitor hook, hooks and external diff or
pager commands that would write a canary and forge the diff. Computing the diff must run none of them:
the canary must not exist afterwards and the diff must be the agent's real change. A forged handle (a
container rollway did not make, a folder outside the sandbox root) must be refused before any exec or
remove, and what it names must survive."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from docker_engine import count_containers, ensure_engine

from rollway.sandboxes.base import Sandbox, SandboxError, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.docker import LABEL, DockerSandboxProvider
from rollway.sandboxes.local import LocalSandboxProvider


def run(coro):
    return asyncio.run(coro)


def _evil_config(canary: str) -> str:
    """Git configuration that runs `touch CANARY` from every hook git offers, and whose clean filter
    replaces every file's content by `forged` (so a diff computed through it lies)."""
    touch = f"touch {canary}"
    return (
        '[filter "evil"]\n'
        f"\tclean = \"sh -c '{touch}; echo forged'\"\n"
        f"\tsmudge = \"sh -c '{touch}; cat'\"\n"
        "\trequired = true\n"
        '[diff "evil"]\n'
        f"\tcommand = \"sh -c '{touch}'\"\n"
        f"\ttextconv = \"sh -c '{touch}; cat'\"\n"
        "[core]\n"
        f"\tfsmonitor = \"sh -c '{touch}'\"\n"
        "\thooksPath = /tmp/evil-hooks\n"
        f"\tpager = \"sh -c '{touch}; cat'\"\n"
        "[diff]\n"
        f"\texternal = \"sh -c '{touch}'\"\n"
    )


def _plant(canary: str) -> str:
    """The agent's shell command: a nested repository with a commit (made while git is still clean), config
    in every place git could read, hooks, attributes, then the real change (x = 2)."""
    config = _evil_config(canary).replace("'", "'\\''")
    return "; ".join([
        "set -e",
        "mkdir -p sub && git -C sub init -q && echo n > sub/n.txt && git -C sub add n.txt",
        "git -C sub -c user.name=a -c user.email=a@a commit -q -m nested",
        f"cfg='{config}'",
        'for f in /tmp/.gitconfig /tmp/.config/git/config "$HOME/.gitconfig" "$HOME/.config/git/config" '
        '.git/config sub/.git/config; do mkdir -p "$(dirname $f)"; printf "%s" "$cfg" > $f; done',
        "mkdir -p /tmp/evil-hooks .git/hooks sub/.git/hooks",
        "for h in pre-commit post-index-change fsmonitor-watchman; do for d in /tmp/evil-hooks .git/hooks "
        f"sub/.git/hooks; do printf '#!/bin/sh\\ntouch {canary}\\n' > $d/$h; chmod +x $d/$h; done; done",
        "echo changed > sub/n.txt",
        "printf '* filter=evil diff=evil\\n' > .gitattributes",
        "echo 'x = 2' > pkg/m.py",
    ])


def _check_diff(diff: str) -> None:
    assert "forged" not in diff, diff
    assert "-x = 1\n+x = 2\n" in diff, diff
    assert "b/.gitattributes" in diff  # the agent's real changes, every one of them, as they are


# ---------------------------------------------------------------- the local (bubblewrap) sandbox


@pytest.fixture
def local_box(tmp_path: Path) -> Iterator[Sandbox]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "m.py").write_text("x = 1\n")
    config = SandboxConfig(root=str(tmp_path / "boxes"), exec_timeout_s=20, home="persistent")
    box = run(LocalSandboxProvider(config).create(SandboxSpec(source_dir=str(tmp_path / "src")), "git-hostile"))
    yield box
    run(box.destroy())


def test_local_diff_runs_nothing_the_agent_wrote(local_box: Sandbox, tmp_path: Path) -> None:
    # A host path: the jail cannot write there, but git on the host (root) would if it ran the agent's command.
    canary = tmp_path / "pwned"
    done = run(local_box.exec(_plant(str(canary))))
    assert done.exit_code == 0, done.output
    assert not canary.exists()
    diff = run(local_box.diff())
    assert not canary.exists(), "git ran a command the agent configured"
    _check_diff(diff)


def test_local_forged_handles_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "boxes"
    provider = LocalSandboxProvider(SandboxConfig(root=str(root)))
    outside = tmp_path / "victim"
    (outside / "workspace").mkdir(parents=True)
    (outside / "READY").touch()
    root.mkdir()
    (root / "link").symlink_to(outside)  # a folder under the root that leads out of it
    for handle in ({"kind": "local", "name": "../victim", "path": str(outside / "workspace")},
                   {"kind": "local", "name": "link", "path": str(root / "link" / "workspace")},
                   {"kind": "local", "name": "x", "path": str(outside / "workspace")}):
        with pytest.raises(SandboxError):
            run(provider.attach(handle))
    assert (outside / "workspace").is_dir() and (outside / "READY").exists()


# ---------------------------------------------------------------- the Docker sandbox


@pytest.fixture(scope="module")
def client() -> docker.DockerClient:
    return ensure_engine()


@pytest.fixture
def docker_box(client: docker.DockerClient, tmp_path: Path) -> Iterator[Sandbox]:
    prefix = f"tgit-{uuid.uuid4().hex[:8]}"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    config = SandboxConfig(type="docker", exec_timeout_s=20)
    box = run(DockerSandboxProvider(config).create(SandboxSpec(source_dir=str(tmp_path)), prefix))
    try:
        yield box
    finally:
        run(box.destroy())
        assert count_containers(prefix) == 0


def test_docker_diff_runs_nothing_the_agent_wrote(docker_box: Sandbox) -> None:
    # /tmp is shared by the agent and the keeper, so the keeper's git would read /tmp/.gitconfig (HOME).
    done = run(docker_box.exec(_plant("/tmp/pwned")))
    assert done.exit_code == 0, done.output
    assert run(docker_box.exec("test -e /tmp/pwned")).exit_code == 1  # planting alone ran nothing
    diff = run(docker_box.diff())
    assert run(docker_box.exec("test -e /tmp/pwned")).exit_code == 1, "git ran a command the agent configured"
    _check_diff(diff)


def test_docker_forged_handle_is_refused_and_the_container_survives(client: docker.DockerClient) -> None:
    """A container that rollway did not make (no rollway label), named in a forged handle: attach must
    refuse it, so no stage can exec in it or remove it."""
    name = f"rollway-victim-{uuid.uuid4().hex[:8]}"
    victim = client.containers.run("rollway-sandbox:bookworm", ["sleep", "infinity"], name=name, detach=True,
                                   network_mode="none", labels={"test.owner": "rollway-tests"})
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    try:
        for handle in ({"kind": "docker", "container": victim.id, "name": name.removeprefix("rollway-")},
                       {"kind": "docker", "container": name, "name": name.removeprefix("rollway-")}):
            with pytest.raises(SandboxError, match="not a rollway sandbox"):
                run(provider.attach(handle))
        victim.reload()
        assert victim.status == "running"
    finally:
        victim.remove(force=True)


def test_docker_handle_with_another_sandboxes_name_is_refused(docker_box: Sandbox, client: docker.DockerClient) -> None:
    """A real rollway container, but the handle's name (which names the volume destroy removes) is not
    the one its label holds."""
    handle = dict(docker_box.handle)
    handle["name"] = "someone-else"
    with pytest.raises(SandboxError, match="not a rollway sandbox"):
        run(DockerSandboxProvider(SandboxConfig(type="docker")).attach(handle))
    assert client.containers.get(docker_box.container_id).labels[LABEL] == docker_box.name  # type: ignore[attr-defined]
