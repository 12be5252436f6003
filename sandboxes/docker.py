"""Docker sandboxes: one locked-down container per episode, driven through the Docker SDK."""

from __future__ import annotations

import asyncio
import io
import os
import posixpath
import shutil
import socket
import struct
import tarfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from rollway.sandboxes.base import (
    EngineOutOfDisk,
    EngineUnreachable,
    ExecResult,
    OutputLost,
    Sandbox,
    SandboxError,
    SandboxGone,
    SandboxProvider,
    SandboxSpec,
)
from rollway.sandboxes.config import DockerSandboxConfig
from rollway.sandboxes.images import without_installed_copies
from rollway.sandboxes.jail import JailLimits, OutputCapture
from rollway.sandboxes.seccomp import docker_profile
from rollway.sandboxes.task_tree import FIXED_TIME, NORMALISE_COMMAND, library_names

WORKSPACE = "/workspace"
STATE = "/rollway"
"""Holds the base snapshot repository, outside the workspace and owned by KEEPER (mode 0700), so the
agent can neither see nor rewrite the base its diff is measured against."""
USER = "65534:65534"
"""Every agent command runs as nobody."""
KEEPER = "65533:65533"
"""The container's own process (`sleep infinity`) and the snapshot's git run as this second
unprivileged user: an agent command that kills every process it may signal cannot stop the container."""
JUDGE = "/rollway-judge"
"""rollway's own folder in every container, a tmpfs owned by KEEPER (mode 0755): `bin/` holds execute-only
copies of bash and timeout (mode 0111, made at create), which every command of the sandbox user and a
Harbor verifier's test.sh run under. A process started from a file its user may not read is not dumpable:
no process of the same user may open its /proc/PID/mem, /proc/PID/fd or trace it (with ptrace refused
by the seccomp profile anyway), so an agent's program cannot rewrite the wrapper that reports a command's
end, or the test.sh that ran it. Harbor's /tests and /logs live here too (envs/harbor_verifier.py)."""
JUDGE_BIN = f"{JUDGE}/bin"
GATEWAY_DIR = "/rollway-gateway"
"""Where a container sees its host folder under `sandbox.gateway_root` (read-only)."""
LABEL = "rollway.sandbox"
POOL_OWNER_LABEL = "rollway.pool-owner"
"""On warm-pool containers: `HOST:PID` of the process that started them, so another provider on
the same host can remove the idle ones a killed process left behind."""
"""Label (value: the sandbox name) on every container and volume this provider creates."""
_UNREACHABLE = (
    "start it (as root: bash scripts/setup-docker.sh, which runs dockerd), point DOCKER_HOST at a "
    "running engine, or set sandbox.type=local"
)
_GRACE_S = 3.0
"""How long past its timeout a command's output may stay open (processes that escaped `timeout`)."""
# Inside the container: `timeout` ends the command's process group; then every process left of the
# sandbox user (setsid'd or double-forked ones) is killed, so no process outlives its command (as
# in the local jail, where each command has its own pid namespace). The wrapper then prints its end
# marker on stdout and on stderr (see EndMarks); the marker comes in its environment, which it takes
# out of the command's, and a wrapper started from JUDGE_BIN is not dumpable: no process of the sandbox
# user can read it (argv could be read, from /proc/PID/cmdline).
_END_ENV = "ROLLWAY_END"
_TAKE_END = f'm=${_END_ENV}; unset {_END_ENV}; '
_PRINT_END = 'printf %s "$m"; printf %s "$m" >&2; exit $rc'
_WRAP = (f'{_TAKE_END}{JUDGE_BIN}/timeout -s KILL "$1" {JUDGE_BIN}/bash -c "$2"; rc=$?; kill -9 -1 2>/dev/null; '
         f'{_PRINT_END}')
_WRAP_KEEPER = f'{_TAKE_END}timeout -s KILL "$1" bash -c "$2"; rc=$?; {_PRINT_END}'  # must not kill the keeper
_WRAP_AS = f'{_TAKE_END}{JUDGE_BIN}/timeout -s KILL "$1" {JUDGE_BIN}/bash -c "$2"; rc=$?; {_PRINT_END}'
"""`exec_as` another user (a Harbor [verifier] user): not dumpable either; its leftovers are the caller's to kill."""
_EXIT_WAIT_S = 10.0
"""How long an exec whose output stream has ended may still show as running before its exit code is given
up on (-1): a heavily loaded engine can take more than the second this used to allow to record an end."""
_GIT = (f"git -c safe.directory='*' -c core.autocrlf=false -c core.fsmonitor=false -c core.hooksPath=/dev/null "
        f"--git-dir={STATE}/base.git --work-tree={WORKSPACE}")
