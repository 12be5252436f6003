"""The pipeline, declared once: every stage, the actor that plays it, the topics it reads and writes,
how it deduplicates redelivered messages and which setting sets its concurrency. Stage lists, the
actor factory, start order, progress columns, chaos kinds and the docs' diagram derive from `STAGES`.

Adding a stage: one `Stage(...)` here, its actor class, and a test; nothing in the runtime or the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollway.topics import (
    AGENT_STEPS,
    EPISODE_FAILURES,
    INIT_REQUESTS,
    POLICY_VERSIONS,
    REWARD_REQUESTS,
    TRAJECTORIES,
    TopicSpec,
)

Dedup = Literal["tickets", "rebuild", "sandbox", "ledger", "trained-set"]
"""How a stage makes a redelivered or duplicated message harmless (docs/guarantees.md):
`tickets`: the scheduler ignores outcomes of attempts it already closed;
`rebuild`: the agent rebuilds the episode from the log and runs a turn only once per (episode, turn);
`sandbox`: init makes a fresh, uniquely named sandbox per delivery, and the agent keeps the first turn 0
  it sees (a duplicate's sandbox is torn down there);
`ledger`: a durable per-partition record of handled keys re-emits the first result (reward, sink);
`trained-set`: the learner's checkpointed window of trained episode ids."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage. `actor` is an import path, not a class: this layer sits below the actors."""

    name: str
    actor: str
    """`module:Class` of the actor; built with (services, log_reader) when `reads_log`, else (services)."""
    consumes: tuple[TopicSpec, ...]
    produces: tuple[TopicSpec, ...]
    """Topics `handle`, `tick` and `on_error` may return outputs to (the runtime adds dead letters)."""
    dedup: Dedup
    concurrency: str | None
    """Dotted config field holding messages handled at once per worker (None: one at a time)."""
    reads_log: Literal["no", "history", "stream"] = "no"
    """How it reads the log back: `history` gets a log reader (rebuilds from an offset), `stream` a
    scanner that streams its own inputs back on restart (runtime/scan.py); `no`: neither."""
    single: bool = False
    """Runs as exactly one process (its state is not partitioned)."""
    issues_work: bool = False
    """The stage that issues the run's work: it waits for the start gate (every other worker owns
    partitions) before its first issue, and its clean exit (code 0) is the end of the run, not a crash."""
    ranks_setting: str | None = None
    """Dotted config field that takes its worker count: N workers are one process leading N ranks
    (the sharded learner), not N consumers; rank processes after the first read no topic."""


STAGES: tuple[Stage, ...] = (
    Stage("scheduler", "rollway.actors.scheduler:SchedulerActor",
          consumes=(TRAJECTORIES, EPISODE_FAILURES, POLICY_VERSIONS, REWARD_REQUESTS),
          produces=(INIT_REQUESTS, EPISODE_FAILURES),
          dedup="tickets", concurrency=None, reads_log="stream", single=True, issues_work=True),
    Stage("init", "rollway.actors.init:InitActor", consumes=(INIT_REQUESTS,),
          produces=(AGENT_STEPS, EPISODE_FAILURES), dedup="sandbox", concurrency="init.concurrency"),
    Stage("agent", "rollway.actors.agent:AgentActor", consumes=(AGENT_STEPS,),
          produces=(AGENT_STEPS, REWARD_REQUESTS, EPISODE_FAILURES), dedup="rebuild",
          concurrency="agent.concurrency", reads_log="history"),
    Stage("reward", "rollway.actors.reward:RewardActor", consumes=(REWARD_REQUESTS,),
          produces=(TRAJECTORIES, EPISODE_FAILURES), dedup="ledger", concurrency="reward.concurrency"),
    Stage("learner", "rollway.actors.learner:LearnerActor", consumes=(TRAJECTORIES, EPISODE_FAILURES),
          produces=(POLICY_VERSIONS,), dedup="trained-set", concurrency=None, single=True,
          ranks_setting="learner.dist.ranks"),
    Stage("sink", "rollway.actors.sink:SinkActor", consumes=(TRAJECTORIES, EPISODE_FAILURES), produces=(),
          dedup="ledger", concurrency=None),
)
"""In flow order: the scheduler issues, the sink records last."""

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
BY_NAME = {s.name: s for s in STAGES}


def stage_of_actor(actor_class: type) -> Stage | None:
    """The stage whose `actor` is this class or one of its bases (None: not a pipeline actor)."""
    paths = {f"{c.__module__}:{c.__qualname__}": c for c in actor_class.__mro__}
    return next((s for s in STAGES if s.actor in paths), None)


def issuing_stage() -> Stage:
    """The one stage that issues the run's work (`issues_work`)."""
    return next(s for s in STAGES if s.issues_work)


def drain_stages() -> tuple[Stage, ...]:
    """The stages a run waits for after its last outcome: those whose outputs only the issuing stage
    reads, or nobody (the learner, the sink)."""
    return tuple(s for s in STAGES if not s.issues_work and all(r.issues_work for r in readers_of(s.produces)))


def get_stage(name: str) -> Stage:
    """The stage called `name`; the error lists the stages."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; stages are: {', '.join(STAGE_NAMES)}") from None


def start_order() -> tuple[str, ...]:
    """Consumers of later topics first, so every topic has its readers before anything writes to it:
    a stage starts once every stage that reads what it produces has started (the scheduler, which
    issues the work, last). Cycles through the scheduler's own inputs are broken at the scheduler."""
    order: list[str] = []
    pending = [s for s in STAGES if s.name != "scheduler"]
    while pending:
        ready = [s for s in pending
                 if all(r.name in order or r is s or r.name == "scheduler"
                        for r in readers_of(s.produces))]
        if not ready:  # a cycle among non-scheduler stages: keep flow order for the rest
            ready = pending[-1:]
        for s in reversed(ready):
            order.append(s.name)
            pending.remove(s)
    return (*order, "scheduler")


def readers_of(topics: tuple[TopicSpec, ...]) -> list[Stage]:
    """Stages that consume any of `topics`."""
    return [s for s in STAGES if set(topics) & set(s.consumes)]


def check_output(stage: str, topic: TopicSpec) -> None:
    """Refuse an output to a topic `stage` does not declare (a bug in the actor, not in the input).
    The runtime calls it for every output it produces (dead letters are its own); a stage that is not
    in the pipeline (a test's actor) declares nothing and is not checked."""
    declared = BY_NAME[stage].produces if stage in BY_NAME else None
    if declared is not None and topic not in declared:
        raise UndeclaredOutput(f"stage {stage!r} produced to {topic.name!r}, which topics/topology.py does "
                               f"not declare for it (declared: {', '.join(t.name for t in declared) or 'none'})")


class UndeclaredOutput(RuntimeError):
    """An actor returned an output to a topic its stage does not declare."""


DIAGRAM_START, DIAGRAM_END = "<!-- topology: generated by `rollway docs topology` -->", "<!-- /topology -->"


def text_diagram() -> str:
    """The stages in flow order: what each reads and writes, how it deduplicates, what sets its
    concurrency. The README and docs/concepts.md carry it between DIAGRAM_START and DIAGRAM_END."""
    width = max(len(s.name) for s in STAGES)
    lines = []
    for s in STAGES:
        reads = ", ".join(t.name for t in s.consumes)
        runs = s.concurrency or "1 at a time"
        lines += [f"{s.name.ljust(width)}  reads   {reads}",
                  f"{''.ljust(width)}  writes  {', '.join(t.name for t in s.produces) or '(run folder only)'}",
                  f"{''.ljust(width)}  dedup {s.dedup}; concurrency {runs}" + ("; one process" if s.single else "")]
    flow = ["scheduler -> init -> agent (one message per turn, loops on agent-steps) -> reward -> learner, sink",
            "agent --HTTP--> inference engine <--new weights-- learner --policy-versions--> scheduler"]
    return "\n".join([DIAGRAM_START, "```", *flow, "", *lines, "```", DIAGRAM_END])


def with_diagram(text: str) -> str:
    """`text` with its generated topology block replaced by the current one (ValueError: no block)."""
    start, end = text.find(DIAGRAM_START), text.find(DIAGRAM_END)
    if start < 0 or end < start:
        raise ValueError(f"no {DIAGRAM_START} ... {DIAGRAM_END} block")
    return text[:start] + text_diagram() + text[end + len(DIAGRAM_END):]


def mermaid() -> str:
    """The pipeline as a Mermaid flowchart (docs), drawn from the declaration."""
    lines = ["flowchart LR"]
    for s in STAGES:
        for t in s.produces:
            for r in readers_of((t,)):
                lines.append(f"    {s.name} -->|{t.name}| {r.name}")
    return "\n".join(lines)
