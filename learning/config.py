"""Learner configuration (owned by the learning package)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["record"] = "record"
    """`record`: keep what arrives (no training)."""
