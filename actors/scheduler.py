"""Scheduler actor: issues n episodes per task (a group), tracks each with a deadline, re-issues lost
ones, and holds back new groups while the pipeline is full or the policy lag is too large.

Its state is rebuilt from the log after a restart: the plan is deterministic (seeded), what was
issued is on `init-requests`, what reached its grading on `reward-requests`, what ended is on
`trajectories` and `episode-failures` (where the scheduler also writes its own final verdict when it
gives an episode up)."""

from __future__ import annotations

import dataclasses
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from rollway.actors.scheduling import IssueStrategy, ends_order, johnson_order
from rollway.actors.services import Services
from rollway.base.faults import fault_point
from rollway.base.run_dir import RunDir
from rollway.runtime import metrics
from rollway.runtime.actor import Actor, MessageMeta, Output
from rollway.schemas.messages import (
    EpisodeFailure,
    EpisodeKey,
    EpisodeMessage,
    InitRequest,
    PolicyVersion,
    RewardRequest,
    Trajectory,
)
from rollway.topics import EPISODE_FAILURES, INIT_REQUESTS, POLICY_VERSIONS, REWARD_REQUESTS, TRAJECTORIES

log = structlog.get_logger()
__all__ = ["GIVE_UP_STAGE", "SchedulerActor", "Ticket", "ends_order", "johnson_order", "new_run_id"]

STATUS_FILE = RunDir.SCHEDULER_STATUS
GIVE_UP_STAGE = "scheduler"
"""EpisodeFailure.stage of the scheduler's own final verdict on an episode."""


@dataclass
class Ticket:
    """The scheduler's record of one episode."""

    episode_id: str
    group_id: str
    task_id: str
    sample_index: int
    attempt: int = 0
    issued_at: float = 0.0
    deadline: float = 0.0
    policy_version: int = 0
    state: str = "pending"  # pending -> inflight -> completed | failed
    reason: str = ""
    reward: float | None = None
    at_reward: bool = False
    """This attempt has left the agent stage (seen on reward-requests): its deadline is then its grading's."""

    @property
    def key(self) -> EpisodeKey:
        """The identity of this ticket's current attempt, as its messages carry it."""
        return EpisodeKey(episode_id=self.episode_id, group_id=self.group_id, task_id=self.task_id,
                          attempt=self.attempt, sample_index=self.sample_index)


class _AtReward(EpisodeMessage, forbid_unknown_fields=False):
    """A reward request read back for its episode alone (its turns are skipped, not decoded)."""


_REACHED_REWARD = dataclasses.replace(REWARD_REQUESTS, value=_AtReward)


def new_run_id() -> str:
    return "r" + uuid.uuid4().hex[:8]


