"""Tool and hint configuration (owned by the tools package)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rollway.base.config import StrictModel


class ToolsConfig(StrictModel):

    enabled: list[str] | None = None
    """Tools offered to the model in every episode: built-in or registered names (`bash`, `editor`,
    `search`, `finish`) or your own Tool subclasses as `python:MODULE:CLASS`. None: each task's own list
    (`TaskSet.environment(task, ...)`'s, by default the task set's `default_tools`)."""
    settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Options of tools that declare their own config class (`config_class`), keyed by tool name, e.g.
    {lookup: {max_rows: 5}}; validated by that class when the config loads (unknown keys fail)."""
    bash_timeout_s: float = Field(30.0, gt=0)
    """Wall-time limit of one bash call."""
    call_timeout_s: float = Field(300.0, gt=0)
    """Wall-time limit of any one tool call, built-in or your own (a bash call also stops at
    `bash_timeout_s`, which must be shorter). Host-side work (search parsing the workspace) runs on
    threads of its own with this deadline; a call past it ends with an error observation the model
    reads, and the episode goes on."""
    max_observation_chars: int = Field(4000, ge=100)
    """Observation text longer than this is cut with a visible notice."""
    max_calls_per_turn: int = Field(8, ge=1)
    """Tool calls run per model message; later ones get an error observation instead."""
    search_max_results: int = Field(20, ge=1)
    """Results `search` shows before its "... N more" notice."""
    search_max_files: int = Field(20_000, ge=1)
    """Source files `search` scans in one workspace; the rest is skipped with a notice."""

    @model_validator(mode="after")
    def _call_limit_above_bash(self) -> ToolsConfig:
        if self.call_timeout_s <= self.bash_timeout_s:
            raise ValueError(f"tools.call_timeout_s ({self.call_timeout_s:g}) must be longer than tools.bash_timeout_s "
                             f"({self.bash_timeout_s:g}): a bash call would otherwise end at the general limit")
        return self


class HintsConfig(StrictModel):

    budget_reminders: bool = True
    """Remind the model how many turns / tokens remain when few are left."""
    remind_when_turns_left: int = Field(2, ge=0)
    """Turn-budget reminder starts when this many turns remain."""
    repeat_action: bool = True
    """Hint when the model repeats the same tool call."""
    after_tool_error: bool = True
    """Hint after a tool call fails."""
    remind_when_tokens_left_fraction: float = Field(0.1, ge=0, le=1)
    """Token-budget reminder starts when less than this fraction of the token budget remains."""
