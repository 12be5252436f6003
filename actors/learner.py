"""Learner actor: the consumer of trajectories. Deduplicates by episode and hands each new one to
the trainer (or, with learner.type=record, only records it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import structlog
from rollway.actors.base import Actor, MessageMeta, Output
from rollway.actors.services import Services
from rollway.actors.sink import belongs_to_run
from rollway.schemas.messages import Trajectory
from rollway.topics import TRAJECTORIES

log = structlog.get_logger()

STATUS_FILE = "learner-status.json"
RECORD_FILE = "learner-records.jsonl"


class LearnerActor(Actor):
    name = "learner"
    inputs = (TRAJECTORIES,)

    def __init__(self, services: Services):
        self.s = services
        self.dir = Path(services.run_dir)
        self.seen: set[str] = set()

    async def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / RECORD_FILE
        if path.exists():
            self.seen = {json.loads(line)["episode_id"] for line in path.read_text().splitlines() if line}
        self._write_status()

    async def handle(self, msg: Trajectory, meta: MessageMeta) -> list[Output]:
        if not belongs_to_run(msg.episode_id, self.s.cfg.run.id) or msg.episode_id in self.seen:
            return []
        record = {"episode_id": msg.episode_id, "group_id": msg.group_id, "task_id": msg.task_id,
                  "reward": msg.reward, "tokens": len(msg.token_ids), "model_tokens": sum(msg.loss_mask),
                  "policy_versions": msg.turn_policy_versions, "received_at": time.time()}
        with open(self.dir / RECORD_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.seen.add(msg.episode_id)
        self._write_status()
        return []

    def _write_status(self) -> None:
        tmp = self.dir / (STATUS_FILE + ".tmp")
        tmp.write_text(json.dumps({"episodes_received": len(self.seen), "updated_at": time.time()}))
        tmp.replace(self.dir / STATUS_FILE)
