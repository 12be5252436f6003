"""A launched inference server's temporary files live in a folder of its own that its stop removes.

vLLM puts its ZeroMQ sockets (one per start and more per engine process) and its distributed-init files in
the temporary folder and leaves them there when it exits: a day of runs left hundreds of `/tmp/<uuid>`
sockets behind. Real parts: a real HTTP server process (a few lines of Python that make a unix socket in
the temporary folder as vLLM does) launched, probed and stopped by the launcher rollway uses for engines."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from rollway.base.process import free_port
from rollway.policies.launch import ServerProcess

SERVER = r"""
import http.server, os, socket, sys, tempfile, uuid
path = os.path.join(tempfile.gettempdir(), str(uuid.uuid4()))
socket.socket(socket.AF_UNIX).bind(path)
print("socket", path, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _socket_path(log: Path) -> Path:
    return Path(next(line.split()[1] for line in log.read_text().splitlines() if line.startswith("socket ")))


def test_a_servers_temporary_files_are_its_own_and_go_with_its_stop(tmp_path):
    port = free_port()
    server = ServerProcess([sys.executable, "-c", SERVER, str(port)], {}, port, tmp_path / "server.log").start()
    try:
        server.wait_ready(120)
        made = _socket_path(tmp_path / "server.log")
        assert made.exists() and made.parent != Path(tempfile.gettempdir()), made
        assert made.parent.stat().st_mode & 0o077 == 0, "the folder is readable by other users"
    finally:
        server.stop()
    assert not made.exists() and not made.parent.exists(), made


def test_a_killed_servers_folder_goes_when_it_is_replaced_or_stopped(tmp_path):
    """A SIGKILLed server runs no exit code of its own: the launcher removes its folder."""
    port = free_port()
    server = ServerProcess([sys.executable, "-c", SERVER, str(port)], {}, port, tmp_path / "server.log").start()
    server.wait_ready(120)
    made = _socket_path(tmp_path / "server.log")
    server.proc.kill()
    assert made.exists()
    server.stop()
    assert not made.parent.exists(), made
