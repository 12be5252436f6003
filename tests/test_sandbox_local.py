"""The bubblewrap sandbox against the real bwrap: lifecycle, diff, and containment of a hostile agent."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import pytest

from rollway.runners import cmd_sandbox
from rollway.sandboxes import cgroups
from rollway.sandboxes.base import SandboxError, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.containment import ATTACKS, fork_bomb, memory_bomb
from rollway.sandboxes.jail import OutputCapture
from rollway.sandboxes.local import LocalSandbox, LocalSandboxProvider

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def config(tmp_path: Path) -> SandboxConfig:
    return SandboxConfig(
        root=str(tmp_path / "boxes"),
        exec_timeout_s=60,  # generous: under a loaded CI machine a walk of the venv alone took over 10 s
        max_processes=64,
        memory_mb=512,
        max_file_mb=8,
        tmp_mb=32,
    )


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "core.py").write_text("def add(a, b):\n    return a - b\n")
    (src / "README.md").write_text("demo\n")
    (src / "old.txt").write_text("to be deleted\n")
    (src / "test_core.py").write_text(
        "from pkg.core import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    return src


@pytest.fixture
def box(config: SandboxConfig, source: Path):
    provider = LocalSandboxProvider(config)
    sandbox = run(provider.create(SandboxSpec(source_dir=str(source)), f"t-{uuid.uuid4().hex[:8]}"))
    yield sandbox
    run(sandbox.destroy())


def sh(box: LocalSandbox, command: str, timeout_s: float | None = None):
    return run(box.exec(command, timeout_s))


# --- lifecycle -------------------------------------------------------------------------------


def test_create_copies_source_writes_files_and_runs_setup(config: SandboxConfig, source: Path) -> None:
    spec = SandboxSpec(
        source_dir=str(source), files={"conf/x.ini": "a=1\n"}, setup_commands=["echo built > built.txt"]
    )
    sandbox = run(LocalSandboxProvider(config).create(spec, "setup-1"))
    try:
        assert run(sandbox.read_file("pkg/core.py")).startswith("def add")
        assert run(sandbox.read_file("conf/x.ini")) == "a=1\n"
        assert run(sandbox.read_file("built.txt")) == "built\n"
        assert run(sandbox.diff()) == ""  # setup output belongs to the base snapshot
    finally:
        run(sandbox.destroy())


def test_failed_setup_raises_and_leaves_nothing(config: SandboxConfig) -> None:
    provider = LocalSandboxProvider(config)
    with pytest.raises(SandboxError, match="setup command"):
        run(provider.create(SandboxSpec(setup_commands=["exit 3"]), "bad-setup"))
    assert not (Path(config.root) / "bad-setup").exists()


def test_exec_runs_venv_python_and_pytest_in_workspace(box: LocalSandbox) -> None:
    result = sh(box, "pwd; id -u; python -c 'import sys; print(sys.prefix)'; pytest -q test_core.py")
    lines = result.output.splitlines()
    assert lines[0] == "/workspace" and lines[1] == "65534"
    assert lines[2] == sys.prefix
    assert "1 failed" in result.output and result.exit_code == 1  # the task's bug is visible
    run(box.write_file("pkg/core.py", "def add(a, b):\n    return a + b\n"))
    assert sh(box, "pytest -q test_core.py").exit_code == 0


def test_pytest_in_the_jail_loads_rollways_plugins_only_from_an_interpreter_named_for_it(
        config: SandboxConfig, source: Path) -> None:
    """With rollway's own interpreter (the default), the pytest plugins installed beside rollway (its test
    tools: xdist, timeout, anyio) are not the project's: tests graded or run in the jail load none of them.
    An interpreter named in `sandbox.python` is the project's: its plugins load as usual."""
    from importlib.metadata import entry_points

    host_plugins = {e.name for e in entry_points(group="pytest11")}
    assert host_plugins, "rollway's environment has no pytest plugin to leave out"
    (source / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    names = {name for name, _ in config.pluginmanager.list_name_plugin()}\n"
        "    open('plugins.txt', 'w').write('\\n'.join(sorted(names)))\n")

    def loaded(cfg: SandboxConfig) -> set[str]:
        sandbox = run(LocalSandboxProvider(cfg).create(SandboxSpec(source_dir=str(source)), f"p-{uuid.uuid4().hex[:8]}"))
        try:
            assert sh(sandbox, "python -m pytest -q -p no:cacheprovider --co test_core.py").exit_code == 0
            return set(run(sandbox.read_file("plugins.txt")).split())
        finally:
            run(sandbox.destroy())

    assert not loaded(config) & host_plugins
    assert loaded(config.model_copy(update={"python": sys.executable})) >= host_plugins


