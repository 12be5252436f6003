"""A tool that takes as long as the model asks without running a command in the sandbox: it stands in for the
work a tool does on the host over what the agent made (a code search over a workspace it filled), which no
command time limit cuts. Tests name it in tools.enabled as python:tests/plugins/slow_tool.py:Ponder."""

from __future__ import annotations

import asyncio
from typing import Any

from rollway.tools.base import Tool, ToolContext, ToolResult


class Ponder(Tool):
    name = "ponder"
    description = "Think for `seconds` seconds."
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"],
                  "additionalProperties": False}

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = cfg

    async def call(self, arguments: dict[str, Any], sandbox: Any, context: ToolContext) -> ToolResult:
        await asyncio.sleep(float(arguments["seconds"]))
        return ToolResult("Done pondering.")
