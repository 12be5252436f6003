"""Host paths (issue 39 item 6): every host-side operation rollway (root) does on a path inside a folder the
agent can write goes through descriptors opened without following links, and the harness launcher's spec
(the episode's gateway key) is never on a command line. Real jail, real `rollway up`, real gateway; the
model is a scripted policy (the only faked part)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollway.sandboxes.base import SandboxError, SandboxSpec
from rollway.sandboxes.config import LocalSandboxConfig
from rollway.sandboxes.local import LocalSandboxProvider

ROOT = Path(__file__).resolve().parent.parent

# The harness program: fails (exit 3) when its gateway key is on any command line it can see (its
# launcher's), then swaps the workspace's .rollway for a link to a host folder holding a decoy gateway.sock.
HOSTILE_PROGRAM = r"""
import os, sys
key = os.environ["OPENAI_API_KEY"]
seen = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        seen.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
    except OSError:
        pass
if "key" in sys.argv[2] and any(key in line for line in seen):
    print("KEY ON A COMMAND LINE"); sys.exit(3)
if "swap" in sys.argv[2]:
    os.rename(".rollway", ".rollway-moved")
    os.symlink(sys.argv[1], ".rollway")
    print("swapped")
"""


def _up(tmp_path: Path, harness: dict) -> tuple[subprocess.CompletedProcess, list[dict]]:
    job = {"run": {"name": "host-paths", "timeout_s": 400},
           "tasks": {"type": "toy", "count": 1},
           "scheduler": {"group_size": 1, "max_inflight_episodes": 1, "episode_deadline_s": 300, "max_attempts": 1},
           "agent": {"concurrency": 1, "harness": harness},
           "policy": {"type": "scripted", "chat_format": "bytes-chatml",
                      "script": [{"when": "", "turns": ["I cannot do this."]}]}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(tmp_path / "job.yaml"),
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=520, cwd=ROOT)
    trajs_file = run_dir / "trajectories.jsonl"
    trajs = [json.loads(line) for line in trajs_file.read_text().splitlines()] if trajs_file.exists() else []
    return out, trajs


@pytest.mark.parametrize("attack", ["key", "swap"])
def test_a_harness_program_finds_no_key_on_argv_and_its_swapped_folder_sends_no_unlink_out(tmp_path, attack):
    """Before the fix the launcher's argv held a JSON spec with OPENAI_API_KEY (`key`: exit 3 here), and
    after the program ended the worker (root) unlinked `.rollway/gateway.sock` through the link the program
    put in place of `.rollway` (`swap`): the host's `outside/gateway.sock` was removed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o755)
    (outside / "gateway.sock").write_text("a host file the worker must not remove\n")
    out, trajs = _up(tmp_path, {"command": ["python3", "-c", HOSTILE_PROGRAM, str(outside), attack]})
    failures = (tmp_path / "run" / "failures.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(trajs) == 1, (failures.read_text() if failures.exists() else "") + out.stderr[-2000:]
    assert trajs[0]["stop_reason"] == "harness_exit"
    assert (outside / "gateway.sock").read_text() == "a host file the worker must not remove\n"
    assert sorted(p.name for p in outside.iterdir()) == ["gateway.sock"]


def _provider(tmp_path: Path) -> LocalSandboxProvider:
    return LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path / "boxes")))


@pytest.mark.parametrize("link", [".rollway", ".rollway/notes.txt", "sub"])
def test_host_writes_into_the_workspace_never_follow_a_link_swapped_in(tmp_path, link):
    """`write_file` (the editor's, the harness spec's) resolves its path, then writes: a link the agent
    swaps in between (here: made before the write, where `resolve_inside` would have refused it; the
    descriptor walk is what refuses it now) sends no byte out of the workspace."""
    outside = tmp_path / "outside"
    outside.mkdir()
    box = asyncio.run(_provider(tmp_path).create(SandboxSpec(files={"a.txt": "a\n"}), "hp-write-1"))
    try:
        ws = Path(box.workspace_path)
        target = outside / "notes.txt" if link.endswith(".txt") else outside
        if "/" in link:
            (ws / ".rollway").mkdir(exist_ok=True)
        (ws / link).symlink_to(target)
        rel = ".rollway/notes.txt" if link.startswith(".rollway") else "sub/notes.txt"
        with pytest.raises(SandboxError, match="link"):
            asyncio.run(box.write_file(rel, "planted"))
    finally:
        asyncio.run(box.destroy())
    assert list(outside.iterdir()) == []


def test_the_gateway_socket_mode_is_never_set_on_a_link_target(tmp_path):
    """The gateway binds its socket, then makes it 0666 for the sandbox user: by the entry itself (opened
    without following), never by path, so a link swapped in between cannot make a host file 0666."""
    from rollway.gateway.server import _chmod_socket

    folder, victim = tmp_path / "folder", tmp_path / "victim"
    folder.mkdir()
    victim.write_text("secret")
    victim.chmod(0o600)
    (folder / "gateway.sock").symlink_to(victim)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError, match="replaced"):
            _chmod_socket(fd, "gateway.sock")
    finally:
        os.close(fd)
    assert victim.stat().st_mode & 0o777 == 0o600
