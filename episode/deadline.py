"""When the agent phase of an episode ends: a task's agent time limit (Harbor's [agent] timeout_sec), or the
scheduler's deadline less the time kept for the sandbox's start and grading, whichever is shorter.

The clock starts when the episode's sandbox is ready (the turn-0 message's `ready_at`) and counts every
turn's model call and tool calls. Past it, the episode ends with stop reason `agent_timeout` and is
graded as it stands; a command still running at that moment is killed at the limit, and a model call or a
turn's tool calls still running are cancelled (actors/turn.py)."""

from __future__ import annotations

import time
from typing import Any

from rollway.sandboxes.base import ExecResult, Sandbox

AGENT_TIMEOUT = "agent_timeout"
"""The stop reason of an episode whose task's agent time ran out."""


def agent_deadline(task_metadata: dict[str, Any], ready_at: float, scheduled_time_s: float | None = None) -> float | None:
    """Wall-clock time the agent phase ends at: the task's `agent_timeout_s`, or `scheduled_time_s` (an
    episode the scheduler issued with a deadline: scheduler.agent_time_s), after `ready_at`, whichever comes
    first; None: no limit. The scheduler re-issues an attempt past its deadline as lost work, so the agent
    must not be able to outlast it; the time left of it is for the sandbox's start and the grading."""
    limits = [float(x) for x in (task_metadata.get("agent_timeout_s"), scheduled_time_s) if x]
    return float(ready_at or time.time()) + min(limits) if limits else None


class DeadlineSandbox:
    """The episode's sandbox as its tools see it: every command's time limit is cut to what is left of
    the agent's time (`default_timeout_s` is sandbox.exec_timeout_s, the limit of a command that names
    none); with nothing left, commands do not run. Everything else is the inner sandbox's."""

    def __init__(self, inner: Sandbox, deadline: float, default_timeout_s: float) -> None:
        self.inner, self.deadline, self.default_timeout_s = inner, deadline, default_timeout_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        left = self.deadline - time.time()
        if left <= 0.05:
            return ExecResult(exit_code=-1, output="[the task's agent time is up: command not run]\n", timed_out=True)
        return await self.inner.exec(command, min(timeout_s or self.default_timeout_s, left))
