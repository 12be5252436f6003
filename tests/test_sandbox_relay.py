"""The gateway's relay into a container on another host's engine (sandboxes/relay.py), on the real engine:
the provider is told its engine shares no folders with this host (what a fleet engine reached over TCP is
taken to be), so nothing of this host is bound into the container and the gateway's socket reaches it only
through the keeper's relay on an exec stream. The gateway is stood in for by an echo server on the host
folder's socket (the relay carries bytes; tests/test_fleet.py runs a real agent program through it)."""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import sys
import threading
import time
import uuid

import pytest
from docker_engine import count_containers, ensure_engine

from rollway.sandboxes.base import SandboxSpec
from rollway.sandboxes.config import DockerSandboxConfig
from rollway.sandboxes.docker import GATEWAY_DIR, DockerSandboxProvider

pytestmark = pytest.mark.e2e

CLIENT = r"""
import socket, sys
def call(data):
    s = socket.socket(socket.AF_UNIX); s.connect("/rollway-gateway/gateway.sock"); s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    return got
big = bytes(range(256)) * 4096  # 1 MiB, every byte value
assert call(big) == big[::-1], "the 1 MiB answer differs"
answers = [call(b"hello %d" % i) for i in range(200)]  # one after another: more than the relay keeps open
assert answers == [(b"hello %d" % i)[::-1] for i in range(200)], answers[:3]
print("ok")
"""


def echo_server(folder: str) -> socket.socket:
    """On `folder`'s gateway.sock: answers each connection with what it sent, reversed, once the client has
    said all of it (bound through the folder's descriptor: the path may be too long for a socket address)."""
    srv = socket.socket(socket.AF_UNIX)
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    try:
        srv.bind(f"/proc/self/fd/{fd}/gateway.sock")
    finally:
        os.close(fd)
    srv.listen(64)

    def serve(conn: socket.socket) -> None:
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        try:
            conn.sendall(data[::-1])
        except BrokenPipeError:  # the program went away (a test's program that never reads its answer)
            pass
        conn.close()

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv


def on_a_remote_engine(tmp_path, body, spec: SandboxSpec | None = None, gateway_root=None, **config) -> None:
    """`await body(box)` on a container of this engine taken to be another host's (what a fleet engine reached
    over TCP is): nothing of this host is bound into it, and its gateway folder is relayed. Removed after."""
    ensure_engine()
    provider = DockerSandboxProvider(DockerSandboxConfig(gateway_root=str(gateway_root or tmp_path / "gw"), **config))
    provider.shares_host_folders = False
    name = f"relay-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        box = await provider.create(spec or SandboxSpec(), name)
        try:
            await body(box)
        finally:
            await box.destroy()
            await provider.close()

    asyncio.run(scenario())
    assert count_containers(name) == 0


def test_a_program_in_a_container_of_another_hosts_engine_reaches_the_gateway_through_the_relay(tmp_path):
    # A socket path past the 107 bytes a socket address holds (seen: a relay that connected by path refused
    # every connection of a run whose gateway_root was a test's deep tmp folder).
    root = tmp_path / ("g" * 80)

    async def body(box) -> None:
        info = await asyncio.to_thread(box._provider.client.api.inspect_container, box.container_id)
        assert not [m for m in info["Mounts"] if m["Type"] == "bind"], info["Mounts"]  # nothing of this host
        folder = await box.gateway_dir()
        assert folder is not None and folder.startswith(str(root))
        server = echo_server(folder)
        try:
            result = await box.exec(f"python3 -c {shlex.quote(CLIENT)}", timeout_s=300)
            assert result.exit_code == 0 and result.output.strip() == "ok", result.output[-2000:]
            # The sandbox user cannot replace the socket, write beside it, or stop the keeper's relay.
            hostile = await box.exec(f"rm -f {GATEWAY_DIR}/gateway.sock; touch {GATEWAY_DIR}/x; "
                                     "kill -9 -1; pkill -9 -u 65533; ls -l " + GATEWAY_DIR)
            assert "gateway.sock" in hostile.output and " x\n" not in hostile.output, hostile.output
            again = await box.exec(f"python3 -c {shlex.quote(CLIENT)}", timeout_s=300)
            assert again.output.strip() == "ok", again.output[-2000:]
        finally:
            server.close()
        await box.close_gateway()
        assert not os.path.exists(folder)
        after = await box.exec("python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); "
                               "s.connect('/rollway-gateway/gateway.sock'); s.sendall(b'x'); "
                               "s.shutdown(socket.SHUT_WR); print(repr(s.recv(10)))\"")
        assert "b'x'" not in after.output, after.output  # the relay is gone: nothing answers

    on_a_remote_engine(tmp_path, body, gateway_root=root)


