"""The one launcher of the child processes rollway starts (stage workers, the broker, inference
engines, simulators, learner ranks, benchmark phases): a log file written through the redactor, a
readiness wait with a deadline whose error names the log, and a stop that ends the whole process group."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from rollway.base.redaction import redact
from rollway.base.secret_pipe import hand_over

PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal the kernel sends a process when its parent dies."""


class ProcessStartError(RuntimeError):
    """A child exited while starting or was not ready by its deadline; the message names its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port now."""
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when its parent dies, however it dies (SIGKILL included, where no
    cleanup code runs). Linux only; a no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_logged(argv: list[str], log_path: Path, env: Mapping[str, str] | None = None,
                 **popen_kwargs: Any) -> subprocess.Popen:
    """Start `argv` with stdout and stderr appended to `log_path` through `redact`: whatever the child
    prints (a traceback, a library's debug line, a C library's message) reaches the log masked. A thread
    copies line by line until the child closes its output."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, **popen_kwargs)
    assert proc.stdout is not None
    out = open(log_path, "ab")  # noqa: SIM115 (the copier thread owns and closes it)
    threading.Thread(target=_copy_redacted, args=(proc.stdout, out), daemon=True,
                     name=f"log-copy-{proc.pid}").start()
    return proc


def _copy_redacted(src: IO[bytes], dst: IO[bytes]) -> None:
    with src, dst:
        for line in iter(src.readline, b""):
            dst.write(redact(line.decode("utf-8", errors="replace")).encode())
            dst.flush()  # readers (log_tail on a crash, tests) see the line at once


class Child:
    """One child process. `log_path`: its output, appended through the redactor (None: it shares this
    process's stdout and stderr; os.devnull: discarded). `env`: added to this process's environment.
    `own_group`: its own session and process group, so `stop` ends everything it started too (False for
    a child that must get a terminal's Ctrl-C with its parent). `die_with_parent` (default on): the kernel
    SIGTERMs it when the thread that started it ends, so a supervisor, benchmark or test killed from
    outside (SIGKILL, a timeout) leaves no stage worker, broker or engine running on its own; start a
    child from a thread that lives as long as the child should.
    `term_leader_only`: `stop`'s SIGTERM goes to the child alone, which then ends its own children in
    its own order (a stage worker tears its sandboxes down); the SIGKILL after the grace still goes to
    the whole group.
    `secrets`: values the child takes with `rollway.base.secret_pipe.take_secret(name)`, handed over a pipe
    (never in its environment block or argv, where /proc and `ps` would show them for its whole life)."""

    def __init__(self, argv: list[str], log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 *, name: str | None = None, own_group: bool = True, die_with_parent: bool = True,
                 term_leader_only: bool = False, stdin_pipe: bool = False,
                 secrets: Mapping[str, str] | None = None) -> None:
        self.argv, self.log_path, self.env = list(argv), log_path, dict(env or {})
        self.secrets = dict(secrets or {})
        self.stdin_pipe = stdin_pipe
        """Give it a pipe as stdin (`send` writes to it; closed when this process ends)."""
        self.name = name or Path(argv[0]).name
        self.own_group, self.die_with_parent, self.term_leader_only = own_group, die_with_parent, term_leader_only
        self.popen: subprocess.Popen | None = None

    def start(self) -> Child:
        kwargs: dict[str, Any] = {"start_new_session": self.own_group,
                                  "env": {**os.environ, **self.env}}
        read_end = None
        if self.secrets:
            fd_env, read_end = hand_over(self.secrets)
            kwargs["env"].update(fd_env)
            kwargs["pass_fds"] = (read_end,)
        try:
            self._spawn(kwargs)
        finally:
            if read_end is not None:
                os.close(read_end)  # the child holds its own copy; the pipe ends when it has read
        return self

    def _spawn(self, kwargs: dict[str, Any]) -> None:
        if self.die_with_parent:
            kwargs["preexec_fn"] = _die_with_parent
        if self.stdin_pipe:
            kwargs["stdin"] = subprocess.PIPE
        if self.log_path is None:
            self.popen = subprocess.Popen(self.argv, **kwargs)
        elif str(self.log_path) == os.devnull:
            self.popen = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, **kwargs)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.popen = spawn_logged(self.argv, self.log_path, **kwargs)

    # -- state
    @property
    def pid(self) -> int:
        return self._started().pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode if self.popen is not None else None

    def poll(self) -> int | None:
        return self._started().poll()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait(self, timeout_s: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired when it is still running after `timeout_s`."""
        return self._started().wait(timeout_s)

    # -- readiness
    def wait_ready(self, ready: Callable[[], bool], timeout_s: float, *, what: str = "ready",
                   poll_s: float = 0.05) -> None:
        """Return once `ready()` is true. ProcessStartError naming the log when the child exits first or
        the deadline passes (then the child is stopped: a half-started server must not linger)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.poll() is not None:
                raise ProcessStartError(f"{self.name} exited at start (code {self.returncode}); see {self._log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ProcessStartError(f"{self.name} was not {what} within {timeout_s:g}s; see {self._log()}")
            time.sleep(poll_s)

    def wait_for_port(self, port: int, timeout_s: float) -> None:
        """Ready once something listens on 127.0.0.1:port."""
        self.wait_ready(lambda: port_open(port), timeout_s, what=f"listening on 127.0.0.1:{port}", poll_s=0.02)

    def wait_for_http(self, url: str, timeout_s: float) -> None:
        """Ready once `url` (a health route) answers 200."""
        from rollway.base.http import http_ok

        self.wait_ready(lambda: http_ok(url, timeout_s=2.0), timeout_s, what=f"answering {url}", poll_s=0.1)

    def send(self, line: str) -> None:
        """Write a line to its stdin pipe (`stdin_pipe`); nothing once it has exited."""
        stdin = self._started().stdin
        if stdin is None:
            raise RuntimeError(f"{self.name} has no stdin pipe (start it with stdin_pipe=True)")
        with contextlib.suppress(BrokenPipeError, ValueError):
            stdin.write(f"{line}\n".encode())
            stdin.flush()

    # -- ending
    def signal(self, sig: int, group: bool = True) -> None:
        """Send `sig` to its process group (own_group and `group`) or to it alone; nothing once it has exited."""
        if not self.alive:
            return
        with contextlib.suppress(ProcessLookupError):
            if self.own_group and group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM, to the group or (term_leader_only) to the child alone; `stop` waits for the exit."""
        self.signal(signal.SIGTERM, group=not self.term_leader_only)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s` if it has not exited; returns its exit code. With
        own_group the whole group gets the SIGKILL (and the SIGTERM unless term_leader_only), so
        grandchildren (a server's workers) end too."""
        if self.popen is None:
            return None
        self.terminate()
        try:
            return self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL it (its group with own_group) and reap it."""
        if self.popen is None:
            return
        self.signal(signal.SIGKILL)
        self.popen.wait()

    def __enter__(self) -> Child:
        return self if self.popen is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _started(self) -> subprocess.Popen:
        if self.popen is None:
            raise RuntimeError(f"{self.name} was not started (call start() first)")
        return self.popen

    def _log(self) -> str:
        if self.log_path is None:
            return "its output above"
        return "nothing: its output was discarded" if str(self.log_path) == os.devnull else str(self.log_path)
