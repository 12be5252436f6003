"""Sink actor: writes each run's trajectories (deduplicated) and failures into the run folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rollway.actors.base import Actor, MessageMeta, Output
from rollway.actors.services import Services
from rollway.core.files import write_json_atomic
from rollway.schemas.codec import to_builtins
from rollway.schemas.messages import EpisodeFailure, Trajectory
from rollway.topics import EPISODE_FAILURES, TRAJECTORIES

STATUS_FILE = "sink-status.json"
TRAJECTORIES_FILE = "trajectories.jsonl"
FAILURES_FILE = "failures.jsonl"


def belongs_to_run(episode_id: str, run_id: str | None) -> bool:
    return run_id is None or episode_id.startswith(run_id + "-")


class SinkActor(Actor):
    """Appends one JSON line per distinct episode; a restarted sink reloads the ids it already wrote,
    so redelivered trajectories are never written twice."""

    name = "sink"
    inputs = (TRAJECTORIES, EPISODE_FAILURES)

    def __init__(self, services: Services):
        self.s = services
        self.run_id = services.cfg.run.id
        self.dir = Path(services.run_dir)
        self.written: set[str] = set()
        self.failures = 0

    async def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / TRAJECTORIES_FILE
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    self.written.add(json.loads(line)["episode_id"])
        self._write_status()

    async def handle(self, msg: Trajectory | EpisodeFailure, meta: MessageMeta) -> list[Output]:
        if not belongs_to_run(msg.episode_id, self.run_id):
            return []
        if isinstance(msg, EpisodeFailure):
            with open(self.dir / FAILURES_FILE, "a") as f:
                f.write(json.dumps(to_builtins(msg)) + "\n")
            self.failures += 1
        elif msg.episode_id not in self.written:
            with open(self.dir / TRAJECTORIES_FILE, "a") as f:
                f.write(json.dumps(to_builtins(msg)) + "\n")
            self.written.add(msg.episode_id)
        self._write_status()
        return []

    def _write_status(self) -> None:
        write_json_atomic(self.dir / STATUS_FILE, {"episodes_written": len(self.written),
                                                   "failures_seen": self.failures, "updated_at": time.time()})

    async def close(self) -> None:
        if self.s.cfg.sink.format == "parquet" and (self.dir / TRAJECTORIES_FILE).exists():
            export_parquet(self.dir / TRAJECTORIES_FILE, self.dir / "trajectories.parquet")


def export_parquet(jsonl: Path, out: Path) -> int:
    """The run's trajectories as Parquet in the documented trainer-facing columns (learning/EXPORT.md)."""
    import msgspec

    from rollway.learning.export import write_trajectories

    trajs = [msgspec.convert(json.loads(line), Trajectory) for line in jsonl.read_text().splitlines() if line]
    return write_trajectories(out, trajs)
