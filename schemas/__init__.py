"""Typed, versioned messages for every topic, and their MessagePack codec."""

from rollway.schemas.codec import DecodeError, decode, encode
from rollway.schemas.messages import (
    SCHEMA_VERSION,
    AgentStep,
    DeadLetter,
    EpisodeFailure,
    InitRequest,
    Observation,
    PolicyVersion,
    RewardRequest,
    Trajectory,
    TurnRecord,
)

__all__ = [
    "SCHEMA_VERSION", "AgentStep", "DeadLetter", "DecodeError", "EpisodeFailure", "InitRequest",
    "Observation", "PolicyVersion", "RewardRequest", "Trajectory", "TurnRecord", "decode", "encode",
]
