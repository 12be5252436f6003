"""The editor tool on the real local (bubblewrap) sandbox, including undo across separate workers."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HiddenFolderSandbox

from rollway.sandboxes.base import Sandbox, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.local import LocalSandboxProvider, remove_tree
from rollway.tools.base import outside_episode
from rollway.tools.config import ToolsConfig
from rollway.tools.editor import EditorTool
from rollway.tools.registry import build_tools, run_tool_calls

SOURCE = {
    "pkg/__init__.py": "",
    "pkg/calc.py": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\nTOTAL = 0\n",
    "README.md": "one\ntwo\nthree\n",
}
EDITOR = EditorTool(ToolsConfig())


@pytest.fixture(scope="module")
def boxes_root() -> Iterator[str]:
    """Sandbox root directly under /tmp: the jail user must traverse its parents, and pytest's
    tmp_path parents are private to the host user."""
    root = tempfile.mkdtemp(prefix="rollway-tools-test-")
    yield root
    remove_tree(Path(root))


@pytest.fixture
def box(tmp_path: Path, boxes_root: str, request: pytest.FixtureRequest) -> Iterator[tuple[str, Sandbox]]:
    source = tmp_path / "src"
    for relative, content in SOURCE.items():
        (source / relative).parent.mkdir(parents=True, exist_ok=True)
        (source / relative).write_text(content)
    provider = LocalSandboxProvider(SandboxConfig(root=boxes_root))
    sandbox = asyncio.run(provider.create(SandboxSpec(source_dir=str(source)), request.node.name[:60]))
    yield boxes_root, sandbox
    asyncio.run(sandbox.destroy())


def edit(sandbox: Sandbox, **arguments: Any):
    return asyncio.run(EDITOR.call(arguments, sandbox, outside_episode()))


def test_view_file_ranges_and_folders(box) -> None:
    _, sandbox = box
    whole = edit(sandbox, command="view", path="pkg/calc.py")
    assert whole.content.startswith(
        "pkg/calc.py (lines 1-9 of 9):\n     1\tdef add(a, b):\n     2\t    return a + b"
    )
    part = edit(sandbox, command="view", path="pkg/calc.py", view_range=[5, 6])
    assert part.content.splitlines()[1:] == ["     5\tdef sub(a, b):", "     6\t    return a - b"]
    assert edit(sandbox, command="view", path="pkg/calc.py", view_range=[9, -1]).content.endswith(
        "     9\tTOTAL = 0"
    )
    bad = edit(sandbox, command="view", path="pkg/calc.py", view_range=[20, 30])
    assert bad.is_error and "has 9 lines" in bad.content
    edit(sandbox, command="insert", path="README.md", insert_line=0, new_str="zero")  # creates .rollway/
    listing = edit(sandbox, command="view", path=".").content
    assert "pkg/calc.py" in listing and "README.md" in listing and ".rollway" not in listing
    assert edit(sandbox, command="view", path="nope.py").is_error


def test_str_replace_needs_exactly_one_match(box) -> None:
    _, sandbox = box
    result = edit(
        sandbox, command="str_replace", path="pkg/calc.py", old_str="return a - b", new_str="return b - a"
    )
    assert not result.is_error and "     6\t    return b - a" in result.content
    assert "return b - a" in asyncio.run(sandbox.read_file("pkg/calc.py"))
    many = edit(sandbox, command="str_replace", path="pkg/calc.py", old_str="(a, b):", new_str="(x, y):")
    assert many.is_error and "occurs 2 times" in many.content and "lines 1, 5" in many.content
    none = edit(
        sandbox, command="str_replace", path="pkg/calc.py", old_str="def add(a,b):\n  return", new_str=""
    )
    assert none.is_error and "was not found" in none.content
    near = edit(
        sandbox, command="str_replace", path="pkg/calc.py", old_str="  TOTAL = 0", new_str="TOTAL = 1"
    )
    assert near.is_error and "line(s) 9" in near.content


def test_insert_create_and_undo_in_another_worker(box) -> None:
    root, sandbox = box
    edit(sandbox, command="insert", path="README.md", insert_line=1, new_str="one and a half")
    edit(sandbox, command="insert", path="README.md", insert_line=4, new_str="four")
    assert asyncio.run(sandbox.read_file("README.md")) == "one\none and a half\ntwo\nthree\nfour\n"
    assert edit(sandbox, command="insert", path="README.md", insert_line=9, new_str="x").is_error
    assert edit(sandbox, command="create", path="new/mod.py", file_text="X = 1\n").content.startswith(
        "Created"
    )
    # A later turn may run in another process: a fresh provider attaches by handle and undoes.
    other = asyncio.run(LocalSandboxProvider(SandboxConfig(root=root)).attach(sandbox.handle))
    assert "removed" in edit(other, command="undo_edit", path="new/mod.py").content
    assert not (Path(other.workspace_path) / "new/mod.py").exists()
    edit(other, command="undo_edit", path="README.md")
    assert asyncio.run(other.read_file("README.md")) == "one\none and a half\ntwo\nthree\n"
    edit(sandbox, command="undo_edit", path="README.md")
    assert asyncio.run(sandbox.read_file("README.md")) == SOURCE["README.md"]
    assert edit(sandbox, command="undo_edit", path="README.md").is_error


def test_paths(box) -> None:
    _, sandbox = box
    assert not edit(sandbox, command="view", path="/workspace/pkg/calc.py").is_error  # as `pwd` shows it
    assert not edit(sandbox, command="view", path="./pkg/../pkg/calc.py").is_error
    assert edit(sandbox, command="view", path="../../etc/passwd").is_error
    assert edit(sandbox, command="view", path="/etc/passwd").is_error
    assert edit(sandbox, command="view", path=".rollway/edit_history").is_error


def test_without_host_folder(box) -> None:
    _, real = box
    sandbox = HiddenFolderSandbox(real)
    assert "     2\ttwo" in edit(sandbox, command="view", path="README.md").content
    edit(sandbox, command="str_replace", path="README.md", old_str="two", new_str="2")
    assert "pkg/calc.py" in edit(sandbox, command="view", path="pkg").content
    edit(sandbox, command="undo_edit", path="README.md")
    assert asyncio.run(real.read_file("README.md")) == SOURCE["README.md"]


def test_through_run_tool_calls_and_diff(box) -> None:
    _, sandbox = box
    cfg = ToolsConfig()
    text = (
        '<tool_call>{"name": "editor", "arguments": {"command": "str_replace", "path": "pkg/calc.py", '
        '"old_str": "TOTAL = 0", "new_str": "TOTAL = 42"}}</tool_call>'
    )
    turn = asyncio.run(run_tool_calls(text, build_tools(["editor", "finish"], cfg), sandbox, cfg))
    assert turn.errors == 0 and turn.observations[0].arguments["new_str"] == "TOTAL = 42"
    diff = asyncio.run(sandbox.diff())
    assert "+TOTAL = 42" in diff


def test_diff_leaves_out_tool_state(box) -> None:
    _, sandbox = box
    edit(sandbox, command="insert", path="README.md", insert_line=0, new_str="zero")
    assert ".rollway" not in asyncio.run(sandbox.diff())
