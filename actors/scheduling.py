"""How the scheduler issues work, behind one strategy interface: the order of an epoch's tasks, how far
sandbox starts may run ahead of the agents (look-ahead), and how the run drains (final wave). The
scheduler actor keeps the bookkeeping (tickets, deadlines, retries, the in-flight and policy-lag
bounds) and asks its `IssueStrategy` for these decisions."""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple, Protocol, TypeVar

from rollway.config.run import RunConfig

T = TypeVar("T")


class TaskCost(NamedTuple):
    """A task's expected cost, as the scheduler's issue order sees it."""

    init_s: float
    """Sandbox start, seconds."""
    grade_s: float
    """Grading, seconds."""


def task_cost(task: Any) -> TaskCost | None:
    """Expected sandbox-start and grading seconds of a task, for `scheduler.order` (johnson, ends): its
    metadata keys `expected_init_s` and `expected_grade_s` (a task builder writes them from its own timed
    runs of the task); None when either is missing."""
    init_s, grade_s = task.metadata.get("expected_init_s"), task.metadata.get("expected_grade_s")
    if init_s is None or grade_s is None:
        return None
    return TaskCost(float(init_s), float(grade_s))


def agent_worker_slots(cfg: RunConfig) -> int:
    """Turns one agent worker handles at once (the one place this is computed)."""
    return cfg.agent.concurrency + cfg.agent.tool_overlap


def agent_slots(cfg: RunConfig) -> int:
    """Turns the agent stage runs at once: `scheduler.agent_slots`, else one agent worker's."""
    return cfg.scheduler.agent_slots or agent_worker_slots(cfg)


class InflightEpisode(Protocol):
    at_reward: bool
    """This attempt has left the agent stage."""


class IssueStrategy:
    """The built-in strategy, from `scheduler.*`: `order` (given, johnson, ends), `init_lookahead`,
    `final_wave`. Subclass it to change one decision; the scheduler calls each method where it decides."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg.scheduler
        self.pre_reward_bound: int | None = (
            agent_slots(cfg) + self.cfg.init_lookahead if self.cfg.init_lookahead is not None else None)
        """Episodes issued but not yet at the reward stage that may exist at once (None: unbounded)."""

    def order(self, tasks: list[Any]) -> list[Any]:
        """One epoch's tasks in issue order (after the seeded shuffle and num_tasks)."""
        if self.cfg.order == "given":
            return list(tasks)
        costs = [task_cost(t) for t in tasks]
        if self.cfg.order == "johnson":
            return johnson_order(tasks, costs)
        size = self.cfg.group_size
        first_burst = min(self.cfg.max_inflight_episodes, self.pre_reward_bound or self.cfg.max_inflight_episodes)
        return ends_order(tasks, costs, head=-(-first_burst // size), tail=-(-self.cfg.max_inflight_episodes // size))

    def final_wave(self, inflight: int, remaining: int) -> bool:
        """`scheduler.final_wave` and everything not yet issued (`remaining` episodes) fits beside the
        `inflight` ones within max_inflight_episodes: issue it all now, marked as the drain."""
        return self.cfg.final_wave and inflight + remaining <= self.cfg.max_inflight_episodes

    def lookahead_allows(self, inflight: list[InflightEpisode], final_wave: bool) -> bool:
        """Whether one more group may start its sandboxes now under `init_lookahead` (the final wave
        is exempt: its sandboxes should be ready when agent slots free up)."""
        before_reward = sum(not t.at_reward for t in inflight)
        return (self.pre_reward_bound is None or final_wave or not before_reward
                or before_reward + self.cfg.group_size <= self.pre_reward_bound)


def _filled(costs: list[TaskCost | None]) -> list[TaskCost] | None:
    """The costs with unknown ones replaced by the median task's (None when none is known)."""
    known = [c for c in costs if c is not None]
    if not known:
        return None
    median = TaskCost(statistics.median(c.init_s for c in known), statistics.median(c.grade_s for c in known))
    return [c if c is not None else median for c in costs]


def johnson_order(items: list[T], costs: list[TaskCost | None]) -> list[T]:
    """Johnson's rule for a two-stage flow shop (stage 1 = sandbox start, stage 2 = grading, the agent
    turns in between): items whose first stage is no longer than their second, by first stage
    ascending, then the others. Johnson orders those by second stage descending (makespan-optimal for
    two machines); here they go by first + second stage descending, because the last sandboxes to
    start are no longer hidden behind agent work either. So the run starts with the fastest sandboxes
    and ends with the cheapest tasks. Items with no estimate take the median estimate; the sorts are
    stable, so ties keep the given order."""
    filled = _filled(costs)
    if filled is None:
        return list(items)
    total = [c.init_s + c.grade_s for c in filled]
    first = sorted((i for i, c in enumerate(filled) if c.init_s <= c.grade_s), key=lambda i: filled[i].init_s)
    second = sorted((i for i, c in enumerate(filled) if c.init_s > c.grade_s), key=lambda i: -total[i])
    return [items[i] for i in first + second]


def ends_order(items: list[T], costs: list[TaskCost | None], head: int, tail: int) -> list[T]:
    """Order only the ends of the run: the `head` items with the shortest sandbox start first,
    shortest first (they are issued at once and the agent slots wait for them); the `tail` items
    cheapest in start + grading last, dearest first (the final wave: its sandboxes must be ready when
    slots free up and its gradings end the run); everything between in the given order. Sorting the
    middle too (as Johnson's rule does) lines up the slow-starting sandboxes one after another, and a
    bounded init look-ahead cannot hide a run of them: in the benchmark the agent slots then starve
    mid-run. Items with no estimate take the median estimate; sorts are stable."""
    filled = _filled(costs)
    if filled is None:
        return list(items)
    total = [c.init_s + c.grade_s for c in filled]
    first = sorted(range(len(items)), key=lambda i: filled[i].init_s)[:head]
    taken = set(first)
    rest = [i for i in range(len(items)) if i not in taken]
    last = sorted(sorted(rest, key=lambda i: total[i])[:tail], key=lambda i: -total[i])
    taken |= set(last)
    middle = [i for i in rest if i not in taken]
    return [items[i] for i in first + middle + last]
