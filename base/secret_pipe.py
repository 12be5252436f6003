"""Secrets from a parent to a child process over a pipe, never in the child's environment block or argv:
`/proc/PID/environ` shows the environment a process started with for as long as it runs (deleting a
variable from `os.environ` later does not change it), and `ps` shows argv to every user. The parent
writes the values into a pipe whose read end the child inherits; the child reads them once at start-up,
and the pipe is gone (docs/security/secrets.md)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping

SECRET_FD_ENV = "ROLLWAY_SECRET_FD"
"""The number of the inherited descriptor the child reads its secrets from (a number, not a secret)."""

_received: dict[str, str] | None = None
_lock = threading.Lock()


def hand_over(secrets: Mapping[str, str]) -> tuple[dict[str, str], int]:
    """Before starting a child: (environment additions naming the descriptor, the read end to pass to the
    child with `pass_fds`). The values are written by a thread (a pipe holds 64 KiB before a writer
    blocks), which closes the write end; close the read end in the parent once the child started."""
    read_end, write_end = os.pipe()
    data = json.dumps(dict(secrets)).encode()

    def write() -> None:
        try:
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(data)
        except OSError:  # the child died before reading: nothing to deliver to
            pass

    threading.Thread(target=write, daemon=True, name="secret-hand-over").start()
    return {SECRET_FD_ENV: str(read_end)}, read_end


def _receive() -> dict[str, str]:
    global _received
    with _lock:
        if _received is None:
            _received = {}
            raw = os.environ.pop(SECRET_FD_ENV, None)
            if raw and raw.isdigit():
                try:
                    with os.fdopen(int(raw), "rb") as pipe:
                        _received = {str(k): str(v) for k, v in json.loads(pipe.read() or b"{}").items()}
                except (OSError, ValueError):
                    _received = {}
        return _received


def take_secret(name: str) -> str | None:
    """The secret `name` this process was handed: the environment variable `name` where one is set (by
    hand, e.g. for `rollway stage` on another machine; removed from `os.environ` so nothing this process
    starts inherits it), else the value read from the pipe (at the first call, once). Given out once."""
    received = _receive()
    with _lock:
        from_env = os.environ.pop(name, None)
        from_pipe = received.pop(name, None)
    return from_env if from_env is not None else from_pipe


def peek_secret(name: str) -> str | None:
    """As `take_secret`, but the value stays available to later callers in this process."""
    value = take_secret(name)
    if value is not None:
        with _lock:
            assert _received is not None
            _received[name] = value
    return value
