"""Docker sandboxes: one locked-down container per episode, driven through the Docker SDK."""

from __future__ import annotations

import asyncio
import io
import posixpath
import tarfile
import time
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from rollway.sandboxes.base import ExecResult, Sandbox, SandboxError, SandboxProvider, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.jail import JailLimits, OutputCapture

WORKSPACE = "/workspace"
STATE = "/rollway"
"""Holds the base snapshot repository, outside the workspace so it never shows up in diffs."""
USER = "65534:65534"
_UNREACHABLE = "start the Docker daemon or set sandbox.type=local"
_GIT = f"git -c safe.directory='*' -c core.autocrlf=false --git-dir={STATE}/base.git --work-tree={WORKSPACE}"
_EXCLUDES = r"__pycache__/\n*.py[cod]\n.pytest_cache/\n/.rollway/\n"  # as in local.py
_SNAPSHOT = (
    f"set -e; command -v git >/dev/null || {{ echo 'rollway: this image has no git'; exit 127; }}; "
    f"{_GIT} init -q; printf '{_EXCLUDES}' > {STATE}/base.git/info/exclude; {_GIT} add -A .; "
    f"{_GIT} -c user.name=rollway -c user.email=rollway@localhost commit -q --allow-empty --no-verify -m base"
)
_DIFF = (
    f"set -e; export GIT_INDEX_FILE=$(mktemp {STATE}/index.XXXXXX); cp -p {STATE}/base.git/index $GIT_INDEX_FILE; "
    f"{_GIT} add -A .; {_GIT} diff --cached --binary --no-renames --no-ext-diff --no-textconv --no-color "
    "--src-prefix=a/ --dst-prefix=b/ HEAD; rm -f $GIT_INDEX_FILE"
)


def _connect(client: Any | None) -> Any:
    """The injected client, or one from the environment; SandboxError naming the fix if no engine answers."""
    try:
        if client is None:
            import docker

            client = docker.from_env()
        client.ping()
    except Exception as exc:  # the SDK raises DockerException, requests' errors, or FileNotFoundError
        raise SandboxError(f"Docker engine unreachable ({exc}); {_UNREACHABLE}") from exc
    return client


def _is_not_found(exc: Exception) -> bool:
    return (
        type(exc).__name__ == "NotFound" or getattr(getattr(exc, "response", None), "status_code", 0) == 404
    )


