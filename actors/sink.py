"""Sink actor: writes each run's trajectories (deduplicated) and failures into the run folder."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from rollway.actors.ledger import Ledger
from rollway.actors.services import Services
from rollway.base.run_dir import FAILURES_FILE, TRAJECTORIES_FILE, RunDir, iter_jsonl
from rollway.runtime.actor import Actor, FatalActorError, MessageMeta, Output
from rollway.schemas.codec import check_version, to_builtins
from rollway.schemas.messages import EpisodeFailure, Trajectory

STATUS_FILE = RunDir.SINK_STATUS


def belongs_to_run(episode_id: str, run_id: str | None) -> bool:
    return run_id is None or episode_id.startswith(run_id + "-")


LEDGER_WINDOW = 16384
"""Episode ids (and failure keys) the sink's ledger keeps per input partition (actors/ledger.py):
memory stays bounded however long the run."""


class SinkActor(Actor):
    """Appends one JSON line per distinct episode (and per distinct failure). What it wrote is kept
    in a bounded, durable ledger in the run folder, so a restarted sink never writes a redelivered
    trajectory twice and memory does not grow with the run."""


    def __init__(self, services: Services):
        self.s = services
        self.run_id = services.cfg.run.id
        self.dir = Path(services.run_dir)
        self.ledger = Ledger(self.dir / "ledger" / "sink", LEDGER_WINDOW)
        self.written = 0
        self.failures = 0

    async def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in (TRAJECTORIES_FILE, FAILURES_FILE):
            drop_torn_tail(self.dir / name)  # its message was not recorded: it is redelivered and written whole
        self.written = count_lines(self.dir / TRAJECTORIES_FILE)
        self.failures = count_lines(self.dir / FAILURES_FILE)
        self._write_status()

    async def handle(self, msg: Trajectory | EpisodeFailure, meta: MessageMeta) -> list[Output]:
        if not belongs_to_run(msg.episode_id, self.run_id):
            return []
        failure = isinstance(msg, EpisodeFailure)
        key = f"failure/{msg.episode_id}/{msg.attempt}/{msg.stage}" if failure else msg.episode_id
        with self.ledger.handling(meta):
            if self.ledger.seen(key, meta) is not None:
                return []
            try:
                append_line(self.dir / (FAILURES_FILE if failure else TRAJECTORIES_FILE),
                            json.dumps(to_builtins(msg)))
                # Recorded right after the line is flushed: only a kill between the two repeats a line.
                self.ledger.record(key, meta)
            except OSError as err:
                # Not dead-lettered and committed (the episode would be lost from the run's record):
                # the worker stops, and its restart gets the message again once the disk is fixed.
                raise FatalActorError(f"the sink cannot write to {self.dir}: {err}; free space or fix the "
                                      "folder's permissions, then restart the sink") from err
        if failure:
            self.failures += 1
        else:
            self.written += 1
        self._write_status()
        return []

    def _write_status(self) -> None:
        RunDir(self.dir).write(STATUS_FILE, {"episodes_written": self.written,
                                                   "failures_seen": self.failures, "updated_at": time.time()})

    async def close(self) -> None:
        if self.s.cfg.sink.format == "parquet" and (self.dir / TRAJECTORIES_FILE).exists():
            export_parquet(self.dir / TRAJECTORIES_FILE, self.dir / "trajectories.parquet")


def export_parquet(jsonl: Path, out: Path) -> int:
    """The run's trajectories as Parquet in the documented trainer-facing columns (learning/EXPORT.md)."""
    import msgspec

    from rollway.learning.export import write_trajectories

    trajs = [msgspec.convert(check_version(row, f"{jsonl} episode {i}"), Trajectory)
             for i, row in enumerate(iter_jsonl(jsonl), 1)]
    return write_trajectories(out, trajs)


def drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (this sink's predecessor was killed while writing it)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another sink worker's append finishes first
        size = f.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:
            f.seek(max(0, keep - 65536))
            chunk = f.read(keep - max(0, keep - 65536))
            if b"\n" in chunk:
                keep = max(0, keep - 65536) + chunk.rfind(b"\n") + 1
                break
            keep = max(0, keep - 65536)
        if keep < size:
            f.truncate(keep)


def append_line(path: Path, line: str) -> None:
    """Append one whole line, flushed. A file whose last line a killed writer cut short gets a
    newline first, so the new line stays readable (readers skip the torn one: base/run_dir.py).
    Locked: sink workers of one run share the file."""
    with open(path, "ab+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(line.encode() + b"\n")


def count_lines(path: Path) -> int:
    """Lines in a file, read in chunks (a long run's trajectories do not fit in memory at once)."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
