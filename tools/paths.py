"""Map the paths models write (relative, `./x`, absolute as shown by `pwd`) onto workspace paths."""

from __future__ import annotations

import posixpath

from rollway.sandboxes.base import Sandbox

PRIVATE_DIR = ".rollway"
"""Tool state kept inside the workspace (editor undo history); hidden from the model and from diffs."""


class PathError(ValueError):
    """The path points outside the workspace or into tool state; the message tells the model why."""


async def resolve_workspace_path(raw: str, sandbox: Sandbox) -> str:
    """A normalized workspace-relative path (`.` for the root); raises PathError."""
    path = raw.strip()
    if posixpath.isabs(path):
        path = await _strip_root(path, sandbox)
        if posixpath.isabs(path):
            raise PathError(
                f"{raw} is outside the workspace; paths are relative to the repository root, "
                "e.g. src/module.py."
            )
    path = posixpath.normpath(path or ".")
    if path == ".." or path.startswith("../"):
        raise PathError(f"{raw} is outside the workspace; paths are relative to the repository root.")
    if path == PRIVATE_DIR or path.startswith(PRIVATE_DIR + "/"):
        raise PathError(f"{PRIVATE_DIR}/ holds the tools' own state and cannot be used.")
    return path


async def _strip_root(path: str, sandbox: Sandbox) -> str:
    """Models often write absolute paths as `pwd` shows them; map those into the workspace."""
    roots = [sandbox.workspace_path] if sandbox.workspace_path else []
    result = await sandbox.exec("pwd", timeout_s=10)
    if result.exit_code == 0 and result.output.strip():
        roots.append(result.output.strip())
    for root in roots:
        root = root.rstrip("/")
        if path == root:
            return "."
        if path.startswith(root + "/"):
            return path[len(root) + 1 :]
    return path