_KEEPER_ENV = {
    # The keeper's git must read no configuration the agent can write: /tmp (the agent's HOME) is shared,
    # so HOME and XDG point into the keeper-only STATE, and the global and system files are off. What
    # the agent puts in the workspace (.gitattributes, .git/) then names filters no config defines.
    "HOME": STATE, "XDG_CONFIG_HOME": STATE, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
}  # fmt: skip
_TOOLS = (f"set -e; mkdir -p -m 0711 {JUDGE_BIN}; for t in bash timeout; do p=$(command -v $t); "
          f"rm -f {JUDGE_BIN}/$t; cp \"$p\" {JUDGE_BIN}/$t; chmod 0111 {JUDGE_BIN}/$t; done")
"""Run by KEEPER first thing at create: the execute-only tools of JUDGE_BIN."""
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
        raise EngineUnreachable(f"Docker engine unreachable ({exc}); {_UNREACHABLE}") from exc
    return client


def _status(exc: BaseException) -> int:
    return int(getattr(getattr(exc, "response", None), "status_code", 0) or 0)


def _is_not_found(exc: BaseException) -> bool:
    return type(exc).__name__ in ("NotFound", "ImageNotFound") or _status(exc) == 404


@contextmanager
def engine_errors(what: str, name: str = "") -> Iterator[None]:
    """Turn the SDK's errors into SandboxErrors that say what happened and what to do: the engine
    stopped answering, the container is gone or died, or the engine refused the request."""
    try:
        yield
    except SandboxError:
        raise
    except Exception as exc:
        text = str(exc)
        box = f"container rollway-{name}" if name else "the container"
        if _is_not_found(exc):
            raise SandboxGone(f"{what}: {box} is gone (destroyed, or on another engine); "
                               "the episode needs a new sandbox") from exc  # fmt: skip
        if _status(exc) == 409 or "is not running" in text:
            raise SandboxError(f"{what}: {box} is not running (killed, out of memory, or its engine "
                               "restarted); the episode needs a new sandbox") from exc  # fmt: skip
        if "no space left on device" in text.lower():
            said = str(getattr(exc, "explanation", None) or text)[-200:]  # the engine's words, not the URL
            raise EngineOutOfDisk(f"{what}: the Docker engine is out of disk ({said}); free space in its data root "
                                  "(docker system prune, a bigger disk)") from exc
        if _status(exc) == 0:  # no HTTP answer at all: connection refused, reset, socket gone
            raise EngineUnreachable(f"{what}: Docker engine stopped answering ({text}); {_UNREACHABLE}") from exc
        raise SandboxError(f"{what}: Docker engine refused the request ({text})") from exc


