"""A task's starting tree carries no trace of how it was built: every file and folder has one fixed
modification and access time, and no interpreter cache (bytecode of the original file, a test run's
cache) is left in it. Applied where a task tree is made (a mutated snapshot, a tree exported from git, an
image's build context) and again where a sandbox is made from one (docs/security/task-data.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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


RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "iniconfig", "packaging"})
"""Never hidden: the test runner imports them from the interpreter's path (a `pytest` started from its
console script does not put the workspace first)."""

_FIND_SPECS = ("import importlib.util as u, json, sys; "
               "print(json.dumps([getattr(u.find_spec(n), 'origin', None) for n in sys.argv[1:]]))")


def installed_copies(workspace: str | os.PathLike[str], python: str) -> list[str]:
    """What the sandbox's interpreter `python` holds of a library the workspace holds too (a module or
    package at the top, or under `src/`), in its site-packages: the installed copy, its bytecode and the
    dist-info whose RECORD hashes its files. Any of them names the file a task changed
    (docs/security/task-data.md); the local jail hides them. The standard library is never among them."""
    root = Path(workspace)
    names = {p.stem for p in [*root.glob("*.py"), *root.glob("src/*.py")] if p.name not in ("setup.py", "conftest.py")}
    names |= {p.parent.name for p in [*root.glob("*/__init__.py"), *root.glob("src/*/__init__.py")]}
    names = sorted(n for n in names if n.isidentifier() and n not in RUNNER_MODULES)
    if not names:
        return []
    found = subprocess.run([python, "-I", "-c", _FIND_SPECS, *names], capture_output=True, text=True, cwd="/",
                           timeout=120)
    hidden: list[str] = []
    for name, origin in zip(names, json.loads(found.stdout) if found.returncode == 0 else [], strict=False):
        path = Path(origin or "")
        if not path.is_absolute() or not {"site-packages", "dist-packages"} & set(path.parts):
            continue
        if path.name == "__init__.py":  # a package: its folder
            site = path.parent.parent
            hidden.append(str(path.parent))
        else:  # a module: its file and bytecode
            site = path.parent
            hidden += [str(path), *map(str, (site / "__pycache__").glob(f"{name}.*.pyc"))]
        hidden += [str(record.parent) for record in site.glob("*.dist-info/RECORD")
                   if any(line.startswith((f"{name}/", f"{name}.py,")) for line in _lines(record))]
    return sorted(set(hidden))


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []
