"""Launched inference servers (policies/launch.py) are restarted when they stop serving, not only when their
process exits. Real parts: rollway's built-in CPU engine serving SmolLM2."""

from __future__ import annotations

import os
import signal
import time

from rollway.base.http import http_ok
from rollway.policies import launch
from rollway.policies.config import PolicyConfig


def test_a_server_that_lives_on_but_answers_nothing_is_replaced(tmp_path, monkeypatch):
    """A stopped server (SIGSTOP: its process alive, its port silent) is what vLLM's API server looked like
    after its engine core died: `restart_dead` must replace it, as it replaces one that exited."""
    monkeypatch.setattr(launch, "HEALTH_EVERY_S", 0.2)
    monkeypatch.setattr(launch, "HEALTH_TIMEOUT_S", 0.5)
    engine = launch.launch_engine(PolicyConfig(type="openai", launch=True, engine="builtin", model="smollm2",
                                               threads=1), tmp_path)
    try:
        (server,) = engine.servers
        old_pid, port = server.proc.pid, server.port
        assert engine.restart_dead(None) == [] and server.healthy()  # a serving server is left alone
        os.kill(old_pid, signal.SIGSTOP)
        notes: list[str] = []
        deadline = time.monotonic() + 60
        while not notes and time.monotonic() < deadline:
            notes = engine.restart_dead(None)
            time.sleep(0.1)
        assert notes and "stopped answering /health" in notes[0], notes
        (new,) = engine.servers
        assert new.proc.pid != old_pid and new.port == port and http_ok(f"http://127.0.0.1:{port}/health")
        assert not os.path.exists(f"/proc/{old_pid}") or open(f"/proc/{old_pid}/stat").read().split()[2] == "Z"
    finally:
        engine.stop()