def test_write_file_is_editable_inside_and_read_back(box: LocalSandbox) -> None:
    run(box.write_file("new/dir/f.txt", "one\n"))
    assert sh(box, "echo two >> new/dir/f.txt && mkdir new/dir/sub").exit_code == 0
    assert run(box.read_file("new/dir/f.txt")) == "one\ntwo\n"
    assert box.workspace_path and Path(box.workspace_path, "new/dir/f.txt").is_file()


def test_diff_applies_to_fresh_copy(box: LocalSandbox, source: Path, tmp_path: Path) -> None:
    run(box.write_file("pkg/core.py", "def add(a, b):\n    return a + b\n"))
    sh(box, "rm old.txt && mkdir -p docs && printf 'hello\\n' > docs/new.md && chmod +x README.md")
    sh(
        box,
        "python -c 'import pkg.core' && mkdir -p .pytest_cache .rollway && touch .pytest_cache/x .rollway/undo",
    )
    patch = run(box.diff())
    assert "a/pkg/core.py" in patch and "b/docs/new.md" in patch and "deleted file mode" in patch
    assert "base.git" not in patch and ".pytest_cache" not in patch and "__pycache__" not in patch
    assert ".rollway" not in patch  # tool state, not the agent's work
    for tool in (["git", "apply", "-"], ["patch", "-p1"]):
        fresh = tmp_path / f"fresh-{tool[0]}"
        shutil.copytree(source, fresh)
        subprocess.run(tool, input=patch.encode(), cwd=fresh, check=True, capture_output=True)
        assert (fresh / "pkg/core.py").read_text().endswith("a + b\n")
        assert (fresh / "docs/new.md").read_text() == "hello\n" and not (fresh / "old.txt").exists()


def test_attach_from_handle_in_new_provider(box: LocalSandbox, config: SandboxConfig) -> None:
    sh(box, "echo state > state.txt")
    handle = msgpack.unpackb(msgpack.packb(box.handle))
    again = run(LocalSandboxProvider(config).attach(handle))
    assert sh(again, "cat state.txt").output == "state\n"
    assert "state.txt" in run(again.diff())


def test_create_is_idempotent_per_name(config: SandboxConfig, source: Path) -> None:
    provider = LocalSandboxProvider(config)
    first = run(provider.create(SandboxSpec(source_dir=str(source)), "same"))
    sh(first, "echo work > w.txt")
    second = run(provider.create(SandboxSpec(source_dir=str(source)), "same"))
    assert run(second.read_file("w.txt")) == "work\n"
    run(first.destroy())


def test_destroy_removes_jail_made_files_and_is_idempotent(box: LocalSandbox, config: SandboxConfig) -> None:
    sh(box, "mkdir -p ro/deep && touch ro/deep/f && chmod 500 ro/deep ro")
    handle = box.handle
    run(box.destroy())
    run(box.destroy())
    assert not Path(handle["path"]).exists()
    with pytest.raises(SandboxError, match="does not exist"):
        run(LocalSandboxProvider(config).attach(handle))


