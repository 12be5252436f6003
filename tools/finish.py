"""The `finish` tool: the model declares its work done and the episode ends after this turn."""

from __future__ import annotations

from typing import Any

from rollway.sandboxes.base import Sandbox
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.config import ToolsConfig


class FinishTool(Tool):
    """Ends the episode; the reward actor then grades the workspace as it stands."""

    name = "finish"
    description = (
        "Call this when you are done: your changes in the workspace are final and will be graded. "
        "The episode ends after this turn."
    )
    parameters = {
        "type": "object",
        "properties": {
            "message": {"type": "string", "description": "Optional short summary of what you did."},
        },
        "required": [],
        "additionalProperties": False,
    }

    def __init__(self, cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg or ToolsConfig()

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        message = str(arguments.get("message") or "").strip()
        return ToolResult(
            content="Episode finished." + (f" Summary: {message}" if message else ""),
            ends_episode=True,
            metadata={"message": message},
        )