class DockerSandbox(Sandbox):
    """A running container (`sleep infinity`) with the workspace on its own volume."""

    def __init__(self, provider: DockerSandboxProvider, container: Any, name: str) -> None:
        self._provider = provider
        self.container = container
        self.name = name

    @property
    def handle(self) -> dict[str, Any]:
        return {"kind": "docker", "container": self.container.id, "name": self.name}

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        limits = JailLimits.from_config(self._provider.config, timeout_s)
        return await asyncio.to_thread(self._exec, command, limits)

    def _exec(self, command: str, limits: JailLimits) -> ExecResult:
        """`timeout` inside the container ends the command; the streamed output is cut like a
        local jail's, and a flood stops being read (the exec then dies with its stalled pipe)."""
        start = time.monotonic()
        wrapped = ["timeout", "-s", "KILL", f"{limits.timeout_s:g}", "bash", "-c", command]
        api = self._provider.client.api
        exec_id = api.exec_create(self.container.id, wrapped, user=USER, workdir=WORKSPACE,
                                  environment={"HOME": "/tmp"})["Id"]  # fmt: skip
        capture = OutputCapture(limits.max_output_bytes)
        for chunk in api.exec_start(exec_id, stream=True):
            capture.feed(chunk)
            if capture.total > limits.output_kill_bytes or time.monotonic() - start > limits.timeout_s + 5:
                break
        exit_code = api.exec_inspect(exec_id).get("ExitCode")
        timed_out = exit_code in (124, 137) and time.monotonic() - start >= limits.timeout_s
        output = capture.text() + (
            f"\n[timed out after {limits.timeout_s:g}s: command killed]\n" if timed_out else ""
        )
        return ExecResult(
            exit_code=-1 if exit_code is None else exit_code, output=output, timed_out=timed_out,
            truncated=capture.omitted > 0, duration_s=time.monotonic() - start,
        )  # fmt: skip

    async def read_file(self, path: str) -> str:
        target = _container_path(path)
        return await asyncio.to_thread(self._read, target)

    def _read(self, target: str) -> str:
        try:
            chunks, _stat = self.container.get_archive(target)
        except Exception as exc:
            if _is_not_found(exc):
                raise SandboxError(f"{target} does not exist in the sandbox") from exc
            raise
        with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
            member = tar.next()
            extracted = tar.extractfile(member) if member is not None else None
            if extracted is None:
                raise SandboxError(f"{target} is not a regular file")
            return extracted.read().decode("utf-8", errors="replace")

    async def write_file(self, path: str, content: str) -> None:
        rel = _container_path(path)[len(WORKSPACE) + 1 :]
        archive = tar_files({rel: content.encode()})
        ok = await asyncio.to_thread(self.container.put_archive, WORKSPACE, archive)
        if ok is False:
            raise SandboxError(f"could not write {path!r} into the container")

    async def diff(self) -> str:
        result = await self._run_checked(_DIFF, "diff")
        return result.output

    async def _run_checked(self, script: str, what: str) -> ExecResult:
        cfg = self._provider.config  # a diff must never be truncated
        big = replace(JailLimits.from_config(cfg), timeout_s=cfg.exec_timeout_s * 4,
                      max_output_bytes=1 << 30, output_kill_bytes=1 << 30)  # fmt: skip
        result = await asyncio.to_thread(self._exec, script, big)
        if result.exit_code != 0:
            raise SandboxError(f"{what} failed in container {self.name}: {result.output[-1000:]}")
        return result

    async def destroy(self) -> None:
        await asyncio.to_thread(self._provider.remove, self.container.id, self.name)


