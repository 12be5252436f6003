"""A task's starting tree carries no trace of how it was built: every file and folder has one fixed
modification and access time, and no interpreter cache (bytecode of the original file, a test run's
cache) is left in it. Applied where a task tree is made (a mutated snapshot, a tree exported from git, an
image's build context) and again where a sandbox is made from one (docs/security/task-data.md)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

FIXED_TIME = 946684800
"""2000-01-01T00:00:00Z: the modification and access time of everything in a fresh task workspace (the
snapshot commit's date too)."""

CACHE_FOLDERS = ("__pycache__", ".pytest_cache")
CACHE_SUFFIXES = (".pyc", ".pyo")

NORMALISE_COMMAND = (
    "find . -type d \\( -name __pycache__ -o -name .pytest_cache \\) -prune -exec rm -rf {} + 2>/dev/null; "
    "find . -path ./.rollway -prune -o -type f \\( -name '*.pyc' -o -name '*.pyo' \\) -exec rm -f {} + 2>/dev/null; "
    f"find . -path ./.rollway -prune -o -exec touch -h -d @{FIXED_TIME} {{}} + 2>/dev/null; true"
)
"""`normalise_tree` as a shell command in a sandbox's workspace (containers, after the task's setup
commands): files the sandbox user may not retime keep the fixed time the copy gave them."""


def normalise_tree(root: str | os.PathLike[str]) -> None:
    """Remove interpreter caches under `root` and give every entry (links themselves, never their targets)
    FIXED_TIME. Nothing is followed out of `root`: folders are walked without following links."""
    root = Path(root)
    for here, folders, files in os.walk(root, topdown=True, followlinks=False):
        for name in [f for f in folders if f in CACHE_FOLDERS]:
            folders.remove(name)
            path = os.path.join(here, name)
            if os.path.islink(path):
                os.unlink(path)
            else:
                shutil.rmtree(path)
        for name in files:
            if name.endswith(CACHE_SUFFIXES):
                os.unlink(os.path.join(here, name))
    # Deepest first: retiming an entry never touches its folder's time, but removing one did above.
    for here, folders, files in os.walk(root, topdown=False, followlinks=False):
        for name in [*files, *folders]:
            os.utime(os.path.join(here, name), (FIXED_TIME, FIXED_TIME), follow_symlinks=False)
    os.utime(root, (FIXED_TIME, FIXED_TIME))
