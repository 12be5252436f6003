"""Side conversations: one-off calls an agent program makes beside its main conversation (a title, a
memory note), told apart by their system prompt. They are recorded and shown, but not trained (unless
configured), and they leave the episode's token stream as it was."""

from __future__ import annotations

from typing import Any, Literal

from rollway.base.config import StrictModel


class SideCallRule(StrictModel):
    """A call whose first system message starts with `system_prefix` is a side call named `name`."""

    name: str
    """Shown in `rollway show` and the report, recorded as `CapturedCall.side_call`."""
    system_prefix: str
    """The start of the side conversation's system prompt (leading whitespace ignored)."""


SHIPPED: dict[str, tuple[SideCallRule, ...]] = {
    "opencode": (SideCallRule(name="opencode-title", system_prefix="You are a title generator"),),
    "qwen-code": (
        SideCallRule(name="qwen-code-memory-extraction",
                     system_prefix="You are now acting as the managed memory extraction subagent"),
        SideCallRule(name="qwen-code-memory-dream", system_prefix="You are performing a managed memory dream"),
        SideCallRule(name="qwen-code-memory-select", system_prefix="You are selecting memories that will be useful"),
    ),
}
"""The side calls of the programs rollway documents (their system prompts as of opencode 1.18 and
Qwen Code 0.15.10)."""

Program = Literal["opencode", "qwen-code"]


def side_call_of(messages: list[dict[str, Any]], rules: tuple[SideCallRule, ...]) -> str | None:
    """The name of the rule the request matches (by its first system message), or None."""
    system = next((m for m in messages if m["role"] == "system"), None)
    if system is None:
        return None
    text = str(system.get("content") or "").lstrip()
    return next((r.name for r in rules if text.startswith(r.system_prefix)), None)