class DockerSandbox(Sandbox):
    """A running container (`sleep infinity`) with the workspace on its own volume."""

    def __init__(self, provider: DockerSandboxProvider, container_id: str, name: str) -> None:
        self._provider = provider
        self.container_id = container_id
        self.name = name
        self._relay: Any = None

    @property
    def handle(self) -> dict[str, Any]:
        handle = {"kind": "docker", "container": self.container_id, "name": self.name}
        if self._provider.engine_id is not None:  # the fleet's engine, by id (never its URL or credentials)
            handle["engine"] = self._provider.engine_id
        return handle

    @property
    def client(self) -> Any:
        """The client of the engine this container is on."""
        return self._provider.client

    async def gateway_dir(self) -> str | None:
        """The folder of this host whose `gateway.sock` the container's programs reach at GATEWAY_DIR: the
        folder bound there (an engine of this host), or, on another host's engine (GATEWAY_DIR a keeper-owned
        tmpfs), a folder of this host relayed into the container through an exec stream (sandboxes/relay.py)
        until `close_gateway`. None: the container was started without either (no `sandbox.gateway_root`)."""
        with engine_errors("inspect", self.name):
            info = await asyncio.to_thread(self._provider.client.api.inspect_container, self.container_id)
        bound = next((m["Source"] for m in info.get("Mounts", []) if m.get("Destination") == GATEWAY_DIR), None)
        if bound is not None or GATEWAY_DIR not in ((info.get("HostConfig") or {}).get("Tmpfs") or {}):
            return bound
        from rollway.sandboxes.relay import RELAY, RELAY_START_S, GatewayRelay

        await self.close_gateway()
        folder = self._provider.gateway_folder(self.name)
        api = self._provider.client.api
        with engine_errors("exec", self.name):  # isolated, from the keeper's folder: see sandboxes/relay.py
            exec_id = (await asyncio.to_thread(
                api.exec_create, self.container_id, ["python3", "-I", "-c", RELAY, f"{GATEWAY_DIR}/gateway.sock"],
                user=KEEPER, stdin=True, environment=_KEEPER_ENV, workdir=GATEWAY_DIR))["Id"]
            sock = await asyncio.to_thread(api.exec_start, exec_id, socket=True)
        self._relay = GatewayRelay(sock, os.path.join(folder, "gateway.sock"), self.name)
        if not await asyncio.to_thread(self._relay.wait_listening, RELAY_START_S):
            said = self._relay.said
            await self.close_gateway()
            raise SandboxError(f"gateway: the relay in container rollway-{self.name} did not start listening in "
                               f"{RELAY_START_S:g} s" + (f" (it said: {said})" if said else ""))
        return folder

    async def close_gateway(self) -> None:
        """End the relay `gateway_dir` started (if any) and remove this host's folder for it."""
        relay, self._relay = self._relay, None
        if relay is not None:
            await asyncio.to_thread(relay.close)
            shutil.rmtree(os.path.dirname(relay.target), ignore_errors=True)

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        limits = JailLimits.from_config(self._provider.config, timeout_s)
        return await asyncio.to_thread(self._exec, command, limits)

    async def exec_as(self, user: str, command: str, timeout_s: float | None = None) -> ExecResult:
        """`exec` as another user of the image (a Harbor task's [verifier] user); the container's
        capabilities stay dropped, so root here cannot override file modes or leave the container."""
        limits = JailLimits.from_config(self._provider.config, timeout_s)
        return await asyncio.to_thread(self._exec, command, limits, user)

    def _exec(self, command: str, limits: JailLimits, user: str = USER) -> ExecResult:
        """Run one command; its output is read from the exec's socket under a deadline, cut like a
        local jail's, and a flood or an overrun kills every process of the sandbox user and closes
        the socket (nothing keeps running, nothing leaks)."""
        start = time.monotonic()
        api = self._provider.client.api
        wrap = _WRAP if user == USER else _WRAP_KEEPER if user == KEEPER else _WRAP_AS
        marks = EndMarks(f"[rollway-end {uuid.uuid4().hex}]".encode(), OutputCapture(limits.max_output_bytes))
        # Every user but the keeper starts from the execute-only bash: not dumpable (see JUDGE).
        shell = "bash" if user == KEEPER else f"{JUDGE_BIN}/bash"
        argv = [shell, "-c", wrap, "rollway", f"{limits.timeout_s:g}", command]
        with engine_errors("exec", self.name):
            env = {"HOME": "/tmp", **self._provider.config.env} if user == USER else dict(_KEEPER_ENV)
            env[_END_ENV] = marks.marker.decode()
            exec_id = api.exec_create(self.container_id, argv, user=user, workdir=WORKSPACE, environment=env)["Id"]
            sock = api.exec_start(exec_id, socket=True)
        try:
            stopped = _pump(sock, marks, limits.output_kill_bytes, start + limits.timeout_s + _GRACE_S)
        except OSError as exc:  # reset, TLS alert: the engine (or its host) went away mid-stream
            raise EngineUnreachable(f"exec in {self.name}: the engine's connection broke while the command ran "
                                    f"({type(exc).__name__}: {exc})") from exc
        finally:
            _close(sock)
        if marks.ended:  # the command was over: a flood or an overrun after both markers is not its own
            stopped = None
        if stopped and user == USER:
            self._kill_all(user)
        exit_code = self._exit_code(exec_id)
        capture = marks.finish()
        if not marks.ended and stopped is None and exit_code is None:  # the stream ended, the command runs on
            raise EngineUnreachable(f"exec in {self.name}: the connection to the engine ended while the command "
                                    "ran (a cut TCP connection or ssh tunnel); its output is incomplete")
        if not marks.ended and stopped is None and exit_code is not None and exit_code < 128:
            # The wrapper ran to its end (a command that killed it would show 128+signal): the engine lost
            # the stream. The command may have done its work, so it is not run again; an engine failure.
            raise OutputLost(f"the Docker engine lost the output of a command in {self.name} (exit code "
                               f"{exit_code}, {capture.total} bytes received, no end marker)")
        elapsed = time.monotonic() - start
        timed_out = stopped == "overrun" or (exit_code in (124, 137) and elapsed >= limits.timeout_s)
        output = capture.text()
        if timed_out:
            output += f"\n[timed out after {limits.timeout_s:g}s: command killed]\n"
        if stopped == "flood":
            output += f"\n[command killed: more than {limits.output_kill_bytes} bytes of output]\n"
        return ExecResult(
            exit_code=-1 if exit_code is None else exit_code, output=output, timed_out=timed_out,
            truncated=capture.omitted > 0, duration_s=elapsed,
        )  # fmt: skip

    def _kill_all(self, user: str) -> None:
        """Kill every process of `user` in the container (the flooding or overrunning command)."""
        api = self._provider.client.api
        with engine_errors("kill", self.name):
            exec_id = api.exec_create(self.container_id, ["bash", "-c", "kill -9 -1"], user=user)["Id"]
            api.exec_start(exec_id)

    def _exit_code(self, exec_id: str) -> int | None:
        """The exec's exit code; a just-killed exec may need a moment to be reaped, and a loaded engine
        several seconds to record its end (polled up to _EXIT_WAIT_S, more slowly as it waits)."""
        api = self._provider.client.api
        deadline, pause = time.monotonic() + _EXIT_WAIT_S, 0.02
        with engine_errors("exec", self.name):
            while True:
                info = api.exec_inspect(exec_id)
                if not info.get("Running"):
                    return info.get("ExitCode")
                if time.monotonic() >= deadline:
                    return None
                time.sleep(pause)
                pause = min(pause * 2, 0.5)

    async def claim_turn(self, key: str) -> bool:
        """The marks live under STATE (the keeper's, mode 0700), out of the agent's reach: a mark the
        agent could make (or block, with a `.rollway` that is a file) in its workspace would fail a later
        turn as replayed, an infrastructure failure, and so let it opt out of its zero (base/blame.py)."""
        if not key or "/" in key or key in (".", "..") or not key.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"turn key {key!r} must be one plain name")
        mark = f"{STATE}/turns/{key}"
        script = (f"mkdir -p {STATE}/turns && if mkdir {mark} 2>/dev/null; then echo claimed; "
                  f"elif [ -d {mark} ]; then echo taken; else echo 'cannot make {mark}'; exit 1; fi")
        result = await asyncio.to_thread(self._exec, script, JailLimits.from_config(self._provider.config, 60), KEEPER)
        if result.output.strip() not in ("claimed", "taken"):
            raise SandboxError(f"claiming turn {key} in container rollway-{self.name} failed: {result.output[-300:]}")
        return result.output.strip() == "claimed"

    async def read_file(self, path: str) -> str:
        target = _container_path(path)
        return await asyncio.to_thread(self._read, target)

    def _read(self, target: str, hops: int = 0) -> str:
        """Read through get_archive; a symlink is followed inside the workspace only (like the
        local sandbox), at most 8 hops."""
        with engine_errors(f"read {target}", self.name):
            try:
                chunks, _stat = self._provider.client.api.get_archive(self.container_id, target)
            except Exception as exc:
                if _is_not_found(exc) and "no such container" not in str(exc).lower():
                    self._require_running()
                    raise SandboxError(f"{target} does not exist in the sandbox") from exc
                raise
            data = b"".join(chunks)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            member = tar.next()
            if member is not None and member.issym() and hops < 8:
                link = posixpath.normpath(posixpath.join(posixpath.dirname(target), member.linkname))
                if link != WORKSPACE and not link.startswith(WORKSPACE + "/"):
                    raise SandboxError(
                        f"{target} is a symlink pointing outside the workspace ({member.linkname})"
                    )
                return self._read(link, hops + 1)
            if member is None or not member.isfile():
                raise SandboxError(f"{target} is not a regular file")
            extracted = tar.extractfile(member)
            assert extracted is not None
            return extracted.read().decode("utf-8", errors="replace")

    def _require_running(self) -> None:
        """A stopped container still answers archive requests (without its workspace volume)."""
        state = self._provider.client.api.inspect_container(self.container_id).get("State", {})
        if not state.get("Running"):
            raise SandboxError(f"container rollway-{self.name} is not running (killed, out of memory, or its "
                               "engine restarted); the episode needs a new sandbox")  # fmt: skip

    async def write_file(self, path: str, content: str) -> None:
        rel = _container_path(path)[len(WORKSPACE) + 1 :]
        archive = tar_files({rel: content.encode()})
        await asyncio.to_thread(self._put, archive, f"write {path}")

    async def write_bytes(self, path: str, data: bytes, executable: bool = False) -> None:
        rel = _container_path(path)[len(WORKSPACE) + 1 :]
        archive = tar_files({rel: data}, executable={rel} if executable else set())
        await asyncio.to_thread(self._put, archive, f"write {path}")

    def _put(self, archive: bytes, what: str) -> None:
        with engine_errors(what, self.name):
            ok = self._provider.client.api.put_archive(self.container_id, WORKSPACE, archive)
        if ok is False:
            raise SandboxError(f"{what}: the engine refused the archive")

    async def diff(self) -> str:
        result = await self._run_checked(_DIFF, "diff")
        return result.output

    async def keeper_exec(self, script: str, what: str) -> ExecResult:
        """`script` run as KEEPER (rollway's user in the container, out of the agent's reach); SandboxError
        naming `what` when it fails."""
        return await self._run_checked(script, what)

    async def _run_checked(self, script: str, what: str) -> ExecResult:
        cfg = self._provider.config  # a diff must never be truncated
        big = replace(JailLimits.from_config(cfg), timeout_s=cfg.keeper_timeout_s,
                      max_output_bytes=1 << 30, output_kill_bytes=1 << 30)  # fmt: skip
        result = await asyncio.to_thread(self._exec, script, big, KEEPER)
        if result.exit_code != 0:
            raise SandboxError(f"{what} failed in container rollway-{self.name}: {result.output[-1000:]}")
        return result

    async def destroy(self) -> None:
        await asyncio.to_thread(self._provider.remove, self.container_id, self.name)