class DockerSandboxProvider(SandboxProvider):
    """Creates one container per episode. `client` is injectable (tests, custom engines); by default
    the engine comes from the environment (DOCKER_HOST) on first use."""

    def __init__(self, config: SandboxConfig | None = None, client: Any | None = None) -> None:
        self.config = config or SandboxConfig(type="docker")
        self._client = client
        self._connected = False

    @property
    def client(self) -> Any:
        if not self._connected:
            self._client = _connect(self._client)
            self._connected = True
        return self._client

    def volume_options(self, name: str) -> dict[str, Any]:
        """The workspace volume: a tmpfs owned by the sandbox user (a fresh disk volume would be
        root-owned, and with every capability dropped nothing in the container could chown it)."""
        opts = f"size={self.config.workspace_mb}m,uid=65534,gid=65534,mode=0755"
        return {"name": f"rollway-{name}", "driver": "local",
                "driver_opts": {"type": "tmpfs", "device": "tmpfs", "o": opts},
                "labels": {"rollway.sandbox": name}}  # fmt: skip

    def container_options(self, name: str) -> dict[str, Any]:
        """Everything that locks the container down; kept in one place so a test can read it."""
        cfg = self.config
        return {
            "name": f"rollway-{name}",
            "command": ["sleep", "infinity"],
            "detach": True,
            "init": True,  # reaps the zombies of killed commands
            "user": USER,
            "working_dir": WORKSPACE,
            "network_disabled": True,
            "network_mode": "none",
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "read_only": True,
            "mem_limit": f"{cfg.memory_mb}m",
            "memswap_limit": f"{cfg.memory_mb}m",
            "pids_limit": cfg.max_processes,
            "ulimits": [
                {"Name": "fsize", "Soft": cfg.max_file_mb * 2**20, "Hard": cfg.max_file_mb * 2**20},
                {"Name": "core", "Soft": 0, "Hard": 0},
            ],  # fmt: skip
            "volumes": {f"rollway-{name}": {"bind": WORKSPACE, "mode": "rw"}},
            "tmpfs": {"/tmp": "rw,exec,size=512m,mode=1777", STATE: "rw,size=256m,mode=1777"},
            "environment": {"HOME": "/tmp"},
            "labels": {"rollway.sandbox": name},
        }

    async def create(self, spec: SandboxSpec, name: str) -> DockerSandbox:
        """Start the container, copy the source and files in, run setup, snapshot the base with git."""
        client = self.client
        image = spec.image or self.config.image
        await asyncio.to_thread(client.volumes.create, **self.volume_options(name))
        container = await asyncio.to_thread(client.containers.run, image, **self.container_options(name))
        sandbox = DockerSandbox(self, container, name)
        try:
            files = _source_files(spec.source_dir) if spec.source_dir else {}
            files.update(
                {str(_container_path(p))[len(WORKSPACE) + 1 :]: c.encode() for p, c in spec.files.items()}
            )
            await asyncio.to_thread(container.put_archive, WORKSPACE, tar_files(files))
            for command in spec.setup_commands:
                result = await sandbox.exec(command)
                if result.exit_code != 0:
                    raise SandboxError(
                        f"setup command {command!r} failed (exit {result.exit_code}): {result.output[-1000:]}"
                    )
            await sandbox._run_checked(_SNAPSHOT, "base snapshot (the image needs git and bash)")
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def attach(self, handle: dict[str, Any]) -> DockerSandbox:
        if handle.get("kind") != "docker":
            raise SandboxError(
                f"handle {handle!r} is not a docker sandbox; set sandbox.type to match its kind"
            )
        try:
            container = await asyncio.to_thread(self.client.containers.get, handle["container"])
        except Exception as exc:
            if _is_not_found(exc):
                raise SandboxError(
                    f"container {handle['container']} is gone (destroyed or another engine)"
                ) from exc
            raise
        return DockerSandbox(self, container, str(handle.get("name", "")))

    def remove(self, container_id: str, name: str) -> None:
        """Remove container and workspace volume; already-gone is fine (destroy is idempotent)."""
        for collection, key in (
            (self.client.containers, container_id),
            (self.client.volumes, f"rollway-{name}"),
        ):
            try:
                collection.get(key).remove(force=True)
            except Exception as exc:
                if not _is_not_found(exc):
                    raise

    async def check(self) -> dict[str, Any]:
        """Engine reachable, then the container's protections probed from inside."""
        box = await self.create(SandboxSpec(), f"check-{int(time.time() * 1000)}")
        try:
            ident = await box.exec(
                "id -u; grep CapEff /proc/self/status; touch /usr/x 2>/dev/null || echo ro"
            )
            net = await box.exec("cat /sys/class/net/*/operstate 2>/dev/null | grep -c up || true")
            slow = await box.exec("sleep 30", timeout_s=1)
            words = ident.output.split()
            report = {
                "type": "docker",
                "unprivileged_user": words[:1] == ["65534"],
                "capabilities_dropped": "0000000000000000" in words,
                "readonly_system": words[-1:] == ["ro"],
                "network_isolated": net.output.strip() in ("0", ""),
                "time_limited": slow.timed_out,
            }
        finally:
            await box.destroy()
        report["all_protections_hold"] = all(v for v in report.values() if isinstance(v, bool))
        return report


def _container_path(path: str) -> str:
    """Absolute container path of workspace-relative `path` (absolute paths and `..` refused)."""
    if not path or PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts:
        raise SandboxError(f"path {path!r} must be relative to the workspace root, without '..'")
    return posixpath.normpath(posixpath.join(WORKSPACE, path))


def _source_files(source_dir: str) -> dict[str, bytes]:
    root = Path(source_dir)
    if not root.is_dir():
        raise SandboxError(f"source_dir {source_dir!r} is not a folder")
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def tar_files(files: dict[str, bytes]) -> bytes:
    """A tar of `files` with their parent folders. put_archive makes everything root-owned, so modes
    are widened: the sandbox user (65534) must be able to edit what the framework put there.
    (Executable bits of source files are not carried over; `chmod +x` in setup_commands if needed.)"""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs = sorted(
            {str(parent) for rel in files for parent in PurePosixPath(rel).parents if str(parent) != "."}
        )
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o777
            tar.addfile(info)
        for rel, data in files.items():
            info = tarfile.TarInfo(rel)
            info.size, info.mode = len(data), 0o666
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