STALLER = r"""
import socket, time
s = socket.socket(socket.AF_UNIX); s.connect("/rollway-gateway/gateway.sock")
s.sendall(b"x" * (16 << 20)); s.shutdown(socket.SHUT_WR)
time.sleep(600)  # never reads the 16 MiB answer
"""


def test_a_program_that_never_reads_its_answer_cannot_keep_the_relay_after_the_episode(tmp_path):
    """The program asks for a 16 MiB answer and never reads it: the relay in the container stops reading its
    stdin, and the worker's relay thread blocks writing to it. Ending the episode's gateway must still end
    that thread (a stuck thread and socket per such episode would pile up on the worker)."""

    async def body(box) -> None:
        folder = await box.gateway_dir()
        relay = box._relay
        server = echo_server(folder)
        program = asyncio.create_task(box.exec(f"python3 -c {shlex.quote(STALLER)}", timeout_s=600))
        try:
            def writing() -> bool:  # the relay thread is inside its write to the exec stream
                frame = sys._current_frames().get(relay.thread.ident)
                return frame is not None and frame.f_code.co_name == "_send"

            deadline = time.monotonic() + 300
            while not (writing() and await asyncio.sleep(2, True) and writing()):
                # A program that ended (its connection refused, the relay gone) never stalls anything.
                assert not program.done(), f"the program ended: {program.result()!r}"
                frame = sys._current_frames().get(relay.thread.ident)
                assert time.monotonic() < deadline, ("the relay never blocked writing to the container; its "
                                                     f"thread is in {frame and frame.f_code.co_name}")
                await asyncio.sleep(0.5)
            started = time.monotonic()
            await box.close_gateway()
            assert not relay.thread.is_alive(), "the relay thread outlived the episode's gateway"
            assert time.monotonic() - started < 30
        finally:
            server.close()
            program.cancel()
            await asyncio.gather(program, return_exceptions=True)

    on_a_remote_engine(tmp_path, body)


ONE_CALL = r"""
import socket
s = socket.socket(socket.AF_UNIX); s.connect("/rollway-gateway/gateway.sock"); s.sendall(b"ping")
s.shutdown(socket.SHUT_WR)
print(s.recv(100).decode())
"""


def test_a_program_started_the_moment_the_gateway_is_handed_out_finds_it_listening(tmp_path):
    """`gateway_dir` hands the folder out only once the relay in the container listens: the harness starts the
    program at once, and a program's first connect found no socket in a whole run under load (the relay's
    python still starting). Here the container has a twentieth of a core, so the relay's python takes far
    longer to start than the program's shell to look; and ten hand-outs on one container, each followed at
    once by a call (the previous relay's socket must not be left to refuse it)."""

    async def body(box) -> None:
        for attempt in range(10):
            folder = await box.gateway_dir()
            server = echo_server(folder)
            try:
                if attempt == 0:
                    result = await box.exec(f"test -S {GATEWAY_DIR}/gateway.sock && echo listening", timeout_s=300)
                    assert result.output.strip() == "listening", result.output
                result = await box.exec(f"python3 -c {shlex.quote(ONE_CALL)}", timeout_s=300)
            finally:
                server.close()
            assert result.exit_code == 0 and result.output.strip() == "gnip", (attempt, result.output[-1500:])
        await box.close_gateway()
        gone = await box.exec(f"test -e {GATEWAY_DIR}/gateway.sock && echo left || echo gone")
        assert gone.output.strip() == "gone", gone.output  # an ended relay takes its socket with it

    on_a_remote_engine(tmp_path, body, cpus=0.05)


