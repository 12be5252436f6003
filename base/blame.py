"""Who a failure belongs to: the agent (graded 0 with its reason, trained on) or the infrastructure
(retried by the scheduler, dropped after `scheduler.max_attempts`). The one place that decides it; the
rule and the verdict per error are in docs/security/grading.md.

The rule: once agent-controlled code has run in a sandbox (a tool call executed, a harness program
started, the grader ran the code under test on the agent's changes), any failure there is the agent's.
Only a failure the agent could not cause is infrastructure: one found before its code ran, or one
observed from outside the sandbox (the sandbox engine unreachable, the sandbox gone, the broker down,
the inference engine unreachable, a turn replayed after a worker crash). Unknown errors after the agent
ran are the agent's: retrying what the agent can provoke lets a failing policy opt out of its zero."""

from __future__ import annotations

from typing import Literal

Blame = Literal["agent", "infrastructure"]

AGENT_FAILURE = "agent_failure"
"""Stop reason (and grade outcome) of an episode graded 0 because it failed after the agent's code ran."""


class InfrastructureFailure(RuntimeError):
    """A failure observed from outside the sandbox, which no agent can cause: retried."""

    infrastructure = True
    """The mark `blame` reads. Error classes of the layers above (the sandbox engine unreachable or the
    sandbox gone, the broker down, a call not recorded, an actor whose state cannot be trusted) carry the
    same class attribute, so this bottom layer names none of them."""


class InferenceUnreachable(InfrastructureFailure):
    """The inference engine could not be reached (no connection, a timeout, a 5xx after retries). A
    request the engine refused (4xx, e.g. a prompt too long) is not this: the agent's doing."""


def found_before_agent_code(error: BaseException) -> BaseException:
    """Mark `error` as found before any agent code ran where it happened (a grading sandbox that could
    not start, a test runner broken on the unpatched tree): infrastructure, whatever its type."""
    error.found_before_agent_code = True  # type: ignore[attr-defined]
    return error


def _chain(error: BaseException):
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def blame(error: BaseException, agent_ran: bool) -> Blame:
    """`agent` or `infrastructure` for `error`. `agent_ran`: agent-controlled code may have run in the
    sandbox where it happened (the caller knows: a turn was claimed, a program started, a grader ran on
    the agent's changes). Infrastructure: before the agent ran, or an error (or one it was raised from)
    of an infrastructure type or marked `found_before_agent_code`."""
    if not agent_ran:
        return "infrastructure"
    return "infrastructure" if any(_is_infrastructure(err) for err in _chain(error)) else "agent"


def _is_infrastructure(err: BaseException) -> bool:
    """One error of the chain: of a class marked `infrastructure = True`, or marked found before agent code."""
    return getattr(type(err), "infrastructure", False) is True or bool(getattr(err, "found_before_agent_code", False))


MAX_REASON_CHARS = 2000


def failure_reason(error: BaseException) -> str:
    """`Type: message`, cut (the text may quote hostile output)."""
    return f"{type(error).__name__}: {error}"[:MAX_REASON_CHARS]


def failure_details(error: BaseException, stage: str) -> dict[str, str]:
    """Grade details of an episode graded 0 by `blame`: the outcome, the failure's kind (its type, what
    the metrics count by) and its reason, and the stage it happened in."""
    from rollway.base.redaction import redact

    return {"outcome": AGENT_FAILURE, "failure_kind": type(error).__name__, "failure_stage": stage,
            "failure": redact(failure_reason(error))}


def graded_failures(trajs: list[dict]) -> dict[str, int]:
    """Episodes graded 0 because they failed after the agent's code ran (base/blame.py), by `stage: kind`
    (agent: HarnessCrashed, reward: SandboxError, ...). They are graded episodes (in episodes_completed
    and trajectories_written), not failed ones: `episodes_failed` counts only what the infrastructure lost."""
    counts: dict[str, int] = {}
    for t in trajs:
        grade = t.get("grade") or {}
        if grade.get("outcome") == AGENT_FAILURE:
            key = f"{grade.get('failure_stage', '?')}: {grade.get('failure_kind', '?')}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
