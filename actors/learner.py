"""Learner actor: the consumer of trajectories. Hands each trajectory to the trainer (or, with
learner.type=record, only records it), publishes policy versions and tells the inference engine to
load them.

Exactly once: an input's offset is held (not committed) until a checkpoint holds the update it was
part of; a restarted learner resumes from that checkpoint and re-reads everything after the committed
offsets, ignoring the episodes the checkpoint's dedup window already holds. A failed update ends the
worker (FatalActorError) instead of dead-lettering groups that have left the buffer."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import structlog

from rollway.actors.scheduler import GIVE_UP_STAGE
from rollway.actors.services import Services
from rollway.actors.sink import belongs_to_run
from rollway.base.faults import fault_point
from rollway.base.run_dir import RunDir
from rollway.runtime import metrics
from rollway.runtime.actor import Actor, FatalActorError, MessageMeta, Output
from rollway.schemas.messages import EpisodeFailure, PolicyVersion, Trajectory
from rollway.topics import POLICY_VERSIONS

log = structlog.get_logger()

STATUS_FILE = RunDir.LEARNER_STATUS
RECORD_FILE = "learner-records.jsonl"
"""One line per episode the learner accepted (analysis only; never read back for deduplication)."""

Where = tuple[str, int, int]


class LearnerActor(Actor):

    def __init__(self, services: Services, trainer_factory=None):
        self.s = services
        self.dir = Path(services.run_dir)
        self.seen: set[str] = set()
        """Record-only learners: episode ids recorded (training learners use the trainer's window)."""
        self.received = 0
        self.refused_sampling = 0
        """Trajectories not trained because a turn was sampled otherwise than the learner computes."""
        self.trainer = None
        self._trainer_factory = trainer_factory
        self._lock = asyncio.Lock()  # the trainer is not thread-safe; updates run one at a time
        self._where: dict[str, Where] = {}
        """Offset of each episode (or give-up notice) not yet durable in a checkpoint."""
        self._positions: dict[tuple[str, int], int] = {}
        """Per partition: one past the highest offset handled."""
        self.version = 0
        self._engine_version: int | None = None
        """The version this learner last loaded into the engine (None: unknown, e.g. after a restart)."""
        self._announced = 0  # episodes_trained last published
        self._last_input = time.monotonic()
        self.tracking = None
        """The experiment trackers (learning/tracking.py); None without `tracking.trackers`."""
        self._sync_s: float | None = None
        self._started = time.monotonic()

    async def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        from rollway.config.run import dump_config
        from rollway.learning.tracking import TrackingHub

        cfg = self.s.cfg
        self.tracking = TrackingHub.for_run(cfg.tracking, self.dir, cfg.run.name, cfg.run.id, dump_config(cfg))
        if self.s.cfg.learner.trains:
            self.trainer = await asyncio.to_thread(self._build_trainer)
            self.trainer.watermarks = self._watermarks
            self.version = self.trainer.state.version
            self._announced = self.trainer.state.episodes_trained
            if self.trainer.latest_checkpoint is not None:
                # Resumed: make sure the engine serves what the checkpoint holds.
                await self._sync_engine(self.trainer.latest_checkpoint, self.version)
        else:
            path = self.dir / RECORD_FILE
            if path.exists():
                self.seen = {json.loads(line)["episode_id"] for line in path.read_text().splitlines() if line}
            self.received = len(self.seen)
        self._write_status()

    def _build_trainer(self):
        from rollway.learning.registries import build_learner  # learner.type's Trainer (sharded when asked)

        return build_learner(self.s.cfg.learner, self.dir, group_size=self.s.cfg.scheduler.group_size,
                             model_factory=self._trainer_factory)

    async def handle(self, msg: Trajectory | EpisodeFailure, meta: MessageMeta) -> list[Output]:
        self._last_input = time.monotonic()
        key = (meta.topic, meta.partition)
        self._positions[key] = max(self._positions.get(key, 0), meta.offset + 1)
        if not belongs_to_run(msg.episode_id, self.s.cfg.run.id):
            return []
        if isinstance(msg, EpisodeFailure):
            if msg.stage != GIVE_UP_STAGE or self.trainer is None:
                return []  # a failed attempt the scheduler will re-issue
            return await self._train(msg.episode_id, meta, self.trainer.abandon, msg.group_id, msg.episode_id)
        if self.trainer is None:
            if msg.episode_id not in self.seen:
                self.seen.add(msg.episode_id)
                self.received += 1
                self._record(msg)
            return []
        if any(v < 0 for v in msg.turn_policy_versions):
            # NOT_TRAINABLE_VERSION: turns from a text-only endpoint (`policy.api: chat`) carry no
            # behaviour logprobs. Never trained; its group completes without it, as for a give-up.
            log.warning("trajectory not trainable (a turn from a text-only endpoint); its group trains "
                        "without it", episode_id=msg.episode_id, versions=msg.turn_policy_versions)
            return await self._train(msg.episode_id, meta, self.trainer.abandon, msg.group_id, msg.episode_id)
        mismatch = sampling_mismatch(msg, self.s.cfg.learner.temperature)
        if mismatch is not None:
            # The behaviour logprobs are of another distribution than the learner computes: every PPO
            # ratio would be off. Never trained; its group completes without it, as for a give-up.
            self.refused_sampling += 1
            log.warning(f"trajectory not trainable: {mismatch}; its group trains without it",
                        episode_id=msg.episode_id)
            return await self._train(msg.episode_id, meta, self.trainer.abandon, msg.group_id, msg.episode_id)
        fresh = not self.trainer.knows(msg.episode_id)
        if fresh and self.tracking is not None:
            self.tracking.episode(msg)  # before training: the update it completes counts it
        outputs = await self._train(msg.episode_id, meta, self.trainer.add, msg)
        if fresh:
            self._record(msg)
        return outputs

    async def _train(self, episode_id: str, meta: MessageMeta, call, *args) -> list[Output]:
        # All bookkeeping under the lock: a tick forgetting durable offsets between recording this
        # input's offset and buffering it would drop the record, and the offset would be committed.
        async with self._lock:
            self._where.setdefault(episode_id, (meta.topic, meta.partition, meta.offset))
            self._write_status(training=True)  # `rollway up` waits for this before stopping the learner
            try:
                results = await _uncancellable_thread(call, *args)
            except Exception as err:
                if self.trainer.broken is not None:
                    raise FatalActorError(f"training step failed: {err}") from err
                raise  # a bad message (e.g. unequal token arrays): dead-lettered, nothing else changed
            if results:
                fault_point("learner.after_update")
            outputs = await self._publish(results)
            self._forget_durable()
        return outputs

    async def tick(self) -> list[Output]:
        if self.trainer is None or self._lock.locked():
            return []
        async with self._lock:
            try:
                results = await _uncancellable_thread(self.trainer.tick)
            except Exception as err:
                raise FatalActorError(f"training step failed: {err}") from err
            outputs = await self._publish(results)
            idle = self.s.cfg.learner.checkpoint_idle_s
            if idle is not None and self.trainer.uncheckpointed_episode_ids() and \
                    time.monotonic() - self._last_input >= idle:
                outputs += await self._checkpoint_now()
            self._forget_durable()
        return outputs

    async def _checkpoint_now(self) -> list[Output]:
        """Save what the last updates changed (the stream went quiet); the engine loads it and the
        held offsets are released. Called with the lock held."""
        path = await _uncancellable_thread(self.trainer.save)
        if self.version != self._engine_version:
            # Only when the weights changed: a checkpoint that makes no-signal consumptions durable
            # holds the weights the engine already serves, and a reload pauses every replica.
            await self._sync_engine(path, self.version)
        state = self.trainer.state
        return [Output(POLICY_VERSIONS, None, PolicyVersion(
            version=state.version, checkpoint=str(path), step=state.step, episodes_trained=state.episodes_trained,
            created_at=time.time()))]

    def held_offsets(self) -> set[Where]:
        """Offsets the runtime must not commit past: episodes buffered, or consumed by an update no
        checkpoint holds yet. A restarted learner re-reads them; the durable ones it skips by id."""
        if self.trainer is None:
            return set()
        waiting = self._waiting()
        return {self._where[e] for e in waiting if e in self._where}

    def _waiting(self) -> set[str]:
        """Episodes whose effect no checkpoint holds yet: buffered, in the running update, or trained."""
        return self.trainer.pending_episode_ids() | self.trainer.uncheckpointed_episode_ids()

    def _forget_durable(self) -> None:
        waiting = self._waiting()
        for e in [e for e in self._where if e not in waiting]:
            del self._where[e]

    def _watermarks(self) -> dict[str, int]:
        """Per partition, the position below which every handled input is durable once the
        checkpoint being written lands: the lowest offset still pending, else one past the highest."""
        pending = self.trainer.pending_episode_ids()
        lowest: dict[tuple[str, int], int] = {}
        for e in pending:
            if e in self._where:
                t, p, o = self._where[e]
                lowest[(t, p)] = min(lowest.get((t, p), o), o)
        return {f"{t}:{p}": lowest.get((t, p), pos) for (t, p), pos in self._positions.items()}

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
            if r.checkpoint_path is not None:
                await self._sync_engine(r.checkpoint_path, r.version)
            self.version = r.version
            self._track(r)
            metrics.LEARNER_UPDATES.labels("learner").inc()
            if "train_seconds" in r.metrics:
                metrics.LEARNER_STEP_SECONDS.labels("learner").observe(float(r.metrics["train_seconds"]))
            log.info("policy updated", version=r.version, step=r.step, episodes=r.episodes_trained,
                     **{k: round(v, 4) for k, v in r.metrics.items() if k in ("reward_mean", "loss", "pass_rate")})
            outputs.append(Output(POLICY_VERSIONS, None, PolicyVersion(
                version=r.version, checkpoint=str(r.checkpoint_path) if r.checkpoint_path else None, step=r.step,
                episodes_trained=r.episodes_trained, created_at=time.time(),
                metrics={k: float(v) for k, v in r.metrics.items() if isinstance(v, int | float)})))
        self._write_status()
        return outputs

    def _track(self, r) -> None:
        """One update to the experiment trackers: the trainer's figures, plus version, episodes, sync time and the
        run's dead letters so far."""
        if self.tracking is None:
            return
        extra = {"policy_version": r.version, "episodes_trained": r.episodes_trained,
                 "episodes_per_second": r.episodes_trained / max(time.monotonic() - self._started, 1e-9),
                 "dead_letters": RunDir(self.dir).dead_letters()}
        if self._sync_s is not None:
            extra["weight_sync_seconds"] = self._sync_s
        self.tracking.update(r.step, {**r.metrics, **extra})

    async def _sync_engine(self, checkpoint: Path, version: int) -> None:
        """Ask the inference engine to serve the new weights (engines that do not declare
        `supports_weight_sync`, like the scripted policy, are skipped)."""
        if self.s.inference.supports_weight_sync:
            t0 = time.perf_counter()
            await self.s.inference.load_weights(str(checkpoint), version)
            # Agents in other processes label turns with the version the engine reports per response:
            # an engine that cannot report it would label every turn 0 and, with a lag bound, every
            # later episode would be dropped as stale without a word. Fail here instead.
            from rollway.policies.base import check_served_version

            await check_served_version(self.s.inference, version)
            self._engine_version = version
            self._sync_s = time.perf_counter() - t0
            metrics.WEIGHT_SYNC_SECONDS.labels("learner").observe(self._sync_s)
            if self.trainer is not None:  # no input was read while the engine loaded
                self.trainer.pause(time.perf_counter() - t0)
            log.info("inference engine loaded policy", version=version, checkpoint=str(checkpoint),
                     sync_s=round(time.perf_counter() - t0, 3))

    def _record(self, msg: Trajectory) -> None:
        record = {"episode_id": msg.episode_id, "group_id": msg.group_id, "task_id": msg.task_id,
                  "reward": msg.reward, "tokens": len(msg.token_ids), "model_tokens": sum(msg.loss_mask),
                  "policy_versions": msg.turn_policy_versions, "learner_version": self.version,
                  "received_at": time.time()}
        with open(self.dir / RECORD_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._write_status()

    def _episodes_received(self) -> int:
        if self.trainer is None:
            return self.received
        return self.trainer.state.episodes_trained + len(self.trainer.pending_episode_ids())

    def _write_status(self, training: bool = False) -> None:
        metrics.POLICY_VERSION.labels("learner").set(self.version)
        trained = self.trainer.state.episodes_trained if self.trainer else self.received
        metrics.EPISODES_TRAINED.labels("learner").set(trained)
        RunDir(self.dir).write(STATUS_FILE, {
            "episodes_received": self._episodes_received(), "policy_version": self.version, "training": training,
            "episodes_buffered": len(self.trainer.pending_episode_ids()) if self.trainer else 0,
            "episodes_refused_sampling": self.refused_sampling,
            "updated_at": time.time()})

    async def close(self) -> None:
        # Buffered groups are not trained at shutdown: their offsets were held back, so the next
        # learner process reads them again. Consumed but uncheckpointed work is saved now, so a
        # clean stop leaves every update it made durable.
        if self.trainer is not None:
            if self.trainer.uncheckpointed_episode_ids() and self.trainer.broken is None:
                async with self._lock:
                    path = await asyncio.to_thread(self.trainer.save)
                log.info("learner saved its last updates at shutdown", checkpoint=str(path))
            self.trainer.close()
        if self.tracking is not None:
            await asyncio.to_thread(self.tracking.close)


async def _uncancellable_thread(call, *args):
    """Run `call` in a thread; a cancellation (a revoked partition) waits for it to end before it
    propagates, so the actor's lock is never released while an update or a save still runs."""
    future = asyncio.ensure_future(asyncio.to_thread(call, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


SAMPLING_TOLERANCE = 1e-6


def sampling_mismatch(traj: Trajectory, temperature: float) -> str | None:
    """Why the learner cannot reproduce this trajectory's behaviour distribution (a turn sampled at
    another temperature than `learner.temperature`, or with top_p below 1, which the learner does not
    apply), or None. Turns that recorded no sampling were sampled at the configured one."""
    for turn in traj.turns:
        if turn.temperature is not None and abs(turn.temperature - temperature) > SAMPLING_TOLERANCE:
            return (f"turn {turn.turn} was sampled at temperature {turn.temperature}, the learner computes logprobs "
                    f"at learner.temperature={temperature}: set agent.harness.sampling=enforce (the gateway then "
                    "samples at agent.temperature), or make learner.temperature the program's")
        if turn.top_p is not None and turn.top_p < 1 - SAMPLING_TOLERANCE:
            return (f"turn {turn.turn} was sampled with top_p={turn.top_p}, which the learner does not apply: set "
                    "agent.harness.sampling=enforce with agent.top_p=1")
    return None
