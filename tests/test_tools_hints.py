"""Hints: budget reminders, repeated calls, tool errors, each switchable."""

from __future__ import annotations

from rollway.episode.hints import HintEngine
from rollway.tools.base import ToolCall
from rollway.tools.config import HintsConfig

LS = ToolCall("bash", {"command": "ls"}, call_id="a")
LS_AGAIN = ToolCall("bash", {"command": "ls"}, call_id="b")


def hints(cfg: HintsConfig | None = None, **overrides) -> list[str]:
    args = dict(
        turn=0, max_turns=30, tokens_used=0, max_tokens=10_000, calls=[LS], previous_calls=[], errors=0
    )
    return HintEngine(cfg).hints(**(args | overrides))


def test_quiet_when_nothing_to_say() -> None:
    assert hints() == []


def test_turn_budget_reminder_counts_down() -> None:
    assert hints(turn=26) == []
    assert "2 turns left" in hints(turn=27)[0]
    assert "This is your last turn" in hints(turn=28)[0]
    assert hints(turn=29) == []  # no next turn to read it


def test_token_budget_reminder() -> None:
    [hint] = hints(tokens_used=9_500)
    assert "About 500 tokens" in hint
    assert hints(tokens_used=9_500, max_tokens=None) == []


def test_repeated_call_ignores_call_ids_and_accepts_pairs() -> None:
    [hint] = hints(calls=[LS_AGAIN], previous_calls=[LS])
    assert "repeated exactly the same tool call" in hint
    assert hints(calls=[("bash", {"command": "ls"})], previous_calls=[("bash", {"command": "ls"})])
    assert hints(calls=[LS], previous_calls=[ToolCall("bash", {"command": "ls -a"})]) == []
    assert hints(calls=[(None, {})], previous_calls=[(None, {})]) == []  # unparsable turns


def test_error_hint_and_switches() -> None:
    assert "failed" in hints(errors=1)[0]
    off = HintsConfig(budget_reminders=False, repeat_action=False, after_tool_error=False)
    assert hints(off, turn=28, errors=2, calls=[LS], previous_calls=[LS], tokens_used=9_999) == []


def test_the_turn_budget_reminder_names_finish_only_where_the_family_has_it() -> None:
    """A family without a `finish` tool (a simulated customer, a SQL family graded from its state) is not
    told to call a tool it does not have."""
    assert "call `finish`" in hints(turn=28, tools=["bash", "finish"])[0]
    [hint] = hints(turn=28, tools=["sql_query"])
    assert "This is your last turn" in hint and "finish" not in hint
