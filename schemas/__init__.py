"""Typed, versioned messages for every topic, and their MessagePack codec."""

from rollway.schemas.codec import DecodeError, check_version, decode, encode
from rollway.schemas.messages import (
    SCHEMA_VERSION,
    AgentStep,
    CapturedCall,
    DeadLetter,
    EpisodeFailure,
    EpisodeKey,
    EpisodeMessage,
    InitRequest,
    Observation,
    PolicyVersion,
    RewardRequest,
    Trajectory,
    TurnRecord,
)

__all__ = [
    "SCHEMA_VERSION", "AgentStep", "CapturedCall", "DeadLetter", "DecodeError", "EpisodeFailure", "EpisodeKey", "EpisodeMessage",
    "InitRequest", "Observation", "PolicyVersion", "RewardRequest", "Trajectory", "TurnRecord", "check_version",
    "decode", "encode",
]
