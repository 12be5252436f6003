"""A simulated sandbox for benchmarks: start-up, commands and tests take planned wall time, nothing runs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rollway.sandboxes.base import ExecResult, Sandbox, SandboxError, SandboxProvider, SandboxSpec
from rollway.sandboxes.config import SandboxConfig

SIM_SPEC_FILE = ".sim-sandbox.json"
"""SandboxSpec.files entry holding {"init_s": seconds}: how long this sandbox takes to start."""
EVENTS_FILE = "sandbox-events.jsonl"
"""One line per create/destroy under the root, appended by every process (for live-sandbox counts)."""


def _log_event(root: Path, event: str, name: str) -> None:
    # O_APPEND writes of one short line are atomic, so processes can share the file.
    line = json.dumps({"event": event, "name": name, "t": time.time()}) + "\n"
    fd = os.open(root / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class SimSandbox(Sandbox):
    """Runs only `sim-exec SECONDS OUT_BYTES` (sleeps, prints OUT_BYTES bytes) and `sim-grade SECONDS
    PASSED` (sleeps, prints the verdict). Files live in a real folder, so any worker can reattach."""

    def __init__(self, root: Path, name: str):
        self.root, self.name = root, name
        self.dir = root / name

    @property
    def handle(self) -> dict[str, Any]:
        return {"type": "sim", "root": str(self.root), "name": self.name}

    @property
    def workspace_path(self) -> str | None:
        return str(self.dir)

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        if not self.dir.exists():
            raise SandboxError(f"sim sandbox {self.name} is gone (destroyed or never created)")
        verb, *args = command.split()
        if verb == "sim-exec" and len(args) == 2:
            await asyncio.sleep(float(args[0]))
            return ExecResult(0, "o" * int(args[1]), duration_s=float(args[0]))
        if verb == "sim-grade" and len(args) == 2:
            await asyncio.sleep(float(args[0]))
            return ExecResult(
                0 if args[1] == "1" else 1,
                "PASSED" if args[1] == "1" else "FAILED",
                duration_s=float(args[0]),
            )
        return ExecResult(
            127, f"sim sandbox: unknown command {verb!r} (only sim-exec and sim-grade run here)"
        )

    def _path(self, path: str) -> Path:
        if os.path.isabs(path) or ".." in Path(path).parts:
            raise SandboxError(f"path {path!r} must be relative to the workspace and stay inside it")
        return self.dir / path

    async def read_file(self, path: str) -> str:
        return self._path(path).read_text()

    async def write_file(self, path: str, content: str) -> None:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)

    async def diff(self) -> str:
        return ""

    async def destroy(self) -> None:
        if self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
            _log_event(self.root, "destroy", self.name)


class SimSandboxProvider(SandboxProvider):
    """`sandbox.type: sim`. Creating a sandbox sleeps for the spec's planned start-up time."""

    def __init__(self, cfg: SandboxConfig):
        self.root = Path(cfg.root or Path(tempfile.gettempdir()) / "rollway-sim-sandboxes")
        self.root.mkdir(parents=True, exist_ok=True)

    async def create(self, spec: SandboxSpec, name: str) -> Sandbox:
        plan = json.loads(spec.files.get(SIM_SPEC_FILE, "{}"))
        _log_event(self.root, "create", name)
        sandbox = SimSandbox(self.root, name)
        sandbox.dir.mkdir(parents=True, exist_ok=True)
        await asyncio.sleep(float(plan.get("init_s", 0.0)))
        for path, content in spec.files.items():
            await sandbox.write_file(path, content)
        return sandbox

    async def attach(self, handle: dict[str, Any]) -> Sandbox:
        return SimSandbox(Path(handle["root"]), handle["name"])

    async def check(self) -> dict[str, Any]:
        return {"simulated": True, "network_isolated": False}


def live_sandbox_stats(root: Path, t0: float | None = None, t1: float | None = None) -> dict[str, float]:
    """Peak live sandboxes and sandbox-seconds from the events file (a sandbox is live from the start
    of its creation to its destruction; one never destroyed counts until t1 or the last event)."""
    path = Path(root) / EVENTS_FILE
    events = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    created = {e["name"]: e["t"] for e in events if e["event"] == "create"}
    destroyed = {e["name"]: e["t"] for e in events if e["event"] == "destroy"}
    end = t1 if t1 is not None else max((e["t"] for e in events), default=0.0)
    edges = sorted(
        [(t, 1) for t in created.values()] + [(destroyed.get(n, end), -1) for n in created],
        key=lambda x: (x[0], x[1]),
    )
    live = peak = 0
    for _, delta in edges:
        live += delta
        peak = max(peak, live)
    seconds = sum(destroyed.get(n, end) - t for n, t in created.items())
    return {
        "peak_live_sandboxes": peak,
        "sandboxes_created": len(created),
        "sandbox_seconds": seconds,
        "leaked": len(set(created) - set(destroyed)),
    }