class EndMarks:
    """Tells a command's whole output from a stream the engine cut short (moby#27289: now and then an
    exec's output, or the last of it, never arrives, which a grader would read as "no test passed").
    The wrapper prints a fresh marker last on stdout and last on stderr; each stream comes in order, so a
    stream whose marker arrived is whole, and the output is ended once both markers came. What a stream
    carries after its marker is not the command's output and is dropped: a process that outlived the
    wrapper (a fork bomb's child caught mid-write by its kill, a [verifier] user's leftover) cannot turn
    the command into a lost stream. The marker is unknown to the command (see _WRAP), so it cannot end its
    own output early either. Frames are fed in the order they come; the bytes of a stream are held back
    only while they may be the start of its marker."""

    STREAMS = (1, 2)
    """The multiplexed stream's stdout and stderr."""

    def __init__(self, marker: bytes, capture: OutputCapture) -> None:
        self.marker = marker
        self.capture = capture
        self._held = {n: b"" for n in self.STREAMS}
        self._seen: set[int] = set()

    @property
    def ended(self) -> bool:
        return self._seen.issuperset(self.STREAMS)

    def feed(self, stream: int, payload: bytes) -> None:
        if stream not in self._held or stream in self._seen:
            return  # stdin's number, or past this stream's marker
        data = self._held[stream] + payload
        at = data.find(self.marker)
        if at >= 0:
            self.capture.feed(data[:at])
            self._held[stream] = b""
            self._seen.add(stream)
            return
        keep = self._marker_start(data)
        self.capture.feed(data[:len(data) - keep])
        self._held[stream] = data[len(data) - keep:]

    def _marker_start(self, data: bytes) -> int:
        """How many of `data`'s last bytes are the start of the marker (at most its length - 1)."""
        first = self.marker[:1]
        low = max(0, len(data) - len(self.marker) + 1)
        at = data.rfind(first, low)
        while at >= 0:
            if self.marker.startswith(data[at:]):
                return len(data) - at
            at = data.rfind(first, low, at)
        return 0

    def finish(self) -> OutputCapture:
        """The capture, with what a stream without its marker still held back (its output after all)."""
        for stream in self.STREAMS:
            if stream not in self._seen:
                self.capture.feed(self._held[stream])
            self._held[stream] = b""
        return self.capture


