"""Reward actor: grade the finished episode in its sandbox, tear the sandbox down, emit the
token-exact trajectory."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import structlog

from rollway.actors.ledger import Ledger
from rollway.actors.services import Services
from rollway.actors.sink import belongs_to_run
from rollway.base.blame import AGENT_FAILURE, failure_details
from rollway.base.faults import fault_point
from rollway.episode.stream import TokenStream, final_state, transcript
from rollway.runtime.actor import Actor, MessageMeta, Output, OutputRefused, failure_output
from rollway.sandboxes.base import SandboxError
from rollway.schemas.codec import decode, encode
from rollway.schemas.messages import RewardRequest, Trajectory
from rollway.topics import TRAJECTORIES

log = structlog.get_logger()

LEDGER_WINDOW = 1024
"""Graded attempts (with their trajectories) the reward ledger keeps per input partition; older
ones are known only by the partition's offset watermark (see actors/ledger.py)."""
MAX_KEPT_TEXT_CHARS = 2000
"""A turn's text kept in a trajectory cut to fit the broker (`refused_as_graded_0`)."""


def assemble(req: RewardRequest) -> dict:
    """Token ids, loss mask, logprobs and turn spans of the whole episode, from its turn deltas
    (TokenStream: the same code that built the agent's prompts)."""
    stream = TokenStream.of(req.prompt_ids, req.turns, req.episode_id)
    return {"token_ids": stream.token_ids, "loss_mask": stream.loss_mask, "logprobs": stream.logprobs,
            "turn_spans": stream.turn_spans, "segment_starts": stream.segment_starts}


def trajectory(msg: RewardRequest, grade) -> Trajectory:
    """The token-exact trajectory of `msg`, graded `grade`."""
    return Trajectory(
        episode=msg.episode, **assemble(msg),
        turn_policy_versions=[t.policy_version for t in msg.turns], reward=grade.reward,
        resolved=grade.resolved, stop_reason=grade.stop_reason or msg.stop_reason,
        num_turns=len(msg.turns), prompt_length=len(msg.prompt_ids), grade=grade.details,
        turns=msg.turns, messages=msg.messages, template_drift_turns=sum(t.template_drift for t in msg.turns),
        side_calls=msg.side_calls, created_at=time.time())


def refused_as_graded_0(msg: RewardRequest, refused: OutputRefused, stage: str) -> RewardRequest | None:
    """An output of an episode the agent ran in could not be produced (over `broker.max_message_bytes`, or
    unencodable: what the agent wrote made it so). Like any failure after the agent ran, it is the agent's
    (base/blame.py): `msg` graded 0 with the reason, cut so that its trajectory fits the broker: the free
    text (messages, observations, hook state) left out, then the last turns that do not fit (the last kept
    turn's observation tokens dropped: nothing was generated on them). None when not even its prompt fits."""
    from rollway.envs.base import Grade

    details = failure_details(refused, stage)
    turns = [msgspec.structs.replace(t, assistant_text=t.assistant_text[:MAX_KEPT_TEXT_CHARS], observations=[],
                                     hints=[], user_message=None, state=None, segment_messages=None)
             for t in msg.turns]

    def cut(kept: int) -> RewardRequest:
        last = [msgspec.structs.replace(t, observation_ids=[]) for t in turns[kept - 1:kept]]
        return msgspec.structs.replace(msg, messages=[], side_calls=[], turns=turns[:kept - len(last)] + last,
                                       stop_reason=AGENT_FAILURE, failure=details)

    def fits(kept: int) -> bool:
        req = cut(kept)
        return len(encode(trajectory(req, Grade(0.0, False, AGENT_FAILURE, details)))) + len(msg.episode_id) <= refused.room

    if not fits(0):
        return None
    low, high = 0, len(turns)  # the most turns that fit: fits(low) holds, fits(high + 1) does not
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return cut(low)


