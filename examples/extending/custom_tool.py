"""A custom tool: count the words of a workspace file. Run: python examples/extending/custom_tool.py"""

import asyncio
from typing import Any

from rollway.envs.base import Task
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxSpec
from rollway.sandboxes.local import LocalSandboxProvider
from rollway.tools.base import Tool, ToolContext, ToolResult, outside_episode
from rollway.tools.config import ToolsConfig
from rollway.tools.registry import build_tools, register_tool, run_tool_calls


class WordCountTool(Tool):
    name = "word_count"
    description = "Count the words in a file of the workspace."
    parameters = {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "File path relative to the workspace root."}},
        "required": ["path"],
        "additionalProperties": False,
    }

    def __init__(self, cfg: ToolsConfig) -> None:
        self.cfg = cfg

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        try:
            text = await sandbox.read_file(arguments["path"])
        except SandboxError as err:  # bad input is an observation the model can learn from
            return ToolResult(f"Cannot read {arguments['path']!r}: {err}", is_error=True)
        return ToolResult(f"{len(text.split())} words")


# Registered at import: a run offers it when `tools.enabled` (or a task set's default_tools) names it.
register_tool("word_count", WordCountTool)


async def main() -> None:
    cfg = ToolsConfig()
    tools = build_tools(["word_count", "finish"], cfg)
    sandbox = await LocalSandboxProvider().create(SandboxSpec(files={"notes.txt": "one two three\n"}), "demo-tool")
    try:
        model_output = '<tool_call>{"name": "word_count", "arguments": {"path": "notes.txt"}}</tool_call>'
        # Outside a run, give the call the context a run would: its task (context.task) and a state store.
        context = outside_episode(Task("demo", "How many words are in notes.txt?"))
        turn = await run_tool_calls(model_output, tools, sandbox, cfg, context)
        print(turn.observations[0].content)
        assert turn.observations[0].content == "3 words"
    finally:
        await sandbox.destroy()


if __name__ == "__main__":
    asyncio.run(main())
