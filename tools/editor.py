"""The `editor` tool: view, create, str_replace, insert and undo edits of workspace files."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from typing import Any

from rollway.sandboxes.base import Sandbox
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.config import ToolsConfig
from rollway.tools.paths import PRIVATE_DIR, PathError, resolve_workspace_path

HISTORY_DIR = f"{PRIVATE_DIR}/edit_history"
"""Undo history lives in the workspace (a later turn may run in another worker); the sandbox diff
must exclude `.rollway/`."""
MAX_UNDO_STEPS = 20
SNIPPET_CONTEXT = 4
MAX_LINE = 2**31 - 1
"""Largest line number a call may name (the schema's bound: no file has more lines, and a larger
integer, up to beyond 2**64, used to reach the agent's message encoding)."""


class EditorTool(Tool):
    """File viewer and editor; every path is relative to the workspace root."""

    name = "editor"
    description = (
        "View and edit files. Paths are relative to the repository root.\n"
        "- view: show a file with line numbers (optionally view_range [start, end], end -1 = to the end), "
        "or list a directory.\n"
        "- create: write file_text to a new file (replaces an existing one).\n"
        "- str_replace: replace old_str, which must occur exactly once, by new_str. Include enough "
        "surrounding lines to make it unique; whitespace must match exactly.\n"
        "- insert: insert new_str after line insert_line (0 = at the top).\n"
        "- undo_edit: revert the last edit of the file."
    )
    parameters = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": {
                "type": "string",
                "minLength": 1,
                "description": "File or directory, relative to the root.",
            },
            "file_text": {"type": "string", "description": "Content of the new file (create)."},
            "old_str": {"type": "string", "description": "Exact text to replace (str_replace)."},
            "new_str": {
                "type": "string",
                "description": "Replacement (str_replace) or text to insert (insert).",
            },
            "insert_line": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_LINE,
                "description": "Insert after this line (insert).",
            },
            "view_range": {
                "type": "array",
                "items": {"type": "integer", "minimum": -1, "maximum": MAX_LINE},
                "minItems": 2,
                "maxItems": 2,
                "description": "[start, end] lines to view, 1-based inclusive; end -1 means to the end.",
            },
        },
        "required": ["command", "path"],
        "additionalProperties": False,
    }

    def __init__(self, cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg or ToolsConfig()

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        try:
            path = await resolve_workspace_path(arguments["path"], sandbox)
        except PathError as error:
            return _error(str(error))
        handler = {
            "view": self._view,
            "create": self._create,
            "str_replace": self._str_replace,
            "insert": self._insert,
            "undo_edit": self._undo,
        }[arguments["command"]]
        return await handler(path, arguments, sandbox)

    async def _view(self, path: str, arguments: dict[str, Any], sandbox: Sandbox) -> ToolResult:
        kind = await _path_kind(path, sandbox)
        if kind == "missing":
            return _error(f'{path} does not exist. List a folder with view on it, e.g. path ".".')
        if kind == "special":
            return _not_regular(path)
        if kind == "dir":
            return await _list_dir(path, sandbox)
        content = await sandbox.read_file(path)
        lines = _lines(content)
        start, end = 1, len(lines)
        if "view_range" in arguments:
            start, end = (int(v) for v in arguments["view_range"])
            end = len(lines) if end == -1 else end
            if not (1 <= start <= max(len(lines), 1)) or end < start:
                return _error(
                    f"view_range {arguments['view_range']} is outside {path}, which has "
                    f"{len(lines)} lines: use 1 <= start <= {len(lines)} and end >= start or -1."
                )
            end = min(end, len(lines))
        header = f"{path} (lines {start}-{end} of {len(lines)}):" if lines else f"{path} is empty."
        return ToolResult(header + "\n" + _numbered(lines[start - 1 : end], start))

    async def _create(self, path: str, arguments: dict[str, Any], sandbox: Sandbox) -> ToolResult:
        if "file_text" not in arguments:
            return _error(
                'create needs file_text, e.g. {"command": "create", "path": "a.py", "file_text": "..."}'
            )
        kind = await _path_kind(path, sandbox)
        if kind == "dir":
            return _error(f"{path} is a directory; give a file path.")
        if kind == "special":
            return _not_regular(path)
        previous = await sandbox.read_file(path) if kind == "file" else None
        await _push_history(sandbox, path, previous)
        await sandbox.write_file(path, arguments["file_text"])
        verb = "Overwrote" if previous is not None else "Created"
        return ToolResult(f"{verb} {path} ({len(_lines(arguments['file_text']))} lines).")

    async def _str_replace(self, path: str, arguments: dict[str, Any], sandbox: Sandbox) -> ToolResult:
        old, new = arguments.get("old_str"), arguments.get("new_str", "")
        if not old:
            return _error("str_replace needs a non-empty old_str (the exact text to replace) and new_str.")
        content = await _read_existing(path, sandbox)
        if isinstance(content, ToolResult):
            return content
        positions = _find_all(content, old)
        if len(positions) != 1:
            return _error(_match_problem(path, content, old, positions))
        updated = content[: positions[0]] + new + content[positions[0] + len(old) :]
        await _push_history(sandbox, path, content)
        await sandbox.write_file(path, updated)
        first = content.count("\n", 0, positions[0]) + 1
        return _edited(path, updated, first, first + new.count("\n"))

    async def _insert(self, path: str, arguments: dict[str, Any], sandbox: Sandbox) -> ToolResult:
        if "insert_line" not in arguments or "new_str" not in arguments:
            return _error(
                'insert needs insert_line and new_str, e.g. {"command": "insert", "path": "a.py", '
                '"insert_line": 3, "new_str": "x = 1"}'
            )
        content = await _read_existing(path, sandbox)
        if isinstance(content, ToolResult):
            return content
        lines, after = _lines(content), int(arguments["insert_line"])
        if after > len(lines):
            return _error(
                f"insert_line {after} is past the end of {path} ({len(lines)} lines); use 0..{len(lines)}."
            )
        new_lines = _lines(arguments["new_str"]) or [""]
        updated_lines = lines[:after] + new_lines + lines[after:]
        updated = "\n".join(updated_lines) + ("\n" if content.endswith("\n") or not content else "")
        await _push_history(sandbox, path, content)
        await sandbox.write_file(path, updated)
        return _edited(path, updated, after + 1, after + len(new_lines))

    async def _undo(self, path: str, arguments: dict[str, Any], sandbox: Sandbox) -> ToolResult:
        previous = await _pop_history(sandbox, path)
        if previous is False:
            return _error(f"No edit of {path} to undo.")
        if previous is None:
            await sandbox.exec(f"rm -f -- {shlex.quote(path)}")
            return ToolResult(f"Undid the creation of {path}: the file is removed.")
        await sandbox.write_file(path, previous)
        return ToolResult(
            f"Undid the last edit of {path}. It now reads:\n"
            + _numbered(_lines(previous)[:40], 1)
            + ("\n..." if len(_lines(previous)) > 40 else "")
        )


def _error(message: str) -> ToolResult:
    return ToolResult(message, is_error=True)


async def _path_kind(path: str, sandbox: Sandbox) -> str:
    """'file', 'dir', 'special' (a FIFO, socket, device or broken link) or 'missing'; reads the host
    folder directly when the sandbox has one (stat only: nothing is opened)."""
    if sandbox.workspace_path:
        full = os.path.join(sandbox.workspace_path, path)
        if os.path.isdir(full) or os.path.isfile(full):
            return "dir" if os.path.isdir(full) else "file"
        return "special" if os.path.lexists(full) else "missing"
    quoted = shlex.quote(path)
    result = await sandbox.exec(
        f"if [ -d {quoted} ]; then echo dir; elif [ -f {quoted} ]; then echo file; "
        f"elif [ -e {quoted} ] || [ -L {quoted} ]; then echo special; else echo missing; fi",
        timeout_s=10,
    )
    return result.output.strip() or "missing"


def _not_regular(path: str) -> ToolResult:
    return _error(f"{path} is not a regular file (a FIFO, socket, device or broken link); the editor reads and "
                  "writes regular files only: remove it or choose another path.")


async def _read_existing(path: str, sandbox: Sandbox) -> str | ToolResult:
    kind = await _path_kind(path, sandbox)
    if kind == "special":
        return _not_regular(path)
    if kind != "file":
        what = "is a directory" if kind == "dir" else "does not exist"
        return _error(f"{path} {what}; give the path of an existing file (create makes new files).")
    return await sandbox.read_file(path)


async def _list_dir(path: str, sandbox: Sandbox) -> ToolResult:
    command = (
        f"find {shlex.quote(path)} -maxdepth 2 -not -path '*/.*' -not -path '*/__pycache__*' "
        f"| sort | head -n 400"
    )
    result = await sandbox.exec(command, timeout_s=30)
    entries = [line.removeprefix("./") for line in result.output.splitlines() if line not in (".", path)]
    listing = "\n".join(entries) if entries else "(empty)"
    return ToolResult(f"Files and folders in {path} (2 levels, hidden ones left out):\n{listing}")


def _lines(content: str) -> list[str]:
    """Lines without the newline; a trailing newline does not start an extra empty line."""
    return content.split("\n")[:-1] if content.endswith("\n") else content.split("\n") if content else []


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{number:6}\t{line}" for number, line in enumerate(lines, first))


def _find_all(content: str, needle: str) -> list[int]:
    positions, start = [], content.find(needle)
    while start != -1:
        positions.append(start)
        start = content.find(needle, start + 1)
    return positions


def _match_problem(path: str, content: str, old: str, positions: list[int]) -> str:
    if positions:
        lines = ", ".join(str(content.count("\n", 0, p) + 1) for p in positions)
        return (
            f"old_str occurs {len(positions)} times in {path}, starting at lines {lines}. "
            "Include more surrounding lines in old_str so that it matches exactly once."
        )
    message = f"old_str was not found in {path}; it must match the file exactly, including whitespace."
    first = next((line.strip() for line in old.split("\n") if line.strip()), "")
    near = [str(n) for n, line in enumerate(_lines(content), 1) if first and first in line]
    if near:
        message += (
            f" Its first line appears (maybe with other indentation, or followed by different lines) "
            f"at line(s) {', '.join(near[:10])}; view those lines and copy them exactly."
        )
    else:
        message += " View the file first and copy the text you want to replace."
    return message


def _edited(path: str, content: str, first: int, last: int) -> ToolResult:
    lines = _lines(content)
    start, end = max(1, first - SNIPPET_CONTEXT), min(len(lines), last + SNIPPET_CONTEXT)
    snippet = _numbered(lines[start - 1 : end], start)
    return ToolResult(
        f"Edited {path}. Lines {start}-{end} now read:\n{snippet}\n"
        "Check the result; undo_edit reverts this edit."
    )


def _history_path(path: str) -> str:
    return f"{HISTORY_DIR}/{hashlib.sha1(path.encode()).hexdigest()[:20]}.json"


async def _load_history(sandbox: Sandbox, path: str) -> list[str | None]:
    kind = await _path_kind(_history_path(path), sandbox)
    if kind != "file":
        return []
    return json.loads(await sandbox.read_file(_history_path(path)))["versions"]


async def _push_history(sandbox: Sandbox, path: str, previous: str | None) -> None:
    """Record the content before an edit (None: the file did not exist)."""
    versions = (await _load_history(sandbox, path) + [previous])[-MAX_UNDO_STEPS:]
    await sandbox.write_file(_history_path(path), json.dumps({"path": path, "versions": versions}))


async def _pop_history(sandbox: Sandbox, path: str) -> str | None | bool:
    """The content before the last edit (None: did not exist), or False when there is none."""
    versions = await _load_history(sandbox, path)
    if not versions:
        return False
    previous = versions.pop()
    await sandbox.write_file(_history_path(path), json.dumps({"path": path, "versions": versions}))
    return previous
