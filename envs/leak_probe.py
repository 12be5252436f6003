"""Answer-leak probes: what a hostile policy reads in a fresh task sandbox, besides the task itself, to find
which file a built task changed (buglocal, SWE rows built by mutating a snapshot). Each channel names the
files it singles out; a channel leaks when it singles out the changed file among many. `rollway tasks verify`
and `rollway grader check` run it; docs/security/task-data.md lists the channels."""

from __future__ import annotations

import json
from typing import Any

from rollway.sandboxes.base import Sandbox

PROBE_SCRIPT = r'''
import importlib.util, json, marshal, os, subprocess, sys
SKIP = {".rollway", ".git", ".hg"}
files, dirs = {}, {}
for here, subdirs, names in os.walk("."):
    subdirs[:] = sorted(d for d in subdirs if d not in SKIP)
    dirs[os.path.normpath(here)] = os.lstat(here)
    for name in names:
        rel = os.path.normpath(os.path.join(here, name))
        st = os.lstat(rel)
        if os.path.isfile(rel) and not os.path.islink(rel):
            files[rel] = st
def is_test(rel):
    parts = rel.split("/")
    return (parts[-1].startswith("test_") or parts[-1].endswith("_test.py") or parts[-1] == "conftest.py"
            or any(p in ("test", "tests", "testing") for p in parts[:-1]))
sources = sorted(f for f in files if f.endswith(".py") and "__pycache__" not in f)
library = [f for f in sources if not is_test(f)]
out = {"candidates": library, "channels": {}}
def newest(key, among):
    values = {f: key(files[f]) for f in among}
    if len(set(values.values())) < 2:
        return []
    top = max(values.values())
    return sorted(f for f, v in values.items() if v == top)
for name, key in (("mtime", lambda s: s.st_mtime_ns), ("atime", lambda s: s.st_atime_ns),
                  ("ctime", lambda s: s.st_ctime_ns), ("inode", lambda s: s.st_ino)):
    out["channels"][name] = newest(key, sources)
# Folders: the newest folder's own sources (a file written by rename or created anew touches its folder).
dtimes = {d: s.st_mtime_ns for d, s in dirs.items() if "__pycache__" not in d}
if len(set(dtimes.values())) > 1:
    top = max(dtimes.values())
    newest_dirs = {d for d, v in dtimes.items() if v == top}
    out["channels"]["dir_mtime"] = [f for f in sources if os.path.dirname(f) in newest_dirs or
                                    (os.path.dirname(f) == "" and "." in newest_dirs)]
else:
    out["channels"]["dir_mtime"] = []
# Bytecode: a cached .pyc whose recorded source mtime/size or code differs from the source beside it.
stale = []
for f in files:
    if not f.endswith(".pyc") or os.path.basename(os.path.dirname(f)) != "__pycache__":
        continue
    src = os.path.join(os.path.dirname(os.path.dirname(f)), os.path.basename(f).split(".")[0] + ".py")
    src = os.path.normpath(src)
    if src not in files:
        continue
    data = open(f, "rb").read()
    differs = False
    if len(data) >= 16 and int.from_bytes(data[4:8], "little") == 0:
        differs = (int.from_bytes(data[8:12], "little") != int(files[src].st_mtime) & 0xFFFFFFFF
                   or int.from_bytes(data[12:16], "little") != files[src].st_size & 0xFFFFFFFF)
    try:
        cached = marshal.loads(data[16:])
        fresh = compile(open(src, "rb").read(), src, "exec", dont_inherit=True)
        differs = differs or cached.co_code != fresh.co_code or cached.co_consts != fresh.co_consts
    except Exception:
        pass
    if differs:
        stale.append(src)
out["channels"]["pyc"] = sorted(set(stale))
out["pyc_files"] = sum(f.endswith(".pyc") for f in files)
# Version control left in the workspace: what it says was changed.
named_by_git = []
if os.path.isdir(".git"):
    for args in (["status", "--porcelain"], ["diff", "--name-only", "HEAD"], ["log", "--name-only", "--format=", "-1"],
                 ["reflog", "--name-only", "--format=", "-1"], ["stash", "show", "--name-only"]):
        try:
            text = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30).stdout
        except Exception:
            continue
        named = [f for f in library if f in text.split()]
        if named:
            named_by_git.append(named)
out["channels"]["git"] = sorted(min(named_by_git, key=len)) if named_by_git else []
out["git_folder"] = os.path.isdir(".git")
# A clean copy of the library elsewhere on the interpreter's path (site-packages): the files that differ.
tops = {f.split("/")[0] for f in library if "/" in f and os.path.isfile(f.split("/")[0] + "/__init__.py")}
tops |= {f.split("/")[1] for f in library if f.startswith("src/") and f.count("/") >= 2}
tops |= {f[:-3] for f in library if "/" not in f and f not in ("setup.py", "conftest.py")}
differ, found = [], {}
for top in sorted(tops):
    probe = "import importlib.util as u, sys; s = u.find_spec(sys.argv[1]); print(s.origin if s else '')"
    try:
        origin = subprocess.run([sys.executable, "-I", "-c", probe, top], capture_output=True, text=True,
                                cwd="/", timeout=30).stdout.strip()
    except Exception:
        continue
    if not origin or not origin.startswith("/") or os.path.realpath(origin).startswith(os.path.realpath(".") + "/"):
        continue
    found[top] = origin
    base = os.path.dirname(origin) if origin.endswith("__init__.py") else origin
    for f in library:
        rel = f[4:] if f.startswith("src/") else f
        if rel != top + ".py" and not rel.startswith(top + "/"):
            continue
        other = os.path.join(os.path.dirname(base), rel) if base != origin else origin
        try:
            if open(other, "rb").read() != open(f, "rb").read():
                differ.append(f)
        except OSError:
            pass
out["channels"]["site_packages"] = sorted(set(differ))
out["installed_elsewhere"] = found
print("LEAKPROBE" + json.dumps(out))
'''
"""Run in the workspace by the sandbox's python: JSON of the files each channel singles out."""

