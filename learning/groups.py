"""Buffering trajectories into complete GRPO groups; a step takes the complete groups that started
under the oldest policy first."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollway.schemas.messages import Trajectory


@dataclass
class _Group:
    first_seen: float
    episodes: dict[str, Trajectory] = field(default_factory=dict)
    abandoned: set[str] = field(default_factory=set)
    """Members the scheduler gave up on: they count towards completeness but have no trajectory."""

    @property
    def size(self) -> int:
        return len(self.episodes) + len(self.abandoned)

    @property
    def started_under(self) -> float:
        """The oldest policy version any member's turns ran under (inf: no turns yet)."""
        return min((min(t.turn_policy_versions) for t in self.episodes.values() if t.turn_policy_versions),
                   default=float("inf"))


class GroupBuffer:
    """Holds trajectories by `group_id` until `group_size` distinct episodes arrived.

    Duplicates of a buffered episode (at-least-once delivery, or a re-issued attempt that also
    finished) are ignored: the first arrival wins. A member the scheduler gave up on is `abandon`ed:
    it completes its group without a trajectory, so the group's other members still get trained."""

    def __init__(self, group_size: int, timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.clock = clock
        self._groups: dict[str, _Group] = {}
        self._complete: list[str] = []
        self.released_abandoned: list[str] = []
        """Abandoned ids of the groups popped since the caller last cleared this list."""

    def add(self, traj: Trajectory, now: float | None = None) -> bool:
        """Buffer `traj`; False when its episode is already buffered (or abandoned)."""
        group = self._group(traj.group_id, now)
        if traj.episode_id in group.episodes or traj.episode_id in group.abandoned:
            return False
        group.episodes[traj.episode_id] = traj
        self._check_complete(traj.group_id, group)
        return True

    def abandon(self, group_id: str, episode_id: str, now: float | None = None) -> bool:
        """Count `episode_id` as a member without trajectory; False when it is already buffered."""
        group = self._group(group_id, now)
        if episode_id in group.episodes or episode_id in group.abandoned:
            return False
        group.abandoned.add(episode_id)
        self._check_complete(group_id, group)
        return True

    def pause(self, seconds: float) -> None:
        """The reader was busy `seconds` (an update) and read nothing: members that came meanwhile wait
        in its inbox, so that time does not count towards any buffered group's timeout."""
        for group in self._groups.values():
            group.first_seen += seconds

    def _group(self, group_id: str, now: float | None) -> _Group:
        return self._groups.setdefault(group_id, _Group(self.clock() if now is None else now))

    def _check_complete(self, group_id: str, group: _Group) -> None:
        if group.size == self.group_size:
            self._complete.append(group_id)

    @property
    def complete_groups(self) -> int:
        return len(self._complete)

    def pending_episode_ids(self) -> set[str]:
        return {e for g in self._groups.values() for e in (*g.episodes, *g.abandoned)}

    def pop_complete(self, n: int) -> list[list[Trajectory]]:
        """`n` complete groups (each in sample order), or [] when fewer are complete: those that
        started under the oldest policy version first, in completion order among equals. Under a lag
        bound (`max_policy_lag`) the oldest are the next to go over it; taking a newer group first
        would leave an older one to be dropped later. Without weight updates this is completion order."""
        if len(self._complete) < n:
            return []
        ids = sorted(self._complete, key=lambda g: self._groups[g].started_under)[:n]  # stable: completion order
        self._complete = [g for g in self._complete if g not in ids]
        return [self._take(g) for g in ids]

    def pop_expired(self, now: float | None = None) -> list[list[Trajectory]]:
        """Incomplete groups older than the timeout, removed from the buffer."""
        if self.timeout_s is None:
            return []
        now = self.clock() if now is None else now
        old = [g for g, v in self._groups.items() if g not in self._complete and now - v.first_seen > self.timeout_s]
        return [self._take(g) for g in old]

    def _take(self, group_id: str) -> list[Trajectory]:
        group = self._groups.pop(group_id)
        self.released_abandoned += sorted(group.abandoned)
        return sorted(group.episodes.values(), key=lambda t: (t.sample_index, t.episode_id))
