"""The run folder's layout in one place: the status files the stages write and `rollway up`, the
progress display and the benchmarks read, per-worker status files, logs and outputs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from rollway.base.files import write_json_atomic

log = structlog.get_logger()

TRAJECTORIES_FILE = "trajectories.jsonl"
"""One JSON line per episode, appended by the sink (actors/sink.py)."""
FAILURES_FILE = "failures.jsonl"
"""One JSON line per distinct episode failure, appended by the sink."""


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSON-lines file the stages append to, read one line at a time. A line that
    does not parse (a writer killed half way through it) is skipped with a warning naming it, never
    a crash: one torn line must not make the whole run unreadable. Nothing when the file is absent."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                log.warning("torn line skipped (a writer was killed while writing it)", file=str(path),
                            line=number, length=len(line))
                continue
            if isinstance(row, dict):
                yield row
            else:
                log.warning("line skipped: not a JSON object", file=str(path), line=number)


def read_trajectories(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of `run_dir/trajectories.jsonl` as written (torn lines skipped), in file order: the one
    reader of run folders' trajectories. A row of another schema version is refused (DecodeError with
    what to do), never read as if it were this version."""
    return read_records(Path(run_dir) / TRAJECTORIES_FILE)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The message rows of a JSON-lines file (trajectories, eval outputs), schema version checked."""
    from rollway.schemas.codec import check_version

    return [check_version(row, f"{path} row {i}") for i, row in enumerate(iter_jsonl(path), 1)]


def fresh_run_folder(prefix: str, root: str | Path = "runs") -> Path:
    """A new folder `root/prefix-<date>-<time>`, created here: two commands started in the same
    second get `-2`, `-3`... instead of sharing one (they wrote over each other's plans)."""
    stem = Path(root) / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder name under {stem}")


class RunDir:
    """One run folder. Status is plain JSON written atomically (a reader never sees half a file) by
    the one worker that owns it: the scheduler, the sink, the learner, and each worker its own."""

    SCHEDULER_STATUS = "scheduler.json"
    """Episodes planned, scheduled, completed, failed; `done` once the scheduler has finished."""
    SINK_STATUS = "sink-status.json"
    """Episodes the sink has written."""
    LEARNER_STATUS = "learner-status.json"
    """The learner's version, steps and whether an update is running (`training`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self, name: str) -> dict[str, Any]:
        """A status file's content; {} when it does not exist yet (or is being replaced)."""
        try:
            return json.loads((self.path / name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def write(self, name: str, data: dict[str, Any], indent: int | None = None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / name, data, indent=indent)

    def scheduler(self) -> dict[str, Any]:
        return self.read(self.SCHEDULER_STATUS)

    def sink(self) -> dict[str, Any]:
        return self.read(self.SINK_STATUS)

    def learner(self) -> dict[str, Any]:
        return self.read(self.LEARNER_STATUS)

    @property
    def worker_status_dir(self) -> Path:
        return self.path / "status"

    def worker_status_path(self, stage: str, pid: int) -> Path:
        """Where one worker process writes its own status (partitions, messages handled)."""
        return self.worker_status_dir / f"{stage}-{pid}.json"

    def worker_status(self, stage: str, pid: int) -> dict[str, Any]:
        return self.read(str(self.worker_status_path(stage, pid).relative_to(self.path)))

    @property
    def start_gate(self) -> Path:
        """Created by `rollway up` once every worker it started owns partitions; a scheduler started with
        ROLLWAY_START_GATE naming it issues no episode before it exists (it plans and scans meanwhile)."""
        return self.worker_status_dir / "start-gate"

    @property
    def telemetry_dir(self) -> Path:
        return self.path / "telemetry"

    def telemetry_path(self, stage: str, pid: int) -> Path:
        """Where one worker process records every message it handled (runtime/telemetry.py)."""
        return self.telemetry_dir / f"{stage}-{pid}.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"
