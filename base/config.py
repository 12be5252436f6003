"""The base of every config model (the lowest layer, so every package's config can use it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


class StrictModel(BaseModel):
    """Base for every config: unknown keys are an error, never silently ignored; assignments are
    validated like construction."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
