"""The one launcher of child processes (base/process.py): readiness by port, HTTP and predicate, a
start failure or a deadline reported with the log file's name, output masked on its way to the log,
and a stop that ends the whole process group, SIGKILL included when SIGTERM is ignored."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rollway.base.process import Child, ProcessStartError, free_port


def _gone(pid: int) -> bool:
    """No such process, or only its zombie left (a reparented child's reaper may be slow or absent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_ready_when_a_real_http_server_answers_and_stop_ends_it(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "http.out"
    server = Child([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                    "--directory", str(tmp_path)], log, name="the test server").start()
    try:
        server.wait_for_http(f"http://127.0.0.1:{port}/", timeout_s=60)
        assert server.alive
    finally:
        server.stop(grace_s=10)
    assert not server.alive and server.returncode is not None


def test_ready_by_port(tmp_path: Path) -> None:
    port = free_port()
    code = (f"import socket, time; s = socket.create_server(('127.0.0.1', {port})); "
            "print('listening', flush=True); time.sleep(60)")
    with Child([sys.executable, "-c", code], tmp_path / "port.out") as child:
        child.wait_for_port(port, timeout_s=60)
        assert _wait_until(lambda: "listening" in (tmp_path / "port.out").read_text())
    assert not child.alive


def test_deadline_error_names_the_log_and_stops_the_child(tmp_path: Path) -> None:
    log = tmp_path / "slow.out"
    child = Child([sys.executable, "-c", "import time; print('warming up', flush=True); time.sleep(600)"],
                  log, name="the slow server").start()
    with pytest.raises(ProcessStartError, match=rf"the slow server was not ready within 0.5s; see {log}"):
        child.wait_ready(lambda: False, timeout_s=0.5)
    assert not child.alive, "a child that missed its deadline must not be left running"


def test_exit_at_start_names_code_and_log_and_the_log_is_masked(tmp_path: Path) -> None:
    log = tmp_path / "crash.out"
    code = "print('Authorization: Bearer sk-live-abcdef123456', flush=True); raise SystemExit(3)"
    child = Child([sys.executable, "-c", code], log, name="the crashing server").start()
    with pytest.raises(ProcessStartError, match=rf"the crashing server exited at start \(code 3\); see {log}"):
        child.wait_ready(lambda: False, timeout_s=120)
    assert _wait_until(lambda: "Bearer" in log.read_text())
    assert "abcdef123456" not in log.read_text()


def test_stop_kills_the_whole_group_even_when_sigterm_is_ignored(tmp_path: Path) -> None:
    """The child starts a grandchild; both ignore SIGTERM. stop() must SIGKILL the group after the grace."""
    pids = tmp_path / "pids"
    code = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{g.pid}}'); time.sleep(600)")
    child = Child([sys.executable, "-c", code], tmp_path / "group.out").start()
    child.wait_ready(lambda: pids.exists() and len(pids.read_text().split()) == 2, timeout_s=60)
    leader, grandchild = map(int, pids.read_text().split())
    assert leader == child.pid and not _gone(grandchild)
    child.stop(grace_s=0.5)
    assert child.returncode == -9
    assert _wait_until(lambda: _gone(grandchild)), "the grandchild outlived the stop"


def test_term_leader_only_lets_the_leader_end_its_children_itself(tmp_path: Path) -> None:
    """A stage worker gets SIGTERM alone and tears down what it started; its children see no SIGTERM."""
    marks = tmp_path / "marks"
    grandchild = tmp_path / "grandchild.py"
    grandchild.write_text(
        "import signal, sys, time\n"
        "mark = lambda word: open(sys.argv[1], 'a').write(word + ' ')\n"
        "signal.signal(signal.SIGTERM, lambda *_: mark('grandchild-term'))\n"
        "mark('grandchild-ready')\n"
        "time.sleep(600)\n")
    leader = tmp_path / "leader.py"
    leader.write_text(
        "import signal, subprocess, sys, time\n"
        "mark = lambda word: open(sys.argv[1], 'a').write(word + ' ')\n"
        "g = subprocess.Popen([sys.executable, sys.argv[2], sys.argv[1]])\n"
        "def on_term(*_):\n"
        "    mark('leader-term'); g.kill(); g.wait(); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "mark('ready')\n"
        "time.sleep(600)\n")
    child = Child([sys.executable, str(leader), str(marks), str(grandchild)], tmp_path / "leader.out",
                  term_leader_only=True).start()
    child.wait_ready(lambda: marks.exists() and {"ready", "grandchild-ready"} <= set(marks.read_text().split()),
                     timeout_s=60)
    assert child.stop(grace_s=30) == 0
    assert sorted(marks.read_text().split()) == ["grandchild-ready", "leader-term", "ready"]


def test_not_started_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="was not started"):
        Child(["true"], name="x").poll()


def test_a_supervisor_killed_from_outside_leaves_no_child_running(tmp_path: Path) -> None:
    """A supervisor (as `rollway up`, a benchmark or a test worker) starts a child with the launcher's
    defaults and is then SIGKILLed, so none of its cleanup runs: the child must still end (once, stage
    workers and engines of killed benchmark runs were left polling a dead broker for minutes)."""
    import os
    import signal
    import subprocess

    pid_file = tmp_path / "child.pid"
    code = ("import sys, time; from pathlib import Path; from rollway.base.process import Child; "
            "c = Child([sys.executable, '-c', 'import time; time.sleep(600)'], None).start(); "
            f"Path({str(pid_file)!r}).write_text(str(c.pid)); time.sleep(600)")
    supervisor = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert _wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", 60)
        child = int(pid_file.read_text())
        assert not _gone(child)
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        assert _wait_until(lambda: _gone(child)), "the child outlived its killed supervisor"
    finally:
        supervisor.kill()
