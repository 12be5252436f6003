"""The `python` tool for coding tasks: run a snippet or a file with the sandbox's interpreter."""

from __future__ import annotations

from typing import Any

from rollway.sandboxes.base import Sandbox
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.config import ToolsConfig

SNIPPET_PATH = ".rollway/python/snippet.py"
"""Snippets are written under `.rollway/`, which is tool state, not part of the answer."""


class PythonTool(Tool):
    """Runs Python in the workspace root (which is on the import path, so `import solution` works)."""

    name = "python"
    description = (
        "Run Python code in the working directory and see stdout/stderr. Pass `code` (a snippet, e.g. "
        "'from solution import f; print(f(3))') or `path` (a .py file in the workspace). "
        "State does not persist between calls; print what you want to see."
    )
    parameters = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "Python source to run."},
            "path": {"type": "string", "description": "Workspace-relative .py file to run instead of code."},
        },
        "required": [],
        "additionalProperties": False,
    }

    def __init__(self, cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg or ToolsConfig()

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        code, path = arguments.get("code"), arguments.get("path")
        if bool(code) == bool(path):
            return ToolResult('Pass exactly one of "code" (source to run) or "path" (a .py file), '
                              'e.g. {"code": "print(1 + 1)"}.', is_error=True)
        if code:
            await sandbox.write_file(SNIPPET_PATH, str(code))
            path = SNIPPET_PATH
        if str(path).startswith("/") or ".." in str(path).split("/"):
            return ToolResult(f"path {path!r} must be relative to the workspace, e.g. solution.py", is_error=True)
        result = await sandbox.exec(f"PYTHONPATH=. python '{path}'", timeout_s=self.cfg.bash_timeout_s)
        return self._observation(result.output, result.exit_code, result.timed_out)

    def _observation(self, output: str, exit_code: int, timed_out: bool) -> ToolResult:
        limit = self.cfg.max_observation_chars
        text = output if len(output) <= limit else output[: limit // 2] + "\n[... output cut ...]\n" + output[-limit // 2 :]
        if timed_out:
            text += f"\n[timed out after {self.cfg.bash_timeout_s:.0f}s: look for an endless loop]"
        elif exit_code != 0:
            text += f"\n[exit code {exit_code}]"
        return ToolResult(text if text.strip() else "(no output)", is_error=timed_out or exit_code != 0,
                          metadata={"exit_code": exit_code, "timed_out": timed_out})


def _register() -> None:
    from rollway.tools.registry import register_tool

    register_tool("python", PythonTool)


_register()