def test_paths_escaping_the_workspace_are_refused(box: LocalSandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    sh(box, f"ln -s {secret} link.txt && ln -s / rootlink")
    for bad in ["/etc/passwd", "../secret.txt", "pkg/../../secret.txt", "link.txt", "rootlink/etc/passwd"]:
        with pytest.raises(SandboxError):
            run(box.read_file(bad))
        with pytest.raises(SandboxError):
            run(box.write_file(bad, "x"))
    assert secret.read_text() == "host secret"


def test_bad_handles_are_refused(config: SandboxConfig) -> None:
    provider = LocalSandboxProvider(config)
    with pytest.raises(SandboxError):
        run(provider.attach({"kind": "docker", "id": "x"}))
    with pytest.raises(SandboxError):
        run(provider.attach({"kind": "local", "name": "x", "path": "/etc"}))
    with pytest.raises(SandboxError):
        run(provider.create(SandboxSpec(), "../escape"))


def test_output_capture_keeps_head_and_tail() -> None:
    capture = OutputCapture(10)
    for chunk in (b"abcdefgh", b"ijklmnop", b"qrst"):
        capture.feed(chunk)
    assert capture.text() == "abcde\n[output truncated: 10 bytes omitted]\npqrst"


# --- containment: what a hostile or broken agent tries -----------------------------------------


def test_rm_rf_root_only_touches_the_workspace(box: LocalSandbox, tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("alive")
    # Every unlink fails; rm dies of SIGPIPE once head has its five lines (the limit only bounds a stall).
    result = sh(box, "rm -rf --no-preserve-root / 2>&1 | head -5", timeout_s=30)
    assert "Read-only file system" in result.output or "Permission denied" in result.output
    result = sh(box, f"rm -rf {tmp_path} {sys.prefix} /root /etc 2>&1 | tail -3")
    assert "Read-only file system" in result.output or "Permission denied" in result.output
    assert sentinel.read_text() == "alive"
    assert os.path.exists("/usr/bin/bash") and os.path.exists(sys.executable)
    assert sh(box, "python -c 'print(40 + 2)'").output == "42\n"  # /usr and the venv are intact


def test_writes_outside_workspace_fail(box: LocalSandbox) -> None:
    probe = f"rollway-probe-{uuid.uuid4().hex}"
    for target in [f"/usr/{probe}", f"/etc/{probe}", f"/root/{probe}", f"{sys.prefix}/{probe}", f"/{probe}"]:
        assert sh(box, f"touch {target}").exit_code != 0, target
        assert not os.path.exists(target)
    tmp_write = sh(box, f"touch /tmp/{probe} && ls /tmp")  # private tmpfs: allowed, but not the host's
    assert tmp_write.exit_code == 0 and not os.path.exists(f"/tmp/{probe}")


def test_no_privileges_inside(box: LocalSandbox) -> None:
    out = sh(box, "id -u; grep CapEff /proc/self/status; ls /root/.ssh 2>&1; cat /etc/shadow 2>&1").output
    assert out.startswith("65534\n") and "CapEff:\t0000000000000000" in out
    assert "No such file" in out and "root:" not in out


def test_network_is_cut(box: LocalSandbox) -> None:
    code = "import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)"
    result = sh(
        box,
        f'python -c "{code}" 2>&1 | tail -1; curl -sS -m 3 http://example.com 2>&1 | head -1; ls /sys/class/net 2>&1',
    )
    assert "Network is unreachable" in result.output
    assert "Could not resolve host" in result.output or "curl: command not found" in result.output.replace(
        "bash: ", ""
    )


def test_sleep_forever_times_out(box: LocalSandbox) -> None:
    start = time.monotonic()
    result = sh(box, "sleep 1000 & sleep 1000", timeout_s=1.5)
    assert result.timed_out and result.exit_code != 0 and "timed out" in result.output
    assert time.monotonic() - start < 5
    assert sh(box, "ps -e | wc -l").exit_code == 0  # no leftovers blocked the next jail


def test_huge_output_is_truncated_and_bounded(config: SandboxConfig, source: Path) -> None:
    cfg = config.model_copy(update={"max_output_bytes": 4096, "output_kill_mb": 8})
    sandbox = run(LocalSandboxProvider(cfg).create(SandboxSpec(source_dir=str(source)), "flood"))
    try:
        start = time.monotonic()
        result = sh(sandbox, "yes 'gigabytes of output'")
        assert result.truncated and "[output truncated:" in result.output
        assert len(result.output) < 4096 + 200 and time.monotonic() - start < 5
        big_but_finite = sh(sandbox, "head -c 2000000 /dev/zero | tr '\\0' x; echo; echo END")
        assert big_but_finite.exit_code == 0 and big_but_finite.output.endswith("END\n")
    finally:
        run(sandbox.destroy())


FORKER = """
import os, time
n = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
except OSError as exc:
    print("blocked", n, exc.strerror)
"""


def test_fork_bomb_is_stopped_and_host_unharmed(box: LocalSandbox) -> None:
    start = time.monotonic()
    result = sh(box, "bomb() { bomb | bomb & }; bomb; sleep 2; echo done", timeout_s=6)
    assert time.monotonic() - start < 10
    counted = sh(box, f"python -c '{FORKER}'", timeout_s=8)
    assert counted.output.startswith("blocked"), counted.output
    assert int(counted.output.split()[1]) < 64  # max_processes of the fixture config
    assert sh(box, "echo alive").output == "alive\n", result.output[-500:]
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_memory_and_file_size_are_limited(box: LocalSandbox) -> None:
    # 900 MB written, not only reserved, against the fixture's 512 MB: refused (MemoryError under the
    # address-space limit of a jail without a memory cgroup) or killed (by the memory cgroup).
    mem = sh(box, "python -c 'b = b\"x\" * (900 << 20); print(\"allocated\")'")
    assert mem.exit_code != 0 and "allocated" not in mem.output, mem.output
    assert sh(box, "echo alive").output == "alive\n"
    cfg_file_mb = box._provider.config.max_file_mb
    # Count only the files written: the venv may be bound read-only below /tmp (a checkout under /tmp).
    tmp_fill = sh(box, "for i in $(seq 100); do head -c 7M /dev/zero > /tmp/fill-$i || break; done; "
                       "du -cm /tmp/fill-* | tail -n 1")
    assert int(tmp_fill.output.split()[-2]) <= box._provider.config.tmp_mb  # /tmp is bounded too
    big = sh(box, f"head -c {cfg_file_mb + 1}M /dev/zero > big.bin; echo rc=$?")
    assert (
        "rc=0" not in big.output
        and os.path.getsize(Path(box.workspace_path, "big.bin")) <= cfg_file_mb * 2**20
    )


# --- check() and the CLI ---------------------------------------------------------------------


def test_cli_check_reports_every_protection(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    args = argparse.Namespace(config=None, overrides=[f"sandbox.root={tmp_path}", "sandbox.workspace_mb=64",
                              "sandbox.memory_mb=256", "sandbox.max_file_mb=16"], type="local", json=True)  # fmt: skip
    code = cmd_sandbox.run(args)
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    for key in ATTACKS:
        assert report[key] is True, key
    assert report["bwrap_version"].startswith("bubblewrap")
    assert report["address_space"] == ("256 MB per process" if report["cgroups"].startswith("none")
                                       else "unlimited (the memory cgroup holds real memory)")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a jail as host root")
def test_pids_cgroup_stops_a_fork_bomb_even_as_host_root(tmp_path: Path) -> None:
    """As host root the kernel ignores RLIMIT_NPROC (the hole host_uid exists to close); the
    sandbox's pids cgroup holds anyway."""
    cfg = SandboxConfig(root=str(tmp_path), host_uid=0, max_processes=16)
    provider = LocalSandboxProvider(cfg)
    assert provider.cgroup_kind in ("v1", "v2")
    box = run(provider.create(SandboxSpec(), "root-bomb"))
    try:
        assert run(fork_bomb(box, cfg)) is True
    finally:
        run(box.destroy())


# --- memory: the cgroup holds real memory, the address-space limit is separate -------------------

# Six untouched 4 GB mappings (24 GB of address space, more than this machine's memory, each one
# under the kernel's overcommit guess): what node/V8 does at start-up (about 18 GB reserved, 700 MB used).
RESERVE = "python -c 'import mmap; maps = [mmap.mmap(-1, 4 << 30) for _ in range(6)]; print(\"reserved\")'"


@pytest.mark.skipif(cgroups.mechanism() is None, reason="needs root with writable memory cgroups")
def test_with_a_memory_cgroup_address_space_is_free_and_written_memory_is_held(config: SandboxConfig) -> None:
    """Where the sandbox's memory cgroup holds its real memory, a process may reserve far more address
    space than `memory_mb` (node does), and what processes write is still held to `memory_mb`: one
    process writing more is killed, four processes writing half each hold at most the limit together,
    and the sandbox and the host survive."""
    provider = LocalSandboxProvider(config)
    box = run(provider.create(SandboxSpec(), f"as-{uuid.uuid4().hex[:8]}"))
    try:
        reserved = sh(box, RESERVE)
        assert "reserved" in reserved.output, reserved.output
        single = sh(box, f"python -c 'b = b\"x\" * ({config.memory_mb + 64} << 20); print(\"allocated\")'")
        assert single.exit_code != 0 and "allocated" not in single.output, single.output
        assert run(memory_bomb(box, config)) is True
        assert sh(box, "echo alive").output == "alive\n"
    finally:
        run(box.destroy())


@pytest.mark.parametrize(("cgroup", "address_space_mb", "spec_memory_mb", "expected"), [
    (True, None, None, "unlimited"),  # the cgroup holds memory: no per-process limit
    (True, 4096, None, str(4096 * 1024)),  # an explicit limit is kept, cgroup or not
    (False, None, None, str(512 * 1024)),  # no cgroup: each process is held to memory_mb (the only bound)
    (False, None, 128, str(128 * 1024)),  # ... the sandbox's own memory_mb (a task's) where it sets one
    (False, 4096, None, str(4096 * 1024)),
], ids=["cgroup", "cgroup-explicit", "no-cgroup", "no-cgroup-task-limit", "no-cgroup-explicit"])  # fmt: skip
def test_the_address_space_limit_each_jailed_process_gets(
    config: SandboxConfig, cgroup: bool, address_space_mb: int | None, spec_memory_mb: int | None, expected: str
) -> None:
    """`ulimit -v` as a command in the jail sees it. Without a cgroup (a host where rollway is not root,
    or cgroupfs is read-only) the provider is the real one with its cgroup mechanism switched off."""
    if cgroup and cgroups.mechanism() is None:
        pytest.skip("needs root with writable memory cgroups")
    cfg = type(config).model_validate({**config.model_dump(), "address_space_mb": address_space_mb})
    provider = LocalSandboxProvider(cfg)
    if not cgroup:
        provider.cgroup_kind, provider.memory_held = None, False
    box = run(provider.create(SandboxSpec(memory_mb=spec_memory_mb), f"ul-{uuid.uuid4().hex[:8]}"))
    try:
        assert sh(box, "ulimit -v").output.strip() == expected
        if not cgroup and address_space_mb is None:  # and a reservation beyond it is refused
            assert "reserved" not in sh(box, RESERVE).output
    finally:
        run(box.destroy())
