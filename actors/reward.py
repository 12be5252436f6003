"""Reward actor: grade the finished episode in its sandbox, tear the sandbox down, emit the
token-exact trajectory."""

from __future__ import annotations

import time

import structlog

from rollway.actors.base import Actor, MessageMeta, Output, failure_output
from rollway.actors.services import Services
from rollway.schemas.messages import RewardRequest, Trajectory
from rollway.topics import REWARD_REQUESTS, TRAJECTORIES

log = structlog.get_logger()


def assemble(req: RewardRequest) -> dict:
    """Token ids, loss mask, logprobs and turn spans of the whole episode, from its turn deltas.
    Invariant: all per-token lists have the length of token_ids; mask 1 exactly on model tokens."""
    token_ids = list(req.prompt_ids)
    loss_mask = [0] * len(token_ids)
    logprobs: list[float | None] = [None] * len(token_ids)
    spans: list[tuple[int, int]] = []
    for t in req.turns:
        if len(t.logprobs) != len(t.completion_ids):
            raise ValueError(f"episode {req.episode_id} turn {t.turn}: {len(t.logprobs)} logprobs for "
                             f"{len(t.completion_ids)} tokens")
        start = len(token_ids)
        token_ids += t.completion_ids
        loss_mask += [1] * len(t.completion_ids)
        logprobs += t.logprobs
        spans.append((start, len(token_ids)))
        token_ids += t.observation_ids
        loss_mask += [0] * len(t.observation_ids)
        logprobs += [None] * len(t.observation_ids)
    return {"token_ids": token_ids, "loss_mask": loss_mask, "logprobs": logprobs, "turn_spans": spans}


class RewardActor(Actor):
    name = "reward"
    inputs = (REWARD_REQUESTS,)

    def __init__(self, services: Services):
        self.s = services
        self.graded: set[tuple[str, int]] = set()

    async def setup(self) -> None:
        _ = self.s.taskset, self.s.sandboxes

    async def handle(self, msg: RewardRequest, meta: MessageMeta) -> list[Output]:
        key = (msg.episode_id, msg.attempt)
        if key in self.graded:
            # A second copy of this attempt (redelivery after a crash): its sandbox, if it had its own,
            # would leak. destroy() is idempotent for the one already graded.
            await (await self.s.sandboxes.attach(msg.sandbox)).destroy()
            return []
        queue_s = max(0.0, time.time() - msg.sent_at) if msg.sent_at else 0.0
        t0, reward_start = time.perf_counter(), time.time()
        sandbox = await self.s.sandboxes.attach(msg.sandbox)
        try:
            grade = await self.s.taskset.grade(self.s.taskset.get(msg.task_id), sandbox, self.s.sandboxes)
        finally:
            await sandbox.destroy()
        timings = {**msg.timings, "reward_queue": queue_s, "reward": time.perf_counter() - t0}
        stamps = {**msg.stamps, "reward_start": reward_start, "reward_end": reward_start + timings["reward"]}
        traj = Trajectory(
            episode_id=msg.episode_id, group_id=msg.group_id, task_id=msg.task_id, attempt=msg.attempt,
            sample_index=msg.sample_index, **assemble(msg),
            turn_policy_versions=[t.policy_version for t in msg.turns], reward=grade.reward,
            resolved=grade.resolved, stop_reason=grade.stop_reason or msg.stop_reason,
            num_turns=len(msg.turns), prompt_length=len(msg.prompt_ids), grade=grade.details, timings=timings,
            turns=msg.turns, messages=msg.messages, template_drift_turns=sum(t.template_drift for t in msg.turns),
            created_at=time.time(), stamps=stamps)
        self.graded.add(key)
        log.info("episode graded", reward=grade.reward, resolved=grade.resolved, stop_reason=traj.stop_reason,
                 turns=traj.num_turns, task_id=msg.task_id)
        return [Output(TRAJECTORIES, msg.episode_id, traj)]

    def on_error(self, msg: RewardRequest, error: BaseException) -> list[Output]:
        return [failure_output(msg, self.name, error)]