class SchedulerActor(Actor):

    def __init__(self, services: Services, scan_log=None):
        self.s = services
        self._scan_log = scan_log
        """(topic spec) -> async iterator of its decoded messages from the start to the current end,
        raising when it cannot reach the end (runtime/scan.py; None: no rebuild)."""
        self.cfg = services.cfg.scheduler
        self.run_id = services.cfg.run.id or new_run_id()
        self.groups: list[list[Ticket]] = []
        self.next_group = 0
        self.tickets: dict[str, Ticket] = {}
        self.policy_version = 0
        self.learner_episodes = 0  # episodes the learner has consumed (trained or found no signal in)
        self._reasons_said: set[str] = set()
        """Give-up reasons already logged as errors (each is said once, not per episode)."""
        self.started_at = time.time()
        self.strategy = IssueStrategy(services.cfg)
        """Issue order, look-ahead and drain (actors/scheduling.py)."""
        self.pre_reward_bound = self.strategy.pre_reward_bound
        self._dirty = True
        self._repair = False
        self._gate = os.environ.get("ROLLWAY_START_GATE") or None
        """A file that must exist before the first issue (set by `rollway up`; None: issue at once)."""

    async def setup(self) -> None:
        tasks = self.s.taskset.tasks()
        if not tasks:
            raise ValueError("the task set is empty; check tasks.* in the config")
        rng = random.Random(self.s.cfg.run.seed)
        for _epoch in range(self.cfg.epochs):
            order = list(tasks)
            if self.cfg.shuffle:
                rng.shuffle(order)
            order = self.strategy.order(order[: self.cfg.num_tasks or len(order)])
            for task in order:
                gid = f"{self.run_id}-g{len(self.groups):05d}"
                self.groups.append([Ticket(f"{gid}-s{i}", gid, task.task_id, i) for i in range(self.cfg.group_size)])
        for group in self.groups:
            self.tickets.update({t.episode_id: t for t in group})
        self.tasks = {t.task_id: t for t in tasks}
        self._check_group_timeout()
        log.info("scheduler planned", run_id=self.run_id, groups=len(self.groups), episodes=len(self.tickets))
        if self._scan_log is not None:
            await self._rebuild()

    def _check_group_timeout(self) -> None:
        """Refuse a training learner's `group_timeout_s` shorter than an episode may take to be graded: its
        group would be trained without a member that is merely slow, and that member's 0 left out of the
        update (a policy can be slow on purpose, in its agent phase or by making its grading slow)."""
        learner = self.s.cfg.learner
        if learner.group_timeout_s is None or not learner.trains:
            return
        longest = self.cfg.agent_time_s + max(self._grading_s(task_id) for task_id in self.tasks)
        if learner.group_timeout_s < longest:
            raise ValueError(
                f"learner.group_timeout_s={learner.group_timeout_s:g} is shorter than an episode may take to be graded "
                f"(scheduler.episode_deadline_s={self.cfg.episode_deadline_s:g} plus the task set's longest grading "
                f"limit, {longest - self.cfg.episode_deadline_s:g}s): a group would be trained without a member that is "
                f"merely slow, leaving its 0 out (a policy can be slow on purpose). Set it to at least {longest:g}, or "
                "leave it unset (the scheduler re-issues lost episodes)")

    async def _rebuild(self) -> None:
        """Restore the tickets from what the log says this run's scheduler did and saw, one message
        at a time and one topic after the other (issues first, then outcomes): only each ticket's
        attempt, state and reward are kept, never the decoded trajectories. Failures other than the
        scheduler's own verdicts are left to the consumer: one whose offset was committed already
        led to a re-issue, which init-requests shows. A scan that cannot finish raises (the
        scanner's ScanIncomplete) instead of going on from part of the log."""
        self._check_retention(self._status_started_at(), "its scheduler status")
        group_index = {g[0].group_id: i for i, g in enumerate(self.groups)}
        earliest = None
        async for m in self._scan_log(INIT_REQUESTS):
            t = self.tickets.get(m.episode_id)
            if t is not None and (t.state == "pending" or m.attempt >= t.attempt):
                t.attempt, t.issued_at, t.deadline, t.state = m.attempt, m.issued_at, m.deadline, "inflight"
                self.next_group = max(self.next_group, group_index[m.group_id] + 1)
                earliest = m.issued_at if earliest is None else min(earliest, m.issued_at)
        self._check_retention(earliest, "its first episode on init-requests")
        async for m in self._scan_log(TRAJECTORIES):
            t = self.tickets.get(m.episode_id)
            if t is not None and t.state == "inflight":
                t.state, t.reward = "completed", m.reward
        async for m in self._scan_log(EPISODE_FAILURES):
            t = self.tickets.get(m.episode_id)
            if t is not None and m.stage == GIVE_UP_STAGE and t.state != "completed":
                t.state, t.reason = "failed", m.reason
        now = time.time()  # the episodes still in flight: when they reached grading is not on the record
        async for m in self._scan_log(_REACHED_REWARD):
            t = self.tickets.get(m.episode_id)
            if t is not None and t.state == "inflight" and m.attempt == t.attempt:
                self._reached_reward(t, now)
        async for m in self._scan_log(POLICY_VERSIONS):
            self.policy_version = max(self.policy_version, m.version)
            self.learner_episodes = max(self.learner_episodes, m.episodes_trained)
        self._repair = True
        if self.next_group:
            log.info("scheduler state rebuilt from the log", groups_issued=self.next_group, **self.counts())

    def _status_started_at(self) -> float | None:
        """When this run's scheduler first started, from its status file (None: another run's or none)."""
        status = RunDir(self.s.run_dir).scheduler()
        if status.get("run_id") != self.run_id or "started_at" not in status:
            return None
        self.started_at = min(self.started_at, float(status["started_at"]))
        return self.started_at

    def _check_retention(self, started_at: float | None, source: str) -> None:
        """Refuse to rebuild a run older than the topics' retention: the broker may have deleted its
        early groups' records, and a rebuild would then issue those groups again as new work (their
        episodes trained twice). Decided: fail loudly, never guess."""
        retention_s = INIT_REQUESTS.retention_ms / 1000
        if started_at is None or time.time() - started_at <= retention_s:
            return
        raise RuntimeError(
            f"run {self.run_id} started {(time.time() - started_at) / 86400:.1f} days ago ({source}), longer than "
            f"the topics' retention ({retention_s / 86400:.0f} days): the log may no longer hold its early groups, "
            "and rebuilding the scheduler from it would issue them again as new work. Start a new run (a new "
            "run.id) to go on; for runs longer than that, raise the retention of the topics (topics/) first")

    # -- inputs -----------------------------------------------------------------------------
    async def handle(self, msg: Trajectory | EpisodeFailure | PolicyVersion | RewardRequest,
                     meta: MessageMeta) -> list[Output]:
        if isinstance(msg, PolicyVersion):
            self.policy_version = max(self.policy_version, msg.version)
            self.learner_episodes = max(self.learner_episodes, msg.episodes_trained)
            return []
        ticket = self.tickets.get(msg.episode_id)
        if ticket is None or ticket.state != "inflight":
            return []  # another run's episode, or a late duplicate of a finished one
        if isinstance(msg, RewardRequest):
            if msg.attempt == ticket.attempt and not ticket.at_reward:
                sent = meta.timestamp_ms / 1000
                self._reached_reward(ticket, min(sent, time.time()) if sent > 0 else time.time())
            return []
        if isinstance(msg, Trajectory):
            ticket.state, ticket.reward = "completed", msg.reward
            self._dirty = True
            return []
        if msg.attempt != ticket.attempt:
            return []  # failure of an attempt that was already superseded
        if msg.retryable and ticket.attempt + 1 < self.cfg.max_attempts:
            log.warning("episode attempt failed, re-issuing", episode_id=ticket.episode_id,
                        attempt=ticket.attempt, stage=msg.stage, reason=msg.reason)
            return [self._issue(ticket, ticket.attempt + 1)]
        return [self._fail(ticket, f"{msg.stage}: {msg.reason}")]

    def _reached_reward(self, t: Ticket, at: float) -> None:
        """The attempt's agent phase is over and its grading begins: from here its deadline is its grading's,
        counted from `at`, never earlier than the episode's. A grading runs the agent's work, which can make
        it as slow as the grader's own limits (`TaskSet.grading_time_limit_s`), and the gradings already
        waiting for the reward stage go first: one cut by the episode's deadline would be re-issued and its
        0 never counted (the agent playing again for nothing, or escaping its 0 when the episode is finally
        recorded failed). So it gets its own grading's time plus its share of those ahead of it: with
        `reward.concurrency` gradings at once on the worker that has them all, it starts before they are
        done (each grading's time: its limits plus `grading_reserve_s` for its sandbox's start)."""
        ahead = sum(self._grading_s(u.task_id) for u in self.tickets.values() if u.at_reward and u.state == "inflight")
        t.at_reward, self._dirty = True, True
        t.deadline = max(t.deadline, at + self._grading_s(t.task_id) + ahead / self.s.cfg.reward.concurrency)

    def _grading_s(self, task_id: str) -> float:
        """The longest a grading of this task may take: its grading limits and the grading reserve."""
        task = self.tasks.get(task_id)
        return (self.s.taskset.grading_time_limit_s(task) if task is not None else 0.0) + self.cfg.reserve_s

    # -- issuing ----------------------------------------------------------------------------
    async def tick(self) -> list[Output]:
        if self._gate is not None and not os.path.exists(self._gate):
            return []  # `rollway up` has not seen every worker own partitions yet (RunDir.start_gate)
        now = time.time()
        outputs = []
        for t in self.tickets.values():
            if t.state == "inflight" and now > t.deadline:
                lost = "grading" if t.at_reward else "episode"
                if t.attempt + 1 < self.cfg.max_attempts:
                    log.warning(f"{lost} past its deadline, re-issuing", episode_id=t.episode_id, attempt=t.attempt)
                    outputs.append(self._issue(t, t.attempt + 1))
                elif t.at_reward:
                    outputs.append(self._fail(t, f"deadline: not graded within its grading's limits and "
                                                 f"scheduler.grading_reserve_s after {self.cfg.max_attempts} attempts"))
                else:
                    outputs.append(self._fail(t, f"deadline: not finished within {self.cfg.episode_deadline_s}s "
                                                 f"after {self.cfg.max_attempts} attempts"))
        if self._repair:  # members of issued groups still pending: the scheduler died while issuing
            outputs += [self._issue(t, 0) for g in self.groups[: self.next_group] for t in g if t.state == "pending"]
            self._repair = False
        while self.next_group < len(self.groups):
            inflight = [t for t in self.tickets.values() if t.state == "inflight"]
            if not self._room_for_group(inflight):
                break
            final = self._final_wave(inflight)
            outputs += [self._issue(t, 0, final) for t in self.groups[self.next_group]]
            self.next_group += 1
        if self._dirty or outputs:
            self._write_status()
        if outputs:
            fault_point("scheduler.after_issue")
        return outputs

    def _room_for_group(self, inflight: list[Ticket]) -> bool:
        if inflight and len(inflight) + self.cfg.group_size > self.cfg.max_inflight_episodes:
            return False
        if not self.strategy.lookahead_allows(inflight, self._final_wave(inflight)):
            return False
        if self.cfg.max_policy_lag is not None and inflight:
            oldest = min(t.policy_version for t in inflight)
            if self.policy_version - oldest > self.cfg.max_policy_lag:
                return False
        return self._within_update_budget()

    def _final_wave(self, inflight: list[Ticket]) -> bool:
        """scheduler.final_wave and everything not yet issued fits within max_inflight_episodes."""
        remaining = (len(self.groups) - self.next_group) * self.cfg.group_size
        return self.strategy.final_wave(len(inflight), remaining)

    def _within_update_budget(self) -> bool:
        """Rollouts may run at most max_policy_lag updates ahead of a training learner: issued
        episodes stay within (1 + max_policy_lag) updates' worth of what the learner has consumed.
        Counting consumed episodes, not versions, keeps this going when an update is skipped for
        lack of signal (all rewards in its groups equal)."""
        learner = self.s.cfg.learner
        if self.cfg.max_policy_lag is None or not learner.trains:
            return True
        per_update = learner.groups_per_step * (learner.group_size or self.cfg.group_size)
        issued = self.next_group * self.cfg.group_size
        allowed = self.learner_episodes + (1 + self.cfg.max_policy_lag) * per_update
        return issued + self.cfg.group_size <= allowed

    def _issue(self, t: Ticket, attempt: int, final_wave: bool = False) -> Output:
        now = time.time()
        t.attempt, t.issued_at, t.deadline = attempt, now, now + self.cfg.episode_deadline_s
        t.state, t.policy_version, t.at_reward = "inflight", self.policy_version, False
        self._dirty = True
        return Output(INIT_REQUESTS, t.episode_id, InitRequest(
            episode=t.key, issued_at=now, deadline=t.deadline, final_wave=final_wave))

    def _fail(self, t: Ticket, reason: str) -> Output:
        """Give the episode up; the verdict goes to episode-failures (the learner completes the
        episode's group without it, a restarted scheduler reads it back)."""
        if reason in self._reasons_said:  # a program that cannot work here fails every episode alike: said once
            log.info("episode failed for a reason already reported", episode_id=t.episode_id, attempt=t.attempt)
        else:
            self._reasons_said.add(reason)
            log.error("episode failed", episode_id=t.episode_id, attempt=t.attempt, reason=reason)
        t.state, t.reason = "failed", reason
        self._dirty = True
        return Output(EPISODE_FAILURES, t.episode_id, EpisodeFailure(
            episode=t.key, stage=GIVE_UP_STAGE, reason=reason, retryable=False, at=time.time()))

    # -- status -----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.next_group >= len(self.groups) and all(
            t.state in ("completed", "failed") for t in self.tickets.values())

    def counts(self) -> dict[str, int]:
        states = [t.state for t in self.tickets.values()]
        return {"episodes_planned": len(states),
                "episodes_scheduled": sum(s != "pending" for s in states),
                "episodes_inflight": states.count("inflight"),
                "episodes_completed": states.count("completed"),
                "episodes_failed": states.count("failed")}

    def _write_status(self) -> None:
        run_dir = Path(self.s.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        status = {"run_id": self.run_id, "done": self.done, **self.counts(), "started_at": self.started_at,
                  "retries": sum(t.attempt for t in self.tickets.values()),
                  "policy_version": self.policy_version, "elapsed_s": time.time() - self.started_at,
                  "failed": [asdict(t) for t in self.tickets.values() if t.state == "failed"]}
        RunDir(run_dir).write(STATUS_FILE, status, indent=1)
        self._dirty = False
        self._export_metrics(status)

    def _export_metrics(self, status: dict) -> None:
        states = [t.state for t in self.tickets.values()]
        for state in ("pending", "inflight", "completed", "failed"):
            metrics.EPISODES.labels("scheduler", state).set(states.count(state))
        metrics.EPISODE_RETRIES.labels("scheduler").set(status["retries"])
        metrics.MAX_INFLIGHT.labels("scheduler").set(self.cfg.max_inflight_episodes)
        inflight = [t.policy_version for t in self.tickets.values() if t.state == "inflight"]
        metrics.POLICY_LAG.labels("scheduler").set(self.policy_version - min(inflight) if inflight else 0)
        if self.cfg.max_policy_lag is not None:
            metrics.POLICY_LAG_BOUND.labels("scheduler").set(self.cfg.max_policy_lag)

    async def close(self) -> None:
        self._write_status()
        log.info("scheduler stopped", done=self.done, **self.counts())
