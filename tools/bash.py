"""The `bash` tool: run one shell command in the episode sandbox."""

from __future__ import annotations

from typing import Any

from rollway.sandboxes.base import Sandbox
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.config import ToolsConfig


class BashTool(Tool):
    """Runs a command with the configured time limit; output is already truncated by the sandbox."""

    name = "bash"
    description = (
        "Run a bash command in the repository root (non-interactive: no stdin, no editors or pagers). "
        "State does not persist between calls: chain with `cd dir && cmd`. "
        "Long outputs are cut, so narrow them with grep, head or tail."
    )
    parameters = {
        "type": "object",
        "properties": {"command": {"type": "string", "minLength": 1, "description": "The command to run."}},
        "required": ["command"],
        "additionalProperties": False,
    }

    def __init__(self, cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg or ToolsConfig()

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        command = arguments["command"]
        if not command.strip():
            return ToolResult(
                'The command is empty: pass a shell command, e.g. {"command": "ls"}.', is_error=True
            )
        result = await sandbox.exec(command, timeout_s=self.cfg.bash_timeout_s)
        output = result.output if result.output.strip() else "(no output)"
        metadata = {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "duration_s": result.duration_s,
            "truncated": result.truncated,
        }
        if result.timed_out:
            note = (
                f"The command timed out after {self.cfg.bash_timeout_s:g} s and was killed. "
                "Run something smaller (one test file, fewer iterations) or add your own limit."
            )
            # A timeout is a failed call; a nonzero exit code is not (grep without matches, a
            # failing test run are normal answers), so only timeouts set is_error.
            return ToolResult(
                f"{note}\nOutput before the timeout:\n{output}", is_error=True, metadata=metadata
            )
        return ToolResult(f"Exit code: {result.exit_code}\n{output}", metadata=metadata)
