"""Every topic declared once: name, value schema, key, partitions, retention."""

from __future__ import annotations

from dataclasses import dataclass

from rollway.schemas.messages import (
    AgentStep,
    CapturedCall,
    DeadLetter,
    EpisodeFailure,
    InitRequest,
    Message,
    PolicyVersion,
    RewardRequest,
    Trajectory,
)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    value: type[Message]
    keyed_by_episode: bool
    """True: the key is the episode id, so one episode's messages stay in one partition, in order."""
    partitions: int | None = None
    """Fixed partition count (None: from topics.partitions / topics.default_partitions)."""
    retention_ms: int = 7 * 24 * 3600 * 1000


INIT_REQUESTS = TopicSpec("init-requests", InitRequest, keyed_by_episode=True)
AGENT_STEPS = TopicSpec("agent-steps", AgentStep, keyed_by_episode=True)
REWARD_REQUESTS = TopicSpec("reward-requests", RewardRequest, keyed_by_episode=True)
TRAJECTORIES = TopicSpec("trajectories", Trajectory, keyed_by_episode=True)
EPISODE_FAILURES = TopicSpec("episode-failures", EpisodeFailure, keyed_by_episode=True)
POLICY_VERSIONS = TopicSpec("policy-versions", PolicyVersion, keyed_by_episode=False, partitions=1)
DEAD_LETTERS = TopicSpec("dead-letters", DeadLetter, keyed_by_episode=False)
GATEWAY_CALLS = TopicSpec("gateway-calls", CapturedCall, keyed_by_episode=True)
"""Every model call an external agent program made through the gateway (rollway.gateway)."""

ALL_TOPICS: tuple[TopicSpec, ...] = (
    INIT_REQUESTS, AGENT_STEPS, REWARD_REQUESTS, TRAJECTORIES, EPISODE_FAILURES, POLICY_VERSIONS,
    DEAD_LETTERS, GATEWAY_CALLS,
)
BY_NAME = {t.name: t for t in ALL_TOPICS}


def get_topic(name: str) -> TopicSpec:
    """The topic spec for a base name; the error lists the valid names."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown topic {name!r}; topics are: {', '.join(BY_NAME)}") from None
