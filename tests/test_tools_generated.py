"""The built-in tools (bash, editor, search, finish) given generated arguments, as a model could write them:
valid calls with fields at any depth replaced by values of other types, deleted or repeated
(tests/generated.py), one or two to a turn. `run_tool_calls` promises never to raise for anything the model
does: every call must come back as an observation (an error one where the call was wrong), the sandbox still
answering afterwards. Real local (bubblewrap) sandbox; nothing faked."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from collections import Counter
from pathlib import Path

import generated

from rollway.sandboxes.base import SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.local import LocalSandboxProvider, remove_tree
from rollway.tools.config import ToolsConfig
from rollway.tools.registry import build_tools, run_tool_calls

CALLS = [
    {"name": "editor", "arguments": {"command": "view", "path": "pkg/calc.py", "view_range": [1, 3]}},
    {"name": "editor", "arguments": {"command": "str_replace", "path": "pkg/calc.py", "old_str": "a + b",
                                     "new_str": "b + a"}},
    {"name": "editor", "arguments": {"command": "create", "path": "new.py", "file_text": "x = 1\n"}},
    {"name": "editor", "arguments": {"command": "insert", "path": "README.md", "insert_line": 1, "new_str": "zz"}},
    {"name": "editor", "arguments": {"command": "undo_edit", "path": "README.md"}},
    {"name": "search", "arguments": {"action": "definition", "name": "add", "under": "pkg"}},
    {"name": "search", "arguments": {"action": "references", "name": "TOTAL"}},
    {"name": "search", "arguments": {"action": "outline", "under": "."}},
    {"name": "bash", "arguments": {"command": "ls -la", "timeout": 5}},
    {"name": "finish", "arguments": {"answer": "done"}},
]
KEYS = ["command", "path", "view_range", "old_str", "new_str", "name", "action", "under", "timeout", "answer"]
SOURCE = {"pkg/__init__.py": "", "pkg/calc.py": "def add(a, b):\n    return a + b\n\nTOTAL = 0\n", "README.md": "one\n"}


async def _play(seed: int, turns: int) -> Counter:
    root = tempfile.mkdtemp(prefix="rollway-tools-gen-")  # under /tmp: the jail user traverses its parents
    source = Path(root) / "src"
    for relative, text in SOURCE.items():
        (source / relative).parent.mkdir(parents=True, exist_ok=True)
        (source / relative).write_text(text)
    box = await LocalSandboxProvider(SandboxConfig(root=root)).create(SandboxSpec(source_dir=str(source)), "gen")
    cfg = ToolsConfig()
    tools = build_tools(["bash", "editor", "search", "finish"], cfg)
    rng = random.Random(seed)
    seen: Counter = Counter()
    try:
        for _ in range(turns):
            calls = [generated.mutated(rng.choice(CALLS), rng, keys=KEYS) for _ in range(rng.choice((1, 1, 2)))]
            wire = [{"id": f"c{i}", "type": "function", "function": {
                "name": call.get("name"), "arguments": json.dumps(call.get("arguments"), allow_nan=True)}}
                for i, call in enumerate(calls)]
            step = await run_tool_calls(wire, tools, box, cfg)
            assert step.observations, wire
            seen.update((o.tool if o.tool in tools else "other", o.is_error) for o in step.observations)
        assert (await box.exec("cat README.md")).exit_code == 0  # the sandbox still answers
    finally:
        await box.destroy()
        remove_tree(Path(root))
    return seen


def test_generated_tool_calls_become_observations():
    seen = asyncio.run(_play(seed=2026, turns=300))
    for tool in ("bash", "editor", "search", "finish"):  # every tool both ran and refused something
        assert seen[(tool, False)] >= 1 and seen[(tool, True)] >= 5, seen
