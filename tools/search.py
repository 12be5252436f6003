"""The `search` tool: tree-sitter code search (definition, outline, source, references) over the workspace."""

from __future__ import annotations

import difflib
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollway.base.threads import run_blocking
from rollway.sandboxes import hostfs
from rollway.sandboxes.base import Sandbox
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.code_index import (
    LANGUAGE_BY_SUFFIX,
    FileIndex,
    Symbol,
    could_define,
    find_uses,
    index_file,
    language_of,
)
from rollway.tools.config import ToolsConfig
from rollway.tools.paths import PRIVATE_DIR, PathError, resolve_workspace_path

SKIPPED_DIRS = {"node_modules", "__pycache__", "site-packages", PRIVATE_DIR}
MAX_FILE_BYTES = 2_000_000
"""Larger files are generated or minified; parsing them costs much and finds little."""
MAX_SOURCE_LINES = 300
MAX_OUTLINE_ENTRIES = 300
_KIND_RANK = {"class": 0, "function": 0, "method": 1, "variable": 2, "attribute": 2}


@dataclass(frozen=True)
class _Hit:
    """One ranked result line."""

    rank: tuple
    path: str
    line: int
    text: str


class SearchTool(Tool):
    """Code search that understands definitions; reads the host folder directly when it can."""

    name = "search"
    description = (
        "Search the code by syntax tree (Python, JavaScript).\n"
        "- definition: where `name` is defined (function, class, method, module variable); "
        "`name` may be qualified, e.g. Class.method or module.function.\n"
        "- source: the full source of the best-matching definition of `name`.\n"
        "- references: lines where the identifier `name` is used (definitions left out).\n"
        "- outline: classes, functions and methods of the file (or folder) `path`, with line numbers.\n"
        "`path` also narrows the other actions to a file or folder."
    )
    parameters = {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["definition", "source", "references", "outline"]},
            "name": {"type": "string", "description": "Symbol name, e.g. parse or Parser.parse."},
            "path": {
                "type": "string",
                "description": "File or folder relative to the root (required for outline).",
            },
        },
        "required": ["action"],
        "additionalProperties": False,
    }

    def __init__(self, cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg or ToolsConfig()

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        action, name = arguments["action"], str(arguments.get("name") or "").strip()
        if action == "outline" and not arguments.get("path"):
            return ToolResult(
                'outline needs path, e.g. {"action": "outline", "path": "src/module.py"}', is_error=True
            )
        if action != "outline" and not name:
            return ToolResult(
                f'{action} needs name, e.g. {{"action": "{action}", "name": "MyClass.method"}}', is_error=True
            )
        try:
            under = await resolve_workspace_path(arguments.get("path") or ".", sandbox)
        except PathError as error:
            return ToolResult(str(error), is_error=True)
        limit = MAX_OUTLINE_ENTRIES if action == "outline" else self.cfg.search_max_files
        # Parsing runs on threads of its own with the call's deadline: the workspace is the agent's, and a
        # search over what it made there must not hold the threads the rest of the worker shares.
        limit_s = self.cfg.call_timeout_s
        if sandbox.workspace_path:
            return await run_blocking(search_folder, sandbox.workspace_path, action, name, under, self.cfg, limit,
                                      timeout_s=limit_s)
        files, skipped = await _collect_remote(sandbox, under, _file_filter(action, name), limit)
        result = await run_blocking(_answer, action, name, under, files, skipped, self.cfg, timeout_s=limit_s)
        if result.metadata.get("not_found") and action != "references":
            result.content += await run_blocking(_suggestions, files, name, timeout_s=limit_s)
        return result


def search_folder(
    root: str,
    action: str,
    name: str = "",
    under: str = ".",
    cfg: ToolsConfig | None = None,
    max_files: int | None = None,
) -> ToolResult:
    """Run one search over a host folder (blocking: parses files; call it in a thread)."""
    cfg = cfg or ToolsConfig()
    max_files = max_files or cfg.search_max_files
    files, skipped = _collect_local(root, under, _file_filter(action, name), max_files)
    result = _answer(action, name, under, files, skipped, cfg)
    if result.metadata.get("not_found") and action in ("definition", "source"):
        # The name filter hid near-misses (typos, other case); widen it to a prefix for suggestions.
        result.content += _suggestions(_collect_local(root, under, _prefix_filter(name), max_files)[0], name)
    return result


@dataclass(frozen=True)
class _FileFilter:
    """Which files are worth parsing (pre-filtering keeps cold searches fast): `grep` is a
    substring every accepted file contains, ignoring case (pre-filters inside a sandbox), and
    `accepts` the exact test on a file's bytes."""

    grep: str
    accepts: Callable[[bytes], bool]


def _file_filter(action: str, name: str) -> _FileFilter:
    short = name.rsplit(".", 1)[-1]
    if action == "outline":
        return _FileFilter("", lambda data: True)
    needle = short.encode()
    if action == "references":
        word = re.compile(rb"(?<![\w$])" + re.escape(short.encode()) + rb"(?![\w$])")
        return _FileFilter(short, lambda data: needle in data and word.search(data) is not None)
    return _FileFilter(short, could_define(short))


def _prefix_filter(name: str) -> _FileFilter:
    short = name.rsplit(".", 1)[-1]
    prefix = short[: max(3, len(short) // 2)].lower()
    return _FileFilter(prefix, lambda data: prefix.encode() in data.lower())


def _answer(
    action: str, name: str, under: str, files: dict[str, bytes], skipped: int, cfg: ToolsConfig
) -> ToolResult:
    if not files and action == "outline":
        return ToolResult(f"No Python or JavaScript file at {under}.", is_error=True)
    indexed = {path: (index_file(data, language_of(path)), data) for path, data in files.items()}
    if action == "outline":
        text = _outline(indexed, under)
    elif action == "references":
        text = _references(indexed, name, cfg.search_max_results)
    else:
        text = _definitions(indexed, name, cfg.search_max_results, show_source=action == "source")
    if skipped:
        text += f"\n(Note: {skipped} files were not scanned; give `path` to search a smaller folder.)"
    return ToolResult(text, metadata={"not_found": text.startswith("No ")})


def _collect_local(
    root: str, under: str, wanted: _FileFilter, max_files: int
) -> tuple[dict[str, bytes], int]:
    paths = _walk_local(root, under)
    files: dict[str, bytes] = {}
    for path in paths[:max_files]:
        # This runs on the host, maybe as root: a link the agent made must not reveal host files, and a
        # FIFO or device named like a source file must not block the thread (hostfs reads regular files only).
        try:
            data = hostfs.read_regular(root, hostfs.inside(root, path), MAX_FILE_BYTES)
        except OSError:
            continue
        if len(data) <= MAX_FILE_BYTES and wanted.accepts(data):
            files[path] = data
    return files, max(0, len(paths) - max_files)


def _walk_local(root: str, under: str) -> list[str]:
    start = os.path.join(root, under)
    if os.path.isfile(start):
        return [under] if language_of(under) else []
    found = []
    for folder, dirs, names in os.walk(start):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS)
        relative = os.path.relpath(folder, root)
        for name in sorted(names):
            if language_of(name):
                found.append(os.path.normpath(os.path.join(relative, name)))
    return found


async def _collect_remote(
    sandbox: Sandbox, under: str, wanted: _FileFilter, max_files: int
) -> tuple[dict[str, bytes], int]:
    """Without a host folder: list (and pre-filter with grep) in the sandbox, then read each file."""
    suffixes = " -o ".join(f"-name '*{suffix}'" for suffix in LANGUAGE_BY_SUFFIX)
    command = (
        f"find {shlex.quote(under)} \\( -path '*/.*' -o -name node_modules -o -name __pycache__ \\) "
        f"-prune -o -type f \\( {suffixes} \\) -size -{MAX_FILE_BYTES // 1000}k -print"
    )
    if wanted.grep:
        command += f" | xargs -r grep -liF -- {shlex.quote(wanted.grep)}"
    result = await sandbox.exec(command + " | sort", timeout_s=60)
    paths = [os.path.normpath(line) for line in result.output.splitlines() if language_of(line.strip())]
    files = {path: (await sandbox.read_file(path)).encode() for path in paths[:max_files]}
    return {path: data for path, data in files.items() if wanted.accepts(data)}, max(
        0, len(paths) - max_files
    )


def _is_test(path: str) -> bool:
    parts = path.lower().split("/")
    stem = parts[-1].split(".")[0]
    return any(p in ("test", "tests", "testing", "__tests__") for p in parts[:-1]) or (
        stem.startswith("test_")
        or stem.endswith(("_test", "_tests"))
        or ".test." in parts[-1]
        or ".spec." in parts[-1]
        or stem == "conftest"
    )


def _module_name(path: str) -> str:
    parts = path.rsplit(".", 1)[0].split("/")
    return ".".join(p for p in parts if p not in ("__init__", "index"))


def _match_level(symbol: Symbol, path: str, query: str) -> int | None:
    """0: the qualified name is the query; 1: it ends with it (module path included); 2: only the
    last part matches; None: no match."""
    if symbol.qualname == query:
        return 0
    full = f"{_module_name(path)}.{symbol.qualname}"
    if symbol.qualname.endswith("." + query) or full == query or full.endswith("." + query):
        return 1
    return 2 if symbol.name == query.rsplit(".", 1)[-1] else None


def _file_rank(path: str) -> tuple:
    return (_is_test(path), path.count("/"), len(path), path)


def _line_text(lines: list[bytes], line: int) -> str:
    """Line `line` (1-based) of a file split once into `lines` by its caller: a search's hits in one file
    read many of its lines (splitting the file again for each hit made a search's time grow with hits x size)."""
    text = lines[line - 1].decode("utf-8", "replace").strip() if 0 < line <= len(lines) else ""
    return text if len(text) <= 120 else text[:117] + "..."


def _bounded(hits: list[_Hit], limit: int, narrow: str) -> str:
    hits = sorted(hits, key=lambda hit: hit.rank)
    lines = [f"{hit.path}:{hit.line}  {hit.text}" for hit in hits[:limit]]
    if len(hits) > limit:
        lines.append(f"... {len(hits) - limit} more ({narrow})")
    return "\n".join(lines)


def _find_definitions(
    indexed: dict[str, tuple[FileIndex, bytes]], query: str
) -> list[tuple[tuple, str, Symbol]]:
    found = []
    for path, (index, _) in indexed.items():
        for symbol in index.symbols:
            level = _match_level(symbol, path, query)
            if level is not None:
                found.append(
                    ((level, _KIND_RANK.get(symbol.kind, 3), *_file_rank(path), symbol.line), path, symbol)
                )
    found.sort(key=lambda item: item[0])
    if "." in query and found and found[0][0][0] < 2:
        # A qualified query that matched qualified names: unrelated same-named symbols are noise.
        found = [item for item in found if item[0][0] < 2]
    return found


def _definitions(
    indexed: dict[str, tuple[FileIndex, bytes]], query: str, limit: int, show_source: bool
) -> str:
    found = _find_definitions(indexed, query)
    if not found:
        return _no_definition(indexed, query, limit)
    note = ""
    if found[0][0][0] == 2 and "." in query:
        note = f"No exact match for `{query}`; showing definitions named `{query.rsplit('.', 1)[-1]}`.\n"
    if show_source:
        return note + _source(indexed, found)
    lines = {path: indexed[path][1].split(b"\n") for path in {path for _, path, _ in found}}
    hits = [
        _Hit(rank, path, s.line, f"{s.kind} {s.qualname}: {_line_text(lines[path], s.line)}")
        for rank, path, s in found
    ]
    header = f"{len(found)} definition{'s' if len(found) > 1 else ''} of `{query}` (best match first):"
    return (
        note + header + "\n" + _bounded(hits, limit, "give a qualified name such as Class.method, or `path`")
    )


def _source(indexed: dict[str, tuple[FileIndex, bytes]], found: list[tuple[tuple, str, Symbol]]) -> str:
    _, path, symbol = found[0]
    lines = indexed[path][1].decode("utf-8", "replace").split("\n")[symbol.start_line - 1 : symbol.end_line]
    shown = lines[:MAX_SOURCE_LINES]
    body = "\n".join(f"{number:6}\t{text}" for number, text in enumerate(shown, symbol.start_line))
    text = f"{symbol.kind} {symbol.qualname} at {path}:{symbol.line} (lines {symbol.start_line}-{symbol.end_line}):\n{body}"
    if len(lines) > len(shown):
        text += f"\n... {len(lines) - len(shown)} more lines; view them with the editor's view_range."
    others = [f"{p}:{s.line} {s.kind} {s.qualname}" for _, p, s in found[1:6]]
    if others:
        text += "\nOther matches: " + "; ".join(others) + (" ..." if len(found) > 6 else "")
    return text


def _no_definition(indexed: dict[str, tuple[FileIndex, bytes]], query: str, limit: int) -> str:
    text = f"No definition of `{query}` found."
    uses = _reference_hits(indexed, query)
    if uses:
        text += f"\nIt is used here (maybe defined outside the workspace):\n{_bounded(uses, min(limit, 5), 'use references')}"
    return text


def _suggestions(files: dict[str, bytes], query: str) -> str:
    """A "Similar names" line from the definitions in `files`; empty when none is close."""
    names = sorted(
        {s.qualname for path, data in files.items() for s in index_file(data, language_of(path)).symbols}
    )
    close = difflib.get_close_matches(query, names, n=5, cutoff=0.6)
    short = query.rsplit(".", 1)[-1].lower()
    close += [n for n in names if short in n.lower() and n not in close][: 5 - len(close)]
    return f"\nSimilar names: {', '.join(close)}." if close else ""


def _reference_hits(indexed: dict[str, tuple[FileIndex, bytes]], query: str) -> list[_Hit]:
    name = query.rsplit(".", 1)[-1]
    hits = []
    for path, (_, data) in indexed.items():
        lines = data.split(b"\n")
        for line in find_uses(data, language_of(path), name):
            text = _line_text(lines, line)
            # For `Class.method`, lines spelling the qualified name out are the likeliest uses.
            qualified_miss = "." in query and query not in text
            hits.append(_Hit((qualified_miss, *_file_rank(path), line), path, line, text))
    return hits


def _references(indexed: dict[str, tuple[FileIndex, bytes]], query: str, limit: int) -> str:
    hits = _reference_hits(indexed, query)
    if not hits:
        return f"No references to `{query}` found in the searched Python and JavaScript files."
    files = len({hit.path for hit in hits})
    header = (
        f"{len(hits)} lines use `{query.rsplit('.', 1)[-1]}` in {files} file{'s' if files > 1 else ''} "
        "(non-test files first):"
    )
    return header + "\n" + _bounded(hits, limit, "give `path` to narrow to a file or folder")


def _outline(indexed: dict[str, tuple[FileIndex, bytes]], under: str) -> str:
    if len(indexed) == 1 and under in indexed:
        symbols = indexed[under][0].symbols
        entries = [f"{'  ' * s.depth}{s.kind} {s.name}  [{s.line}-{s.end_line}]" for s in symbols]
        shown = entries[:MAX_OUTLINE_ENTRIES]
        more = [f"... {len(entries) - len(shown)} more"] if len(entries) > len(shown) else []
        return "\n".join([f"Outline of {under} ({len(symbols)} symbols, [first-last line]):", *shown, *more])
    lines = [f"Top-level symbols of the {len(indexed)} source files under {under}:"]
    for path in sorted(indexed, key=_file_rank)[:MAX_OUTLINE_ENTRIES]:
        top = [
            f"{s.name}:{s.line}" for s in indexed[path][0].symbols if s.depth == 0 and s.kind != "variable"
        ]
        lines.append(
            f"{path}: {', '.join(top[:30]) or '(no classes or functions)'}{' ...' if len(top) > 30 else ''}"
        )
    if len(indexed) > MAX_OUTLINE_ENTRIES:
        lines.append(f"... {len(indexed) - MAX_OUTLINE_ENTRIES} more files; outline a subfolder")
    return "\n".join(lines)