def buffered_stream_bytes(sock: Any) -> bytes:
    """The first bytes of a hijacked exec stream that the HTTP response's reader already took into its buffer
    with the upgrade's headers. Reads from the socket alone miss them: under load about 1 exec in 100 here,
    a short command's whole output, end marker included (it looked like the engine had lost the stream)."""
    fp = getattr(getattr(getattr(getattr(sock, "_response", None), "raw", None), "_fp", None), "fp", None)
    if fp is None:
        return b""
    raw = getattr(sock, "_sock", sock)
    timeout = raw.gettimeout()
    raw.settimeout(0)  # the buffered bytes, and at most what the kernel already holds: never a wait
    try:
        return fp.read1(1 << 20) or b""
    except OSError:  # nothing buffered and nothing arrived yet (EAGAIN, an SSL want-read)
        return b""
    finally:
        raw.settimeout(timeout)


def _pump(sock: Any, marks: EndMarks, kill_bytes: int, deadline: float) -> str | None:
    """Read the exec's multiplexed stream (8-byte frame headers) to its end; "flood" once more than
    `kill_bytes` came, "overrun" when the deadline passes with it still open. It reads on past both end
    markers: the engine ends the stream two seconds after the wrapper exits at most, and reading it to that
    end (not closing it at the markers) keeps the exec's exit code (Docker records 126 for an exec whose
    client left while its output was still open)."""
    raw = getattr(sock, "_sock", sock)
    pending = bytearray(buffered_stream_bytes(sock))
    received = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "overrun"
        raw.settimeout(remaining)
        try:
            header = _read_exactly(sock, 8, pending)
            if header is None:
                return None
            stream, size = struct.unpack(">BxxxL", header)
            payload = _read_exactly(sock, size, pending) if size else b""
        except TimeoutError:
            return "overrun"
        if payload is None:
            return None
        marks.feed(stream, payload)
        received += size
        if received > kill_bytes:
            return "flood"


def _read_exactly(sock: Any, n: int, pending: bytearray) -> bytes | None:
    """`n` bytes: first from `pending` (taken out of it), then from the socket; None at its end."""
    buf = bytearray(pending[:n])
    del pending[:n]
    while len(buf) < n:
        chunk = sock.read(n - len(buf)) if hasattr(sock, "read") else sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _close(sock: Any) -> None:
    """Shut the hijacked connection down for real (closing the SocketIO alone keeps the fd open)."""
    raw = getattr(sock, "_sock", sock)
    with suppress(OSError):
        raw.shutdown(socket.SHUT_RDWR)
    with suppress(OSError):
        sock.close()
    with suppress(OSError):
        raw.close()
    response = getattr(sock, "_response", None)
    if response is not None:
        with suppress(Exception):
            response.close()


