"""The gateway's way into a container on another host's engine. A container there cannot see a folder of
the worker's host (where the gateway's unix socket is), and it has no network. What it does have is the
engine's exec stream, which the worker already reaches: a relay run in the container (as the keeper, in a
keeper-owned folder the agent cannot write) listens on the socket programs use, and carries each
connection's bytes over its stdin/stdout to the worker, which opens a connection to the gateway's socket
for each. Frames both ways: kind (1 byte: O open, D data, C no more data this way), connection id (4),
length (4), data. A connection is dropped once both ways said C. The relay says R once its socket listens
(the folder is handed out only then: a program started at once must find it), and takes the socket with it
when it ends.

The relay is the keeper's python, and the keeper owns the container's judge folder: it runs isolated
(`python3 -I`: no current folder on its module path, no PYTHON* variables, no user site) from the keeper's
own folder, so nothing the agent writes in the workspace is imported by it.

The worker's side is one thread (`GatewayRelay`): the exec socket may be TLS, and an SSL socket must not
be read and written from two threads at once."""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
from contextlib import suppress
from typing import Any

import structlog

from rollway.sandboxes.docker import _close, buffered_stream_bytes

log = structlog.get_logger()

FRAME = struct.Struct(">cII")
MAX_OPEN = 64
"""Connections a program may hold open through one relay; more are closed at once (the gateway's bound on
idle connections, per episode, as for a local socket)."""
RELAY_START_S = 120.0
"""How long the worker waits for the relay to say it listens (a python start: a fraction of a second, or
seconds on a loaded machine); past it the episode's gateway fails as the sandbox's error."""
MAX_DATA = 1 << 20
"""Largest frame the worker accepts from the relay (the relay sends at most 64 KiB): a larger length is a
broken or forged stream, and the relay is ended."""

# Run by the container's python3 as the keeper, in the folder the container has at GATEWAY_DIR (a tmpfs the
# keeper owns, mode 0755: the sandbox user connects to the socket and cannot replace it).
RELAY = r"""
import os, socket, struct, sys, threading
F = struct.Struct(">cII")
path = sys.argv[1]
if os.path.lexists(path):
    os.unlink(path)
srv = socket.socket(socket.AF_UNIX); srv.bind(path); os.chmod(path, 0o666); srv.listen(64)
mine = os.lstat(path).st_ino
out, lock, conns, shut = sys.stdout.buffer, threading.Lock(), {}, {}
def send(kind, cid, data=b""):
    with lock:
        out.write(F.pack(kind, cid, len(data)) + data); out.flush()
def end():
    try:  # only its own socket: the next hand-out's relay may have bound the path before this one got Q
        if os.lstat(path).st_ino == mine:
            os.unlink(path)
    finally:
        os._exit(0)
send(b"R", 0)
def half(cid):
    shut[cid] = shut.get(cid, 0) + 1
    if shut[cid] == 2:
        conns.pop(cid).close(); del shut[cid]
def upstream(cid, c):
    try:
        while data := c.recv(65536):
            send(b"D", cid, data)
    except OSError:
        pass
    send(b"C", cid)
    with lock:
        half(cid)
def accept():
    cid = 0
    while True:
        c, _ = srv.accept(); cid += 1
        with lock:
            conns[cid] = c
        send(b"O", cid)
        threading.Thread(target=upstream, args=(cid, c), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
inp = sys.stdin.buffer
def read(n):
    b = inp.read(n)
    if b is None or len(b) < n:
        end()
    return b
while True:
    kind, cid, size = F.unpack(read(F.size))
    data = read(size) if size else b""
    if kind == b"Q":
        end()
    with lock:
        c = conns.get(cid)
        if c is None:
            continue
        try:
            if kind == b"D":
                c.sendall(data)
            elif kind == b"C":
                c.shutdown(socket.SHUT_WR)
                half(cid)
        except OSError:
            pass
"""