class RewardActor(Actor):
    """Grades each (episode, attempt) once. Idempotent across restarts: before the sandbox is torn
    down, the trajectory is recorded in a durable ledger in the run folder (actors/ledger.py); a
    redelivered or duplicated request finds it there and the same trajectory is emitted again (the
    first copy may never have reached the broker), instead of grading a sandbox that is gone."""


    def __init__(self, services: Services):
        self.s = services
        self.ledger = Ledger(Path(services.run_dir) / "ledger" / "reward", LEDGER_WINDOW)
        self.stats = {"graded": 0, "replayed": 0}

    async def setup(self) -> None:
        _ = self.s.taskset, self.s.sandboxes

    async def handle(self, msg: RewardRequest, meta: MessageMeta) -> list[Output]:
        if not belongs_to_run(msg.episode_id, self.s.cfg.run.id):
            return []  # another run's episode on shared topics: its own reward stage grades it
        try:
            with self.ledger.handling(meta):
                return await self._handle(msg, meta)
        except Exception:
            # Whatever failed (the ledger, grading, assembling, recording): the attempt is re-issued
            # in a fresh sandbox, so this one is never used again. A cancelled grading keeps it: the
            # request is redelivered and graded there (the run's reaper removes it if nothing does).
            await self._destroy_quietly(msg)
            raise

    async def _destroy_quietly(self, msg: RewardRequest) -> None:
        try:
            await (await self.s.sandboxes.attach(msg.sandbox)).destroy()
        except Exception as err:  # noqa: BLE001 - the grading's own error is the one to report
            log.warning("sandbox of a failed grading not destroyed; the run's reaper will", episode_id=msg.episode_id,
                        error=f"{type(err).__name__}: {err}")

    async def _handle(self, msg: RewardRequest, meta: MessageMeta) -> list[Output]:
        key = f"{msg.episode_id}/{msg.attempt}"
        seen = self.ledger.seen(key, meta)
        if seen is not None:
            return await self._replay(msg, seen.result)
        sandbox = await self.s.sandboxes.attach(msg.sandbox)
        traj = await self._graded(msg, sandbox)
        self.ledger.record(key, meta, encode(traj))  # before the teardown: a redelivery never finds it gone
        fault_point("reward.after_grade")
        await sandbox.destroy()
        self.stats["graded"] += 1
        log.info("episode graded", reward=traj.reward, resolved=traj.resolved, stop_reason=traj.stop_reason,
                 turns=traj.num_turns, task_id=msg.task_id)
        return [Output(TRAJECTORIES, msg.episode_id, traj)]

    async def _graded(self, msg: RewardRequest, sandbox) -> Trajectory:
        grade = await self._grade(msg, sandbox)
        if grade.details.get("outcome") == AGENT_FAILURE:
            log.warning("episode graded 0: it failed after the agent's code ran", episode_id=msg.episode_id,
                        stage=grade.details.get("failure_stage"), kind=grade.details.get("failure_kind"),
                        failure=str(grade.details.get("failure", ""))[:300])
        return trajectory(msg, grade)

    async def _grade(self, msg: RewardRequest, sandbox):
        from rollway.envs.base import Episode, Grade, grade_after_agent

        if msg.failure is not None:  # the agent stage's failure after the agent ran: 0, no grader run
            return Grade(0.0, False, stop_reason=AGENT_FAILURE, details=dict(msg.failure))
        task = self.s.taskset.get(msg.task_id)
        episode = Episode(episode_id=msg.episode_id, attempt=msg.attempt, task=task,
                          messages=transcript(msg.messages, msg.turns), turns=list(msg.turns),
                          state=final_state(msg.turns), stop_reason=msg.stop_reason)
        return await grade_after_agent(self.s.taskset, task, sandbox, self.s.sandboxes, episode)

    async def _replay(self, msg: RewardRequest, result: bytes | None) -> list[Output]:
        """A second copy of a graded attempt: tear its sandbox down (idempotent; a duplicate made by
        a re-run turn may have its own) and emit the recorded trajectory again. Downstream stages
        keep one trajectory per episode."""
        try:
            await (await self.s.sandboxes.attach(msg.sandbox)).destroy()
        except SandboxError:
            pass  # the graded copy's sandbox: already torn down
        self.stats["replayed"] += 1
        log.info("graded attempt redelivered; recorded trajectory emitted again", attempt=msg.attempt,
                 recorded=result is not None)
        if result is None:
            return []  # older than the ledger's window: long since produced and committed
        return [Output(TRAJECTORIES, msg.episode_id, decode(result, Trajectory))]

    def on_error(self, msg: RewardRequest, error: BaseException) -> list[Output]:
        if isinstance(error, OutputRefused) and isinstance(error.output and error.output.value, Trajectory):
            from rollway.envs.base import Grade

            request = refused_as_graded_0(msg, error, self.name)
            if request is not None:  # the grader ran on the agent's changes: a trajectory too large is its 0
                return [Output(TRAJECTORIES, msg.episode_id,
                               trajectory(request, Grade(0.0, False, AGENT_FAILURE, request.failure)))]
        return [failure_output(msg, self.name, error)]