class DockerSandboxProvider(SandboxProvider):
    """Creates one container per episode. `client` is injectable (custom engines); by default the
    engine comes from the environment (DOCKER_HOST) on first use."""

    engine_id: str | None = None
    """The fleet engine this provider drives (sandboxes/fleet.py sets it); handles then name it."""

    def __init__(self, config: DockerSandboxConfig | None = None, client: Any | None = None) -> None:
        self.config = config or DockerSandboxConfig()  # its workspace is always WORKSPACE (no `workdir` field)
        self._client = client
        self._connected = False
        self._images: set[str] = set()
        self._pool: dict[str, list[tuple[str, str]]] = {}
        """image -> started, unused (container id, sandbox name) pairs (`warm_pool`)."""
        self._refills: dict[str, asyncio.Task[None]] = {}
        self._hiding: dict[tuple[str, tuple[str, ...]], str] = {}
        """(image, a task tree's libraries) -> the image its sandboxes start from (`without_installed_copies`)."""
        self._closing = False
        self._reaped = False

    @property
    def client(self) -> Any:
        if not self._connected:
            self._client = _connect(self._client)
            self._connected = True
        return self._client

    def limits(self, spec: SandboxSpec | None = None) -> tuple[int, float, int]:
        """(memory_mb, cpus, workspace_mb) of a sandbox built from `spec`: its own limits where it sets
        them, else sandbox.*; CPUs capped at the host's cores (the engine refuses more)."""
        cfg = self.config
        memory_mb, cpus, workspace_mb = (spec or SandboxSpec()).limits_over(cfg.memory_mb, cfg.cpus, cfg.workspace_mb)
        return memory_mb, min(cpus, float(os.cpu_count() or 1)), workspace_mb

    def volume_options(self, name: str, spec: SandboxSpec | None = None) -> dict[str, Any]:
        """The workspace volume: a tmpfs owned by the sandbox user (a fresh disk volume would be
        root-owned, and with every capability dropped nothing in the container could chown it).
        Its size is the workspace cap; its pages count against the container's memory. Mounted `noatime`:
        the base snapshot's `git add` reads every file in path order, and with access times kept each first
        read would leave the clock's tick on the file, an order the agent could read (task_tree.retime_tree)."""
        opts = f"size={self.limits(spec)[2]}m,uid=65534,gid=65534,mode=0755,noatime"
        return {"name": f"rollway-{name}", "driver": "local",
                "driver_opts": {"type": "tmpfs", "device": "tmpfs", "o": opts},
                "labels": {LABEL: name}}  # fmt: skip

    def container_options(self, name: str, pooled: bool = False, spec: SandboxSpec | None = None) -> dict[str, Any]:
        """Everything that locks the container down; kept in one place so a test can read it.
        Memory, CPUs and workspace size come from `spec` where it sets them (a task's own limits)."""
        cfg = self.config
        memory_mb, cpus, _ = self.limits(spec)
        labels = {LABEL: name, POOL_OWNER_LABEL: _owner()} if pooled else {LABEL: name}
        keeper_uid = KEEPER.split(":")[0]
        return {
            "name": f"rollway-{name}",
            "command": ["sleep", "infinity"],
            "detach": True,
            "init": True,  # reaps the zombies of killed commands
            "user": KEEPER,
            "working_dir": WORKSPACE,
            "network_disabled": True,
            "network_mode": "none",
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges", f"seccomp={docker_profile()}"],  # no ptrace, no process_vm_*
            "read_only": True,
            "mem_limit": f"{memory_mb}m",
            "memswap_limit": f"{memory_mb}m",
            "pids_limit": cfg.max_processes,
            "nano_cpus": int(cpus * 1e9),
            "shm_size": f"{cfg.shm_mb}m",
            "ulimits": [
                {"Name": "fsize", "Soft": cfg.max_file_mb * 2**20, "Hard": cfg.max_file_mb * 2**20},
                {"Name": "core", "Soft": 0, "Hard": 0},
                {"Name": "nofile", "Soft": cfg.max_open_files, "Hard": cfg.max_open_files},
            ],  # fmt: skip
            "volumes": {f"rollway-{name}": {"bind": WORKSPACE, "mode": "rw"},
                        **({self.gateway_folder(name): {"bind": GATEWAY_DIR, "mode": "ro"}}
                           if cfg.gateway_root and self.shares_host_folders else {}),
                        **{path: {"bind": path, "mode": "ro"} for path in cfg.ro_binds}},
            "tmpfs": {
                "/tmp": f"rw,exec,size={cfg.tmp_mb}m,mode=1777",
                STATE: f"rw,size=256m,mode=0700,uid={keeper_uid},gid={keeper_uid}",
                JUDGE: f"rw,exec,size=256m,mode=0755,uid={keeper_uid},gid={keeper_uid}",
                # Another host's engine: the keeper's relay puts the gateway's socket here (gateway_dir).
                **({GATEWAY_DIR: f"rw,size=1m,mode=0755,uid={keeper_uid},gid={keeper_uid}"}
                   if cfg.gateway_root and not self.shares_host_folders else {}),
            },  # fmt: skip
            "environment": {"HOME": "/tmp", **cfg.env},
            "labels": labels,
        }

    shares_host_folders = True
    """The engine runs on this host, so a folder of this host can be bound into its containers (the local
    engine); a fleet engine reached over TCP or SSH is taken to be another host's (sandboxes/fleet.py)."""

    def gateway_folder(self, name: str) -> str:
        """The host folder bound at GATEWAY_DIR in sandbox `name`'s container (made here, root-owned,
        readable by the container's users)."""
        folder = os.path.join(self.config.gateway_root or "", name)
        os.makedirs(folder, mode=0o755, exist_ok=True)
        return folder

    def _require_image(self, image: str) -> None:
        """Refuse early, and without trying to pull, when the engine lacks the image."""
        if image in self._images:
            return
        try:
            self.client.images.get(image)
        except Exception as exc:
            if _is_not_found(exc):
                raise SandboxError(
                    f"image {image!r} is not on this Docker engine (rollway never pulls): build it. "
                    "bash scripts/setup-docker.sh builds the default base image; "
                    "`rollway sandbox image build NAME --pip PKG...` builds a task image from it"
                ) from exc
            with engine_errors(f"look up image {image}"):
                raise
        self._images.add(image)

    def _start(self, image: str, name: str, pooled: bool = False, spec: SandboxSpec | None = None) -> str:
        """Create the volume and the container, and start it; on any failure remove both."""
        client = self.client
        self._require_image(image)
        try:
            with engine_errors("create sandbox", name):
                client.volumes.create(**self.volume_options(name, spec))
                container = client.containers.create(image, **self.container_options(name, pooled, spec))
                container.start()
        except BaseException:
            self.remove(f"rollway-{name}", name)
            raise
        return str(container.id)

    async def create(self, spec: SandboxSpec, name: str) -> DockerSandbox:
        """Start the container (or take one from the warm pool), copy the source and files in, run
        setup, snapshot the base with git."""
        image = spec.image or self.config.image
        libraries = tuple(library_names(spec.source_dir)) if spec.source_dir else ()
        if libraries and (image, libraries) not in self._hiding:  # no clean copy of them readable in the image
            self._require_image(image)
            self._hiding[image, libraries] = await asyncio.to_thread(without_installed_copies, self.client, image,
                                                                     list(libraries))
        container_id, name = await self._container_for(self._hiding.get((image, libraries), image), name, spec)
        sandbox = DockerSandbox(self, container_id, name)
        try:
            await sandbox._run_checked(_TOOLS, "rollway's execute-only tools (the image needs bash and timeout)")
            files = _source_files(spec.source_dir) if spec.source_dir else {}
            files.update(
                {str(_container_path(p))[len(WORKSPACE) + 1 :]: c.encode() for p, c in spec.files.items()}
            )
            await asyncio.to_thread(sandbox._put, tar_files(files), "copy the source in")
            for command in spec.setup_commands:
                result = await sandbox.exec(command)
                if result.exit_code != 0:
                    raise SandboxError(
                        f"setup command {command!r} failed (exit {result.exit_code}): {result.output[-1000:]}"
                    )
            if spec.setup_commands:  # what they copied or built keeps its own times and caches
                await sandbox.exec(NORMALISE_COMMAND)
            await sandbox._run_checked(_SNAPSHOT, "base snapshot (the image needs git and bash)")
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def _container_for(self, image: str, name: str, spec: SandboxSpec | None = None) -> tuple[str, str]:
        """(container id, sandbox name): a pooled container (its own name) or a new one. A spec with
        its own limits always gets a new one (pooled containers have the configured limits)."""
        own_limits = spec is not None and self.limits(spec) != self.limits()
        if self.config.warm_pool <= 0 or own_limits:
            return await asyncio.to_thread(self._start, image, name, False, spec), name
        self._require_image(image)
        pool = self._pool.setdefault(image, [])
        taken = pool.pop(0) if pool else None
        refill = self._refills.get(image)
        if not self._closing and (refill is None or refill.done()):
            self._refills[image] = asyncio.get_running_loop().create_task(self._refill(image))
        if taken is not None:
            # Named after its episode from now on: `docker ps` shows whose it is, and the reaper of
            # orphaned pools (which looks for `rollway-pool-*`) leaves it alone.
            await asyncio.to_thread(self._rename, taken[0], f"rollway-{name}")
            return taken
        return await asyncio.to_thread(self._start, image, name), name

    def _rename(self, container_id: str, new_name: str) -> None:
        with engine_errors("rename pooled container", new_name):
            self.client.containers.get(container_id).rename(new_name)

    async def _refill(self, image: str) -> None:
        if not self._reaped:
            self._reaped = True
            await asyncio.to_thread(self.reap_orphaned_pool)
        pool = self._pool.setdefault(image, [])
        while not self._closing and len(pool) < self.config.warm_pool:
            name = f"pool-{uuid.uuid4().hex[:12]}"
            pool.append((await asyncio.to_thread(self._start, image, name, True), name))

    def listed(self, label: str) -> list[dict[str, Any]]:
        """The engine's listing of every container carrying `label` (running or not): id, names and
        labels in one answer. Not the SDK's `containers.list()`: it inspects each listed container after,
        and dies of NotFound when another process removes its own container in between."""
        with engine_errors("list containers", label):
            return self.client.api.containers(all=True, filters={"label": label})

    def reap_orphaned_pool(self) -> list[str]:
        """Remove idle pooled containers (and their volumes) whose starting process on this host is
        gone: a SIGKILLed init worker cannot remove its pool at close. Pooled containers already
        handed to an episode were renamed and are never touched. Returns the removed names."""
        host = socket.gethostname()
        removed = []
        for container in self.listed(POOL_OWNER_LABEL):
            labels = container.get("Labels") or {}
            owner_host, _, pid = labels.get(POOL_OWNER_LABEL, "").rpartition(":")
            name = labels.get(LABEL, "")
            if owner_host != host or not pid.isdigit() or f"/rollway-{name}" not in (container.get("Names") or []):
                continue
            if _alive(int(pid)):
                continue
            self.remove(str(container["Id"]), name)  # already gone is fine
            removed.append(name)
        return removed

    async def close(self) -> None:
        """Let refills finish (a cancelled start would leave an untracked container), then remove
        every idle pooled container."""
        self._closing = True
        await asyncio.gather(*self._refills.values(), return_exceptions=True)
        idle = [entry for pool in self._pool.values() for entry in pool]
        self._pool.clear()
        for container_id, name in idle:
            await asyncio.to_thread(self.remove, container_id, name)

    async def attach(self, handle: dict[str, Any]) -> DockerSandbox:
        if handle.get("kind") != "docker":
            raise SandboxError(
                f"handle {handle!r} is not a docker sandbox; set sandbox.type to match its kind"
            )
        name = str(handle.get("name", ""))
        with engine_errors("attach", name):
            container = await asyncio.to_thread(self.client.containers.get, str(handle.get("container", "")))
        # A handle comes from a message anyone on the broker may write: only a container this provider
        # kind made (its label holds the handle's name, which also names the volume destroy removes) may
        # be exec'd in or removed.
        labels = container.labels or {}
        if not name or labels.get(LABEL) != name:
            raise SandboxError(f"handle {handle!r} is not a rollway sandbox (the container's {LABEL} label is "
                               f"{labels.get(LABEL)!r}); refusing to exec in or remove it")
        return DockerSandbox(self, str(container.id), name)

    def remove(self, container_id: str, name: str) -> None:
        """Remove container and workspace volume; already-gone is fine (destroy is idempotent), and so is
        a container another process is removing (two reapers of one orphaned pool): wait for it to go."""
        for collection, key in (
            (self.client.containers, container_id),
            (self.client.volumes, f"rollway-{name}"),
        ):
            try:
                with engine_errors("destroy", name):
                    collection.get(key).remove(force=True)
            except SandboxError as exc:
                cause = exc.__cause__ or exc
                if _is_not_found(cause):
                    continue
                if key == container_id and "already in progress" in str(cause):
                    self._wait_removed(key, name)
                    continue
                raise
        if self.config.gateway_root:
            shutil.rmtree(os.path.join(self.config.gateway_root, name), ignore_errors=True)

    def _wait_removed(self, container_id: str, name: str, timeout_s: float = 120.0) -> None:
        """Until the engine no longer knows the container (another caller's removal finishes): its
        `destroy` event, subscribed to before looking, so an end between the look and the wait is not missed."""
        until = int(time.time() + timeout_s)
        with engine_errors("destroy", name):
            events = self.client.events(decode=True, until=until,
                                        filters={"container": container_id, "event": "destroy"})
        try:
            try:
                with engine_errors("destroy", name):
                    self.client.api.inspect_container(container_id)
            except SandboxGone:
                return
            for _ in events:  # the stream ends at `until`
                return
        finally:
            events.close()
        raise SandboxError(f"destroy: container rollway-{name} is still being removed by another caller after "
                           f"{timeout_s:.0f}s; its engine may be stuck (see the engine's log)")

    async def check(self) -> dict[str, Any]:
        """Engine reachable, then the containment suite run against a throwaway container."""
        from rollway.sandboxes.containment import run_suite

        report: dict[str, Any] = {"type": "docker", "image": self.config.image}
        report.update(await run_suite(self))
        return report


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def tar_files(files: dict[str, bytes], executable: set[str] | frozenset[str] = frozenset()) -> bytes:
    """A tar of `files` with their parent folders. put_archive makes everything root-owned, so modes
    are widened: the sandbox user (65534) must be able to edit what the framework put there.
    (Executable bits of source files are not carried over; `chmod +x` in setup_commands if needed.)"""
    buf = io.BytesIO()
    fixed = {"atime": str(FIXED_TIME)}  # else the engine gives folders the access time 0 and files their mtime
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted(
            {str(parent) for rel in files for parent in PurePosixPath(rel).parents if str(parent) != "."}
        )
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime, info.pax_headers = tarfile.DIRTYPE, 0o777, FIXED_TIME, fixed
            tar.addfile(info)
        for rel, data in files.items():
            info = tarfile.TarInfo(rel)
            info.size, info.mode = len(data), 0o777 if rel in executable else 0o666
            info.mtime = FIXED_TIME  # one time for all: none names the file a task's builder changed
            info.pax_headers = fixed
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
