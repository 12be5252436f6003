"""Learner actor: the consumer of trajectories. Deduplicates by episode, hands each new one to the
trainer (or, with learner.type=record, only records it), publishes policy versions and tells the
inference engine to load them."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import structlog

from rollway.actors.base import Actor, MessageMeta, Output
from rollway.actors.services import Services
from rollway.actors.sink import belongs_to_run
from rollway.core.files import write_json_atomic
from rollway.schemas.messages import PolicyVersion, Trajectory
from rollway.topics import POLICY_VERSIONS, TRAJECTORIES

log = structlog.get_logger()

STATUS_FILE = "learner-status.json"
RECORD_FILE = "learner-records.jsonl"


class LearnerActor(Actor):
    name = "learner"
    inputs = (TRAJECTORIES,)

    def __init__(self, services: Services, trainer_factory=None):
        self.s = services
        self.dir = Path(services.run_dir)
        self.seen: set[str] = set()
        self.trainer = None
        self._trainer_factory = trainer_factory
        self._lock = asyncio.Lock()  # the trainer is not thread-safe; updates run one at a time
        self._where: dict[str, tuple[str, int, int]] = {}
        self._uncheckpointed: set[str] = set()
        self.version = 0
        self._announced = 0  # episodes_trained last published

    async def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / RECORD_FILE
        if path.exists():
            self.seen = {json.loads(line)["episode_id"] for line in path.read_text().splitlines() if line}
        if self.s.cfg.learner.trains:
            self.trainer = await asyncio.to_thread(self._build_trainer)
            self.version = self.trainer.state.version
            self._announced = self.trainer.state.episodes_trained
            if self.trainer.latest_checkpoint is not None:
                # Resumed: make sure the engine serves what the checkpoint holds.
                await self._sync_engine(self.trainer.latest_checkpoint, self.version)
        self._write_status()

    def _build_trainer(self):
        from rollway.learning.trainer import Trainer

        kwargs = {"model_factory": self._trainer_factory} if self._trainer_factory else {}
        return Trainer(self.s.cfg.learner, self.dir, group_size=self.s.cfg.scheduler.group_size, **kwargs)

    async def handle(self, msg: Trajectory, meta: MessageMeta) -> list[Output]:
        if not belongs_to_run(msg.episode_id, self.s.cfg.run.id) or msg.episode_id in self.seen:
            return []
        self._record(msg)
        if self.trainer is None:
            return []
        self._where[msg.episode_id] = (meta.topic, meta.partition, meta.offset)
        async with self._lock:
            self._write_status(training=True)  # `rollway up` waits for this before stopping the learner
            results = await asyncio.to_thread(self.trainer.add, msg)
        return await self._publish(results)

    async def tick(self) -> list[Output]:
        if self.trainer is None or self._lock.locked():
            return []
        async with self._lock:
            results = await asyncio.to_thread(self.trainer.tick)
        return await self._publish(results)

    def held_offsets(self) -> set[tuple[str, int, int]]:
        """Offsets the runtime must not commit past: episodes buffered or trained but not yet in a
        checkpoint. A restarted learner re-reads them; trained ones are skipped by id."""
        if self.trainer is None:
            return set()
        waiting = self.trainer.pending_episode_ids() | self._uncheckpointed
        return {self._where[e] for e in waiting if e in self._where}

    async def _publish(self, results) -> list[Output]:
        outputs = []
        trained = self.trainer.state.episodes_trained if self.trainer else 0
        if not results and trained > self._announced:
            # Consumed without a weight change (every group had equal rewards): same version, but
            # the scheduler must still see the learner's progress or it waits for it forever.
            outputs.append(Output(POLICY_VERSIONS, None, PolicyVersion(
                version=self.version, step=self.trainer.state.step, episodes_trained=trained,
                created_at=time.time())))
            self._announced = trained
        for r in results:
            self._announced = max(self._announced, r.episodes_trained)
            if r.checkpoint_path is None:
                self._uncheckpointed |= set(r.episode_ids)
            else:
                self._uncheckpointed.clear()
                await self._sync_engine(r.checkpoint_path, r.version)
            self.version = r.version
            log.info("policy updated", version=r.version, step=r.step, episodes=r.episodes_trained,
                     **{k: round(v, 4) for k, v in r.metrics.items() if k in ("reward_mean", "loss", "pass_rate")})
            outputs.append(Output(POLICY_VERSIONS, None, PolicyVersion(
                version=r.version, checkpoint=str(r.checkpoint_path) if r.checkpoint_path else None, step=r.step,
                episodes_trained=r.episodes_trained, created_at=time.time(),
                metrics={k: float(v) for k, v in r.metrics.items() if isinstance(v, int | float)})))
        self._write_status()
        return outputs

    async def _sync_engine(self, checkpoint: Path, version: int) -> None:
        """Ask the inference engine to serve the new weights (engines without weight loading, like
        the scripted policy, are skipped)."""
        load = getattr(self.s.inference, "load_weights", None)
        if load is not None:
            t0 = time.perf_counter()
            await load(str(checkpoint), version)
            # Agents in other processes label turns with the version the engine reports per response:
            # an engine that cannot report it would label every turn 0 and, with a lag bound, every
            # later episode would be dropped as stale without a word. Fail here instead.
            from rollway.policies.base import check_served_version

            await check_served_version(self.s.inference, version)
            log.info("inference engine loaded policy", version=version, checkpoint=str(checkpoint),
                     sync_s=round(time.perf_counter() - t0, 3))

    def _record(self, msg: Trajectory) -> None:
        record = {"episode_id": msg.episode_id, "group_id": msg.group_id, "task_id": msg.task_id,
                  "reward": msg.reward, "tokens": len(msg.token_ids), "model_tokens": sum(msg.loss_mask),
                  "policy_versions": msg.turn_policy_versions, "learner_version": self.version,
                  "received_at": time.time()}
        with open(self.dir / RECORD_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.seen.add(msg.episode_id)
        self._write_status()

    def _write_status(self, training: bool = False) -> None:
        write_json_atomic(self.dir / STATUS_FILE, {
            "episodes_received": len(self.seen), "policy_version": self.version, "training": training,
            "episodes_buffered": len(self.trainer.pending_episode_ids()) if self.trainer else 0,
            "updated_at": time.time()})

    async def close(self) -> None:
        # Buffered groups are not trained at shutdown: their offsets were held back, so the next
        # learner process reads them again.
        if self.trainer is not None:
            self.trainer.close()