PLANTED = r"""
import os, sys
with open("/tmp/planted-ran-as", "a") as f:
    f.write(f"{os.getuid()}\n")
# then hand over the real module, so that whoever imported this one goes on working
sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
del sys.modules[__name__]
import importlib
sys.modules[__name__] = importlib.import_module(__name__)
"""


def test_the_relay_runs_no_module_the_agent_planted_in_the_workspace(tmp_path):
    """Attack: the relay is the keeper's python, and the keeper owns the container's judge folder (the
    execute-only bash every command runs under, a Harbor task's tests and verdict). Started in the workspace,
    `python3 -c` looks there first for the modules it imports: the agent writes `socket.py`, `struct.py` and
    `threading.py` there, and whatever they do runs as the keeper when the next episode's gateway is handed
    out. Each planted module records who ran it and then hands over the real one."""

    async def body(box) -> None:
        plant = " && ".join(f"printf %s {shlex.quote(PLANTED)} > {module}.py"
                            for module in ("socket", "struct", "threading", "selectors"))
        assert (await box.exec(plant)).exit_code == 0
        folder = await box.gateway_dir()
        server = echo_server(folder)
        try:
            result = await box.exec(f"cd / && python3 -c {shlex.quote(ONE_CALL)}", timeout_s=300)
        finally:
            server.close()
        assert result.output.strip() == "gnip", result.output[-1500:]
        ran = await box.exec("cat /tmp/planted-ran-as 2>/dev/null; true")
        assert ran.output.strip() == "", f"the agent's module ran in the relay, as uid {ran.output.split()}"

    on_a_remote_engine(tmp_path, body)


def test_a_relay_that_cannot_start_fails_the_hand_out_and_says_so(tmp_path):
    """An image without python3 (the relay's interpreter): the hand-out fails at once with a sandbox error
    naming the relay, not after its start limit and not with a folder no relay serves."""
    from rollway.sandboxes.base import SandboxError

    client = ensure_engine()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM rollway-sandbox:bookworm\nRUN rm -f /usr/bin/python3* /usr/bin/python\n")
    image = f"rollway-test/no-python:{uuid.uuid4().hex[:8]}"
    client.images.build(path=str(ctx), tag=image, network_mode="none", rm=True, pull=False)

    async def body(box) -> None:
        started = time.monotonic()
        with pytest.raises(SandboxError, match="relay in container .* did not start listening"):
            await box.gateway_dir()
        assert time.monotonic() - started < 60  # it ended: no wait for the start limit
        gw = tmp_path / "gw"
        assert box._relay is None and not (gw.exists() and os.listdir(gw))  # nothing handed out, nothing left

    try:
        on_a_remote_engine(tmp_path, body, spec=SandboxSpec(image=image))
    finally:
        client.images.remove(image, force=True)


def test_a_ready_frame_the_http_reader_already_buffered_is_seen_without_more_bytes(tmp_path):
    """Seen once in a whole run: the relay said R at once, the HTTP reader took it into its buffer with the
    upgrade's headers, and nothing more came on the socket (the relay waits for connections), so the worker
    never parsed what it had recovered and the hand-out failed after 120 s. Here the exec socket is faked (a
    socket pair standing in for the hijacked stream, its response reader holding the engine-framed R): what
    is tested is the worker's parsing, which the real engine reaches only by that race."""
    import struct
    from types import SimpleNamespace

    from rollway.sandboxes.relay import FRAME, GatewayRelay

    frame = FRAME.pack(b"R", 0, 0)
    buffered = struct.pack(">BxxxL", 1, len(frame)) + frame

    class Reader:
        def read1(self, n: int) -> bytes:
            return buffered

    ours, theirs = socket.socketpair()
    sock = SimpleNamespace(_sock=ours, close=ours.close,
                           _response=SimpleNamespace(raw=SimpleNamespace(_fp=SimpleNamespace(fp=Reader()))))
    relay = GatewayRelay(sock, str(tmp_path / "gateway.sock"), "buffered")
    try:
        assert relay.wait_listening(20), "the buffered R frame was never parsed"
    finally:
        relay.close()
        theirs.close()
