"""The tool interface: OpenAI function-calling declarations with an async call in a sandbox."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rollway.sandboxes.base import Sandbox


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from model output."""

    name: str
    arguments: dict[str, Any]
    call_id: str | None = None


@dataclass
class ToolResult:
    """What a tool returns; `content` becomes the observation the model reads."""

    content: str
    is_error: bool = False
    """True when the call failed (bad arguments, command error); hints may react to it."""
    ends_episode: bool = False
    """True for `finish`: the agent stops after this turn."""
    metadata: dict[str, Any] = field(default_factory=dict)


class Tool(ABC):
    """A tool the model can call. State that must outlive one turn lives in the sandbox."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object schema)."""

    def spec(self) -> dict[str, Any]:
        """The OpenAI `tools` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @abstractmethod
    async def call(self, arguments: dict[str, Any], sandbox: Sandbox) -> ToolResult:
        """Run the tool. Raise nothing for bad input: return ToolResult(is_error=True) saying how
        to call it correctly."""
