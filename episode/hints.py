"""Hints appended to a turn's observations: budget reminders, repeated calls, tool errors."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollway.tools.base import ToolCall
from rollway.tools.config import HintsConfig

CallLike = ToolCall | tuple[str | None, dict[str, Any]]
"""A call as the agent actor records it: a ToolCall or a (tool name, arguments) pair."""


class HintEngine:
    """Pure: the same inputs give the same hints, so the agent actor can record them per turn."""

    def __init__(self, cfg: HintsConfig | None = None) -> None:
        self.cfg = cfg or HintsConfig()

    def hints(
        self,
        turn: int,
        max_turns: int,
        tokens_used: int,
        max_tokens: int | None,
        calls: Sequence[CallLike],
        previous_calls: Sequence[CallLike],
        errors: int,
        tools: Sequence[str] = ("finish",),
    ) -> list[str]:
        """Hints for the observation of turn `turn` (0-based), read by the model in turn `turn + 1`.

        `tokens_used` / `max_tokens` is the episode's token budget (None: no budget); `errors` is
        how many of this turn's calls failed. Calls are `ToolCall`s or (name, arguments) pairs.
        `tools`: the names of the episode's tools (the last-turns reminder names `finish` only if
        there is one).
        """
        hints = []
        if self.cfg.after_tool_error and errors:
            hints.append(self._error_hint(errors))
        if self.cfg.repeat_action and _signature(calls) and _signature(calls) == _signature(previous_calls):
            hints.append(
                "You repeated exactly the same tool call as in your previous turn, and nothing "
                "else changed, so the result is the same. Try something different."
            )
        if self.cfg.budget_reminders:
            hints.extend(self._budget_hints(turn, max_turns, tokens_used, max_tokens, "finish" in tools))
        return hints

    def _error_hint(self, errors: int) -> str:
        which = "call" if errors == 1 else f"{errors} calls"
        return f"Your last tool {which} failed: read the error above and fix the call before going on."

    def _budget_hints(self, turn: int, max_turns: int, tokens_used: int, max_tokens: int | None,
                      can_finish: bool) -> list[str]:
        hints = []
        turns_left = max_turns - turn - 1
        if 0 < turns_left <= self.cfg.remind_when_turns_left:
            last = "This is your last turn" if turns_left == 1 else f"{turns_left} turns left"
            hints.append(f"{last}: make sure your change is in place" + (" and call `finish`." if can_finish else "."))
        if max_tokens and tokens_used < max_tokens:
            left = max_tokens - tokens_used
            if left < self.cfg.remind_when_tokens_left_fraction * max_tokens:
                hints.append(
                    f"About {left} tokens of your budget are left: keep messages short, and finish soon."
                )
        return hints


def _signature(calls: Sequence[CallLike]) -> Counter[str]:
    """Calls compared by name and arguments only (ids differ every turn), order ignored."""
    pairs = [(c.name, c.arguments) if isinstance(c, ToolCall) else (c[0], c[1]) for c in calls]
    # Unparsable calls (no name) are left out: two malformed turns are not a "repeated call".
    return Counter(
        f"{name}:{json.dumps(arguments, sort_keys=True, default=str)}" for name, arguments in pairs if name
    )