ORDER_CHANNELS = ("ctime", "inode")
"""Channels that always single out one file (the last one the copy made): they follow the order in which
sandbox creation writes the tree (sorted paths), not the change; reported, and counted over many tasks
against chance (`chance_rate`), never as a leak of one task."""


class ProbeFailed(RuntimeError):
    """The probe could not run in the sandbox (no python there?): nothing was measured."""


async def probe_sandbox(sandbox: Sandbox) -> dict[str, Any]:
    """What each channel singles out in this sandbox's workspace (run as the agent's commands run)."""
    import shlex

    result = await sandbox.exec(f"python3 -c {shlex.quote(PROBE_SCRIPT)}", timeout_s=300)
    marker = result.output.rfind("LEAKPROBE")
    if result.exit_code != 0 or marker < 0:
        raise ProbeFailed(f"the leak probe did not run (exit {result.exit_code}): {result.output[-500:]}")
    return json.loads(result.output[marker + len("LEAKPROBE"):].strip().splitlines()[0])


def leaking_channels(report: dict[str, Any], changed_file: str) -> list[str]:
    """The channels that single out `changed_file`: it is among the files the channel names and they are
    fewer than half of the library's sources (a guess from them beats chance at least twofold)."""
    candidates = len(report["candidates"])
    return [name for name, named in report["channels"].items()
            if name not in ORDER_CHANNELS and changed_file in named and 2 * len(named) < max(candidates, 2)]


def changed_file_of(taskset: Any, task: Any) -> str | None:
    """The file a built task changed, where the task set knows it (buglocal's answer, a SWE row's gold
    patch's first file); None for task families without one."""
    if task.metadata.get("file"):
        return str(task.metadata["file"])
    inst = getattr(taskset, "instances", {}).get(task.task_id)
    patch = getattr(inst, "patch", None) or (inst.get("patch") if isinstance(inst, dict) else None)
    if patch and "diff --git a/" in patch:
        return patch.split("diff --git a/", 1)[1].split(" ", 1)[0]
    return None


async def probe_task(taskset: Any, task: Any, provider: Any, name: str) -> dict[str, Any] | None:
    """The task's sandbox made as the init stage makes it, probed, destroyed: the channels that leak its
    changed file (`leaks`, empty when none does) and the report; None when the task has no changed file."""
    changed = changed_file_of(taskset, task)
    if changed is None:
        return None
    await taskset.prepare(task)
    box = await provider.create(taskset.sandbox_spec(task), name)
    try:
        report = await probe_sandbox(box)
    finally:
        await box.destroy()
    return {"changed_file": changed, "leaks": leaking_channels(report, changed), "report": report}
