"""A task's starting tree carries no trace of how it was built: every file and folder has one fixed
modification and access time, and no interpreter cache (bytecode of the original file, a test run's
cache) is left in it. Applied where a task tree is made (a mutated snapshot, a tree exported from git, an
image's build context) and again where a sandbox is made from one (docs/security/task-data.md)."""

from __future__ import annotations

import inspect
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
    drop_caches(root)
    retime_tree(root)  # after the removals, which touched their folders' times


def drop_caches(root: str | os.PathLike[str]) -> None:
    """Remove interpreter caches (CACHE_FOLDERS, CACHE_SUFFIXES) under `root`, following no link out of it."""
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


def retime_tree(root: str | os.PathLike[str]) -> None:
    """Every entry under `root` (links themselves, never their targets) and `root` to FIXED_TIME, deepest
    first (retiming an entry never touches its folder's time). The jail runs it after the base snapshot:
    `git add` reads each file in path order and a first read moves its access time to the current clock
    tick, so the files read after a tick boundary would be the newest (an order the agent could read, naming
    the tree's last files). Containers mount the workspace `noatime` instead."""
    for here, folders, files in os.walk(root, topdown=False, followlinks=False):
        for name in [*files, *folders]:
            os.utime(os.path.join(here, name), (FIXED_TIME, FIXED_TIME), follow_symlinks=False)
    os.utime(root, (FIXED_TIME, FIXED_TIME))


RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "iniconfig", "packaging"})
"""Never hidden: the test runner imports them from the interpreter's path (a `pytest` started from its
console script does not put the workspace first)."""


def library_names(workspace: str | os.PathLike[str], runner: frozenset[str] = RUNNER_MODULES) -> list[str]:
    """The modules and packages at the top of a task tree (or under `src/`), less the test runner's. (Its
    source is part of INSTALLED_COPIES_SCRIPT: it uses nothing but `Path`.)"""
    root = Path(workspace)
    names = {p.stem for p in [*root.glob("*.py"), *root.glob("src/*.py")] if p.name not in ("setup.py", "conftest.py")}
    names |= {p.parent.name for p in [*root.glob("*/__init__.py"), *root.glob("src/*/__init__.py")]}
    return sorted(n for n in names if n.isidentifier() and n not in runner)


INSTALLED_COPIES_SCRIPT = ("from __future__ import annotations\nimport importlib.util, json, os, sys\n"
                           "from pathlib import Path\n" + f"RUNNER_MODULES = frozenset({sorted(RUNNER_MODULES)!r})\n"
                           + inspect.getsource(library_names) + r"""
names = [n for arg in sys.argv[1:] for n in (library_names(arg) if arg.startswith("/") else [arg])]
hidden = []
for name in names:
    path = Path(getattr(importlib.util.find_spec(name), "origin", None) or "")
    if not path.is_absolute() or not {"site-packages", "dist-packages"} & set(path.parts):
        continue
    if path.name == "__init__.py":  # a package: its folder
        site = path.parent.parent
        hidden.append(str(path.parent))
    else:  # a module: its file and bytecode
        site = path.parent
        hidden += [str(path), *map(str, (site / "__pycache__").glob(name + ".*.pyc"))]
    for record in site.glob("*.dist-info/RECORD"):
        try:
            lines = record.read_text(errors="replace").splitlines()
        except OSError:
            continue
        if any(line.startswith((name + "/", name + ".py,")) for line in lines):
            hidden.append(str(record))
print(json.dumps(sorted(set(hidden))))
""")
"""Run by a sandbox's interpreter (`python -I -c SCRIPT ARG...`, from `/`; an ARG is a library's name, or an
absolute folder: the libraries of that tree, `library_names`): the paths of what it holds in its
site-packages of those libraries (the installed copy, its bytecode, the dist-info RECORD that hashes its
files), as JSON. Any of them names the file a task changed (docs/security/task-data.md)."""


def installed_copies(workspace: str | os.PathLike[str], python: str) -> list[str]:
    """What the sandbox's interpreter `python` holds in its site-packages of a library the workspace holds
    too (INSTALLED_COPIES_SCRIPT): the local jail hides them. The standard library is never among them."""
    names = library_names(workspace)
    if not names:
        return []
    found = subprocess.run([python, "-I", "-c", INSTALLED_COPIES_SCRIPT, *names], capture_output=True, text=True,
                           cwd="/", timeout=120)
    return json.loads(found.stdout) if found.returncode == 0 else []
