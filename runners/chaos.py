"""Chaos runs: kill and restart random stage workers (and optionally the broker) on a seeded
schedule while a job runs, then count lost and duplicated episodes."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rollway.runners.broker import EmbeddedBroker
from rollway.runners.up import Job, read_json

KILLABLE = ("init", "agent", "reward", "learner")


@dataclass
class ChaosMonkey:
    """Called on every tick of the job loop; kills one worker at each scheduled time."""

    seed: int
    min_gap_s: float = 1.0
    max_gap_s: float = 3.0
    broker: EmbeddedBroker | None = None
    broker_restarts: int = 0
    max_kills: int = 50
    events: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.started = time.monotonic()
        self.next_at = self.started + self.rng.uniform(self.min_gap_s, self.max_gap_s)
        self.broker_plan = sorted(self.rng.uniform(2.0, 8.0) for _ in range(self.broker_restarts))

    def __call__(self, job: Job) -> None:
        now = time.monotonic()
        if self.broker_plan and now - self.started >= self.broker_plan[0]:
            self.broker_plan.pop(0)
            self._restart_broker(now)
        if now < self.next_at or len(self.events) >= self.max_kills:
            return
        self.next_at = now + self.rng.uniform(self.min_gap_s, self.max_gap_s)
        stage = self.rng.choice(KILLABLE)
        live = [p for p in job.procs if p.stage == stage and p.alive]
        if not live:
            return
        victim = self.rng.choice(live)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        self.events.append({"t": round(now - self.started, 2), "kill": f"{stage}-{victim.index}"})

    def _restart_broker(self, now: float) -> None:
        if self.broker is None:
            return
        self.broker.stop()
        time.sleep(1.0)
        self.broker.start()
        self.events.append({"t": round(now - self.started, 2), "restart": "broker"})


def count_outcomes(run_dir: Path) -> dict:
    """Episode accounting from the run folder, independent of the stages' own deduplication:
    `lost` = scheduled but neither written as a trajectory nor recorded failed;
    `duplicated` = recorded more than once by the learner (trained on twice)."""
    sched = read_json(run_dir / "scheduler.json")
    written = [json.loads(line)["episode_id"] for line in _lines(run_dir / "trajectories.jsonl")]
    trained = Counter(json.loads(line)["episode_id"] for line in _lines(run_dir / "learner-records.jsonl"))
    failed = {f["episode_id"] for f in sched.get("failed", [])}
    planned = sched.get("episodes_scheduled", 0)
    ended = set(written) | failed
    return {"scheduled": planned, "completed": len(set(written)), "failed": len(failed),
            "lost": max(0, planned - len(ended)), "duplicated": sum(1 for c in trained.values() if c > 1),
            "written_twice": len(written) - len(set(written)), "trained": len(trained)}


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
