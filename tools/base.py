"""The tool interface: OpenAI function-calling declarations with an async call in a sandbox."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollway.base.hooks import check_hook
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


@dataclass
class ToolContext:
    """What a tool call knows about its episode (the third argument of every `Tool.call`)."""

    task: Any
    """The episode's task (a `rollway.envs.base.Task`)."""
    episode_id: str
    attempt: int = 0
    turn: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    """The episode's state store: plain JSON-able data a tool (or the task set's hooks) keeps across
    turns. It travels in the episode's turn messages, so it survives a change of agent worker, and it
    reaches `TaskSet.grade` in the episode."""


class Tool(ABC):
    """A tool the model can call. State that must outlive one turn lives in the sandbox or in the
    episode's state store (`context.state`)."""

    config_class: ClassVar[type | None] = None
    """Your own pydantic config class (options under `tools.settings.<name>`); the tool is then built
    as `Tool(tools_config, options)`. None: built as `Tool(tools_config)`."""

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
    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        """Run the tool. Raise nothing for bad input: return ToolResult(is_error=True) saying how
        to call it correctly. `context`: the task, the episode id and the episode's state store (a tool
        that needs none of them still declares it: every tool is called with these three arguments)."""


CALL_SIGNATURE = "async def call(self, arguments, sandbox, context: ToolContext) -> ToolResult"


def check_tool(tool: Tool | type[Tool]) -> None:
    """Refuse a tool whose `call` is not `call(arguments, sandbox, context)` (HookSignatureError naming it)."""
    check_hook(tool, "call", ("arguments", "sandbox", "context"), CALL_SIGNATURE)


def outside_episode(task: Any = None) -> ToolContext:
    """The context of a call made outside a run's episode (a test, a replay without its episode)."""
    return ToolContext(task=task, episode_id="")
