"""The Docker sandbox against a recording fake client (no engine runs here), plus the real unreachable path."""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import tarfile
import time
from collections.abc import Iterator
from typing import Any

import docker.errors
import pytest

from rollway.runners import cmd_sandbox
from rollway.sandboxes.base import SandboxError, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.docker import DockerSandboxProvider


def run(coro):
    return asyncio.run(coro)


class FakeContainer:
    """Keeps the workspace as {absolute path: bytes}, filled and read through real tar archives."""

    def __init__(self, cid: str, image: str, options: dict[str, Any]) -> None:
        self.id, self.image, self.options = cid, image, options
        self.files: dict[str, bytes] = {}
        self.removed = False

    def put_archive(self, path: str, data: bytes) -> bool:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    self.files[f"{path}/{member.name}"] = tar.extractfile(member).read()
        return True

    def get_archive(self, path: str) -> tuple[Iterator[bytes], dict[str, Any]]:
        if path not in self.files:
            raise docker.errors.NotFound(f"no such file {path}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(path.rsplit("/", 1)[-1])
            info.size = len(self.files[path])
            tar.addfile(info, io.BytesIO(self.files[path]))
        return iter([buf.getvalue()]), {"name": path}

    def remove(self, force: bool = False) -> None:
        self.removed = True


class FakeCollection:
    def __init__(self) -> None:
        self.items: dict[str, Any] = {}
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def get(self, key: str) -> Any:
        item = self.items.get(key)
        if item is None or item.removed:
            raise docker.errors.NotFound(f"{key} not found")
        return item


class FakeVolume:
    def __init__(self, name: str) -> None:
        self.name, self.removed = name, False

    def remove(self, force: bool = False) -> None:
        self.removed = True


class FakeApi:
    """Exec endpoints; `responder(cmd) -> (chunks, exit_code, delay_s)` scripts each command."""

    def __init__(self, responder) -> None:
        self.responder = responder
        self.execs: dict[str, dict[str, Any]] = {}
        self.chunks_read = 0

    def exec_create(self, container: str, cmd: list[str], **kw: Any) -> dict[str, str]:
        exec_id = f"e{len(self.execs)}"
        self.execs[exec_id] = {"container": container, "cmd": cmd, **kw}
        return {"Id": exec_id}

    def exec_start(self, exec_id: str, stream: bool = False) -> Iterator[bytes]:
        chunks, code, delay = self.responder(self.execs[exec_id]["cmd"])
        self.execs[exec_id]["exit"] = code
        time.sleep(delay)
        for chunk in chunks:
            self.chunks_read += 1
            yield chunk

    def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        return {"ExitCode": self.execs[exec_id].get("exit")}


class FakeDocker:
    def __init__(self, responder=None, reachable: bool = True) -> None:
        self.reachable = reachable
        self.api = FakeApi(responder or (lambda cmd: ([b"ok\n"], 0, 0)))
        self.containers = FakeCollection()
        self.volumes = FakeCollection()
        self.containers.run = self._run
        self.volumes.create = self._create_volume

    def ping(self) -> bool:
        if not self.reachable:
            raise docker.errors.DockerException("Error while fetching server API version")
        return True

    def _run(self, image: str, **options: Any) -> FakeContainer:
        self.containers.calls.append((image, options))
        container = FakeContainer(f"c{len(self.containers.items)}", image, options)
        self.containers.items[container.id] = container
        return container

    def _create_volume(self, **options: Any) -> FakeVolume:
        self.volumes.calls.append((options["name"], options))
        volume = FakeVolume(options["name"])
        self.volumes.items[volume.name] = volume
        return volume


@pytest.fixture
def config() -> SandboxConfig:
    return SandboxConfig(type="docker", memory_mb=512, max_processes=64, max_file_mb=8, max_output_bytes=1000)


def test_container_is_locked_down(config: SandboxConfig) -> None:
    client = FakeDocker()
    run(DockerSandboxProvider(config, client).create(SandboxSpec(image="repo:1"), "ep1"))
    image, opts = client.containers.calls[0]
    assert image == "repo:1" and opts["user"] == "65534:65534" and opts["cap_drop"] == ["ALL"]
    assert opts["network_disabled"] is True and opts["network_mode"] == "none"
    assert opts["read_only"] is True and "no-new-privileges" in opts["security_opt"]
    assert opts["mem_limit"] == "512m" and opts["memswap_limit"] == "512m" and opts["pids_limit"] == 64
    assert {"Name": "fsize", "Soft": 8 * 2**20, "Hard": 8 * 2**20} in opts["ulimits"]
    assert opts["volumes"] == {"rollway-ep1": {"bind": "/workspace", "mode": "rw"}}
    _, volume = client.volumes.calls[0]
    assert volume["driver_opts"]["type"] == "tmpfs" and "uid=65534" in volume["driver_opts"]["o"]


def test_default_image_and_setup_then_git_snapshot(config: SandboxConfig, tmp_path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    client = FakeDocker()
    spec = SandboxSpec(
        source_dir=str(tmp_path), files={"extra.txt": "e"}, setup_commands=["pip install -e ."]
    )
    box = run(DockerSandboxProvider(config, client).create(spec, "ep2"))
    assert client.containers.calls[0][0] == config.image
    assert box.container.files == {"/workspace/pkg/m.py": b"x = 1\n", "/workspace/extra.txt": b"e"}
    cmds = [e["cmd"] for e in client.api.execs.values()]
    assert (
        cmds[0][-1] == "pip install -e ."
        and "commit" in cmds[1][-1]
        and "--git-dir=/rollway/base.git" in cmds[1][-1]
    )


def test_exec_wraps_command_with_timeout_and_user(config: SandboxConfig) -> None:
    client = FakeDocker(lambda cmd: ([b"hello ", b"world\n"], 0, 0))
    box = run(DockerSandboxProvider(config, client).create(SandboxSpec(), "ep3"))
    result = run(box.exec("echo hello world", timeout_s=7))
    last = list(client.api.execs.values())[-1]
    assert last["cmd"] == ["timeout", "-s", "KILL", "7", "bash", "-c", "echo hello world"]
    assert last["user"] == "65534:65534" and last["workdir"] == "/workspace"
    assert result.exit_code == 0 and result.output == "hello world\n" and not result.timed_out


def test_exec_timeout_is_reported(config: SandboxConfig) -> None:
    client = FakeDocker(lambda cmd: ([b"partial"], 137, 0.3) if "sleep" in cmd[-1] else ([], 0, 0))
    box = run(DockerSandboxProvider(config, client).create(SandboxSpec(), "ep4"))
    result = run(box.exec("sleep 1000", timeout_s=0.2))
    assert (
        result.timed_out and "timed out after 0.2s" in result.output and result.output.startswith("partial")
    )


def test_output_flood_is_cut_and_reading_stops(config: SandboxConfig) -> None:
    flood = lambda cmd: (itertools.repeat(b"y\n" * 32768), 0, 0) if cmd[-1] == "yes" else ([], 0, 0)  # noqa: E731
    client = FakeDocker(flood)
    cfg = config.model_copy(update={"output_kill_mb": 1})
    box = run(DockerSandboxProvider(cfg, client).create(SandboxSpec(), "ep5"))
    result = run(box.exec("yes"))
    assert result.truncated and "[output truncated:" in result.output and len(result.output) < 1200
    assert client.api.chunks_read <= 2**20 // 65536 + 2


def test_files_round_trip_through_archives(config: SandboxConfig) -> None:
    client = FakeDocker()
    box = run(DockerSandboxProvider(config, client).create(SandboxSpec(), "ep6"))
    run(box.write_file("src/app/main.py", "print('hi')\n"))
    assert run(box.read_file("src/app/main.py")) == "print('hi')\n"
    with pytest.raises(SandboxError, match="does not exist"):
        run(box.read_file("missing.txt"))
    for bad in ["/etc/passwd", "../x", "a/../../x"]:
        with pytest.raises(SandboxError):
            run(box.write_file(bad, "x"))


def test_diff_comes_from_git_in_the_container(config: SandboxConfig) -> None:
    patch = b"diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n"
    client = FakeDocker(lambda cmd: ([patch], 0, 0) if "diff --cached" in cmd[-1] else ([], 0, 0))
    box = run(DockerSandboxProvider(config, client).create(SandboxSpec(), "ep7"))
    assert run(box.diff()) == patch.decode()


def test_attach_and_idempotent_destroy(config: SandboxConfig) -> None:
    client = FakeDocker()
    provider = DockerSandboxProvider(config, client)
    box = run(provider.create(SandboxSpec(), "ep8"))
    again = run(DockerSandboxProvider(config, client).attach(box.handle))
    assert again.container is box.container
    run(again.destroy())
    run(box.destroy())
    assert box.container.removed and client.volumes.items["rollway-ep8"].removed
    with pytest.raises(SandboxError, match="gone"):
        run(provider.attach(box.handle))


def test_failed_setup_removes_the_container(config: SandboxConfig) -> None:
    client = FakeDocker(lambda cmd: ([b"boom"], 1, 0) if cmd[-1] == "false" else ([], 0, 0))
    with pytest.raises(SandboxError, match="setup command"):
        run(DockerSandboxProvider(config, client).create(SandboxSpec(setup_commands=["false"]), "ep9"))
    assert client.containers.items["c0"].removed


def test_unreachable_engine_names_the_fix(config: SandboxConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SandboxError, match="start the Docker daemon or set sandbox.type=local"):
        run(DockerSandboxProvider(config, FakeDocker(reachable=False)).create(SandboxSpec(), "ep10"))
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")  # the real SDK, no engine
    with pytest.raises(SandboxError, match="start the Docker daemon"):
        run(DockerSandboxProvider(config).check())


def test_cli_check_exits_2_without_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    args = argparse.Namespace(config=None, overrides=[], type="docker", json=True)
    assert cmd_sandbox.run(args) == 2
    out = capsys.readouterr()
    assert json.loads(out.out)["ok"] is False and "sandbox.type=local" in out.err