class GatewayRelay:
    """The worker's end of a relay: `sock` is the exec's hijacked socket (stdin raw, stdout/stderr in the
    engine's 8-byte frames), `target` the gateway's unix socket on this host. `close()` ends it."""

    def __init__(self, sock: Any, target: str, name: str) -> None:
        self.sock, self.target, self.name = sock, target, name
        # Connections go through a descriptor of the socket's folder: its path may be longer than a socket
        # address holds (107 bytes), as the gateway binds it (gateway/server.py).
        self._folder = os.open(os.path.dirname(target), os.O_PATH | os.O_DIRECTORY)
        self._address = f"/proc/self/fd/{self._folder}/{os.path.basename(target)}"
        self.raw = getattr(sock, "_sock", sock)
        self.raw.settimeout(None)
        self.conns: dict[int, socket.socket] = {}
        self.shut: dict[int, int] = {}
        self._inbox = bytearray(buffered_stream_bytes(sock))  # engine frames not yet parsed
        self._frames = bytearray()  # the relay's stdout, not yet parsed
        self._wake_r, self._wake_w = os.pipe()
        self._answered = threading.Event()
        """Set when the relay said it listens (R), or when the relay ended before it did."""
        self.listening = False
        self.said = ""
        """The end of what the relay wrote on stderr (a traceback, when it could not start)."""
        self.thread = threading.Thread(target=self._loop, name=f"relay-{name}", daemon=True)
        self.thread.start()

    def wait_listening(self, timeout_s: float) -> bool:
        """True once the relay in the container listens on the programs' socket; False if it ended first, or
        said nothing in `timeout_s` (a generous bound: a loaded machine starts a python slowly)."""
        self._answered.wait(timeout_s)
        return self.listening

    def close(self) -> None:
        """Ends the thread: woken through its pipe, or, when it is stuck writing to a relay that does not read
        (a program that never reads its answer stalls the relay's stdin), by shutting the exec socket down
        under it. The pipe's write end is this method's alone (the thread closes everything else), so no
        write here can land in a descriptor number the process has since reused."""
        with suppress(OSError):
            os.write(self._wake_w, b"x")
        self.thread.join(timeout=5)
        if self.thread.is_alive():
            with suppress(OSError):
                self.raw.shutdown(socket.SHUT_RDWR)
            self.thread.join(timeout=30)
        os.close(self._wake_w)

    # ------------------------------------------------------------ the one thread

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.raw, selectors.EVENT_READ, "exec")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            # What the HTTP reader already took may hold the relay's R, and nothing more may come on the socket
            # until a program connects: parse it before waiting for the socket
            self._parse_exec(sel)
            while True:
                ready = [key.data for key, _ in sel.select()]
                if "wake" in ready:
                    with suppress(OSError):
                        self._send(b"Q", 0)
                    return
                if "exec" in ready and not self._from_exec(sel):
                    return
                for cid in [d for d in ready if isinstance(d, int)]:
                    self._from_gateway(sel, cid)
        except (OSError, ValueError) as exc:
            log.warning("gateway relay ended", sandbox=self.name, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self._answered.set()
            sel.close()
            for conn in self.conns.values():
                conn.close()
            self.conns.clear()
            _close(self.sock)
            for fd in (self._wake_r, self._folder):
                os.close(fd)

    def _from_exec(self, sel: selectors.BaseSelector) -> bool:
        """Whatever the exec stream holds now (an SSL socket may buffer more than one record); False at its end."""
        while True:
            chunk = self.raw.recv(65536)
            if not chunk:
                return False
            self._inbox += chunk
            if not getattr(self.raw, "pending", lambda: 0)():
                break
        self._parse_exec(sel)
        return True

    def _parse_exec(self, sel: selectors.BaseSelector) -> None:
        """Every whole engine frame in the inbox, and every whole relay frame in them, handled."""
        while len(self._inbox) >= 8:
            stream, size = struct.unpack(">BxxxL", self._inbox[:8])
            if len(self._inbox) < 8 + size:
                break
            payload = bytes(self._inbox[8:8 + size])
            del self._inbox[:8 + size]
            if stream == 1:
                self._frames += payload
            else:
                self.said = (self.said + payload.decode(errors="replace"))[-300:]
                log.warning("gateway relay says", sandbox=self.name, text=payload[-300:].decode(errors="replace"))
        while len(self._frames) >= FRAME.size:
            kind, cid, size = FRAME.unpack(self._frames[:FRAME.size])
            if size > MAX_DATA:
                raise ValueError(f"a relay frame of {size} bytes")
            if len(self._frames) < FRAME.size + size:
                break
            data = bytes(self._frames[FRAME.size:FRAME.size + size])
            del self._frames[:FRAME.size + size]
            self._frame(sel, kind, cid, data)

    def _frame(self, sel: selectors.BaseSelector, kind: bytes, cid: int, data: bytes) -> None:
        if kind == b"R":
            self.listening = True
            self._answered.set()
            return
        if kind == b"O":
            if len(self.conns) >= MAX_OPEN or cid in self.conns:
                self._send(b"C", cid)
                return
            up = socket.socket(socket.AF_UNIX)
            try:
                up.connect(self._address)
            except OSError:
                up.close()
                self._send(b"C", cid)
                return
            self.conns[cid] = up
            sel.register(up, selectors.EVENT_READ, cid)
            return
        up = self.conns.get(cid)
        if up is None:
            return
        try:
            if kind == b"D":
                up.sendall(data)
            elif kind == b"C":
                up.shutdown(socket.SHUT_WR)
                self._half(sel, cid)
        except OSError:  # the gateway's side is gone: the program's connection ends too
            self._send(b"C", cid)
            self._drop(sel, cid)

    def _from_gateway(self, sel: selectors.BaseSelector, cid: int) -> None:
        up = self.conns.get(cid)
        if up is None:
            return
        try:
            data = up.recv(65536)
        except OSError:
            data = b""
        if data:
            self._send(b"D", cid, data)
            return
        sel.unregister(up)
        self._send(b"C", cid)
        self._half(sel, cid)

    def _half(self, sel: selectors.BaseSelector, cid: int) -> None:
        self.shut[cid] = self.shut.get(cid, 0) + 1
        if self.shut[cid] == 2:
            self._drop(sel, cid)

    def _drop(self, sel: selectors.BaseSelector, cid: int) -> None:
        up = self.conns.pop(cid, None)
        self.shut.pop(cid, None)
        if up is not None:
            with suppress(KeyError, ValueError):
                sel.unregister(up)
            up.close()

    def _send(self, kind: bytes, cid: int, data: bytes = b"") -> None:
        self.raw.sendall(FRAME.pack(kind, cid, len(data)) + data)
