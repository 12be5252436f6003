"""The Docker sandbox against the real engine (started by scripts/setup-docker.sh) and the base image it
builds: lifecycle, files, diff, limits, and the typed errors of a missing image, an engine that stops
mid-run and a container that dies mid-episode, with no container or volume leaked."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from docker_engine import count_containers, ensure_engine, pooled_containers_of
from jobs import run_with_progress

from rollway.runners import cmd_sandbox
from rollway.sandboxes.base import SandboxError, SandboxSpec
from rollway.sandboxes.config import DockerSandboxConfig, SandboxConfig
from rollway.sandboxes.docker import LABEL, DockerSandbox, DockerSandboxProvider


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def client() -> docker.DockerClient:
    return ensure_engine()


@pytest.fixture
def prefix(client: docker.DockerClient) -> Iterator[str]:
    """A name prefix for this test's sandboxes; after the test none of them may be left."""
    name = f"td-{uuid.uuid4().hex[:8]}"
    assert count_containers(name) == 0
    yield name
    assert count_containers(name) == 0, "a container or volume leaked"


@pytest.fixture
def config() -> SandboxConfig:
    return SandboxConfig(type="docker", memory_mb=256, max_processes=64, max_file_mb=8, max_output_bytes=1000,
                         cpus=0.5, exec_timeout_s=60, output_kill_mb=2)  # fmt: skip


@pytest.fixture
def box(config: SandboxConfig, prefix: str, tmp_path: Path) -> Iterator[DockerSandbox]:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    spec = SandboxSpec(
        source_dir=str(tmp_path), files={"extra.txt": "e\n"}, setup_commands=["echo built > built.txt"]
    )
    sandbox = run(DockerSandboxProvider(config).create(spec, prefix))
    yield sandbox
    run(sandbox.destroy())


def test_container_is_locked_down(
    box: DockerSandbox, client: docker.DockerClient, config: SandboxConfig
) -> None:
    host = client.api.inspect_container(box.container_id)["HostConfig"]
    assert host["CapDrop"] == ["ALL"] and host["ReadonlyRootfs"] and host["NetworkMode"] == "none"
    assert "no-new-privileges" in host["SecurityOpt"] and host["PidsLimit"] == 64
    assert host["Memory"] == host["MemorySwap"] == 256 * 2**20 and host["NanoCpus"] == 5 * 10**8
    assert host["ShmSize"] == config.shm_mb * 2**20
    out = run(
        box.exec("id -u; grep CapEff /proc/self/status; cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    ).output
    assert out.split()[:1] == ["65534"] and "0000000000000000" in out and out.split()[-1] == "50000"


def test_default_image_is_the_local_base_with_python_and_git(box: DockerSandbox) -> None:
    assert DockerSandboxConfig().image == "rollway-sandbox:bookworm"
    out = run(box.exec("python3 --version; git --version; patch --version | head -1")).output
    assert "Python 3.11" in out and "git version" in out and "patch" in out


def test_source_files_setup_and_diff(box: DockerSandbox) -> None:
    assert run(box.read_file("pkg/m.py")) == "x = 1\n" and run(box.read_file("built.txt")) == "built\n"
    run(box.write_file("pkg/m.py", "x = 2\n"))
    run(box.exec("echo new > new.txt; rm extra.txt"))
    diff = run(box.diff())
    assert "-x = 1\n+x = 2" in diff and "+++ b/new.txt" in diff and "--- a/extra.txt" in diff
    assert "built.txt" not in diff  # setup output is part of the base snapshot


def test_files_and_paths(box: DockerSandbox) -> None:
    run(box.write_file("src/app/main.py", "print('hi')\n"))
    assert run(box.exec("python3 src/app/main.py")).output == "hi\n"
    with pytest.raises(SandboxError, match="does not exist"):
        run(box.read_file("missing.txt"))
    for bad in ["/etc/passwd", "../x", "a/../../x"]:
        with pytest.raises(SandboxError):
            run(box.write_file(bad, "x"))


def test_symlinks_are_followed_inside_the_workspace_only(box: DockerSandbox) -> None:
    run(box.exec("ln -s pkg/m.py inside.py; ln -s /etc/passwd outside; ln -s loop loop; mkdir d"))
    assert run(box.read_file("inside.py")) == "x = 1\n"
    with pytest.raises(SandboxError, match="outside the workspace"):
        run(box.read_file("outside"))
    for odd in ["loop", "d"]:  # a symlink loop and a folder: SandboxError, never KeyError
        with pytest.raises(SandboxError):
            run(box.read_file(odd))


def test_timeout_and_what_outlives_it(box: DockerSandbox) -> None:
    result = run(box.exec("setsid sleep 1000 >/dev/null 2>&1 & sleep 1000", timeout_s=1))
    assert result.timed_out and "timed out after 1s" in result.output and result.duration_s < 30  # not the sleeps' 1000 s
    assert "sleep" not in run(box.exec("ps -eo user,comm | grep nobody")).output  # no process outlived it


def test_a_lost_exec_stream_is_told_from_an_empty_output_by_its_end_markers() -> None:
    """The engine now and then drops an exec's whole output (moby#27289; reproduced here once in 400
    `echo` commands beside a benchmark: exit code 0, no bytes), which graders read as "no marker" or "no
    test passed". The wrapper prints a fresh marker last on stdout and on stderr; this checks EndMarks on
    frames fed by hand (the engine's loss cannot be provoked on demand): a marker split across frames, a
    frame ending in what might start one, stderr that comes after stdout's marker, and bytes past a marker."""
    from rollway.sandboxes.docker import EndMarks
    from rollway.sandboxes.jail import OutputCapture

    marker = b"[rollway-end 0123abcd]"

    def fed(frames: list[tuple[int, bytes]], limit: int = 64) -> EndMarks:
        marks = EndMarks(marker, OutputCapture(limit))
        for stream, data in frames:
            for i in range(0, len(data), 7):  # in small frames, as the stream may come
                marks.feed(stream, data[i:i + 7])
        return marks

    for body in (b"", b"x", b"hi\n", b"a" * 20, b"a" * 40, b"a" * 500, b"[rollway-end 0123", b"x[r"):
        marks = fed([(1, body + marker), (2, marker)])
        whole = OutputCapture(64)
        whole.feed(body)  # the output alone
        capture = marks.finish()
        assert marks.ended and (capture.text(), capture.total, capture.omitted) == (whole.text(), whole.total,
                                                                                    whole.omitted), body
    late_err = fed([(1, b"out\n" + marker), (2, b"err\n"), (2, marker)])  # stderr's copy came later: whole
    assert late_err.ended and late_err.finish().text() == "out\nerr\n"
    after = fed([(1, b"a" + marker + b"late"), (2, marker + b"late" * 100)])  # past the markers: not output
    assert after.ended and after.finish().text() == "a"
    for lost in ([], [(1, b"hi\n")], [(1, b"hi\n" + marker)], [(2, marker)], [(1, b"x[rollway-end 01")]):
        marks = fed(lost)
        assert not marks.ended, lost
    held = fed([(1, b"x[rollway-end 01")])  # no marker came: what was held back is output after all
    assert held.finish().text() == "x[rollway-end 01"
    forged = fed([(1, b"hi[rollway-end ffffffff]"), (2, b"[rollway-end ffffffff]")])  # not this command's marker
    assert not forged.ended and forged.finish().text() == "hi[rollway-end ffffffff][rollway-end ffffffff]"
    interleaved = EndMarks(marker, OutputCapture(64))
    for stream, data in [(1, b"a\n"), (2, b"b\n"), (1, b"c\n"), (1, marker), (2, marker)]:
        interleaved.feed(stream, data)
    assert interleaved.finish().text() == "a\nb\nc\n"  # nothing held back that is not a marker's start


def test_outputs_keep_their_exact_bytes_and_a_command_that_kills_its_wrapper_is_not_an_engine_loss(
        box: DockerSandbox) -> None:
    """The end marker never shows in an output, and a command that kills every process of its user (the
    wrapper, which prints the marker, among them) gets its exit status back as before: an agent must not
    be able to turn its own tool call into an engine failure (an episode dropped instead of graded)."""
    assert run(box.exec("printf x")).output == "x"
    assert run(box.exec("printf 'a\\n\\n'")).output == "a\n\n"
    assert run(box.exec("true")).output == ""
    both = run(box.exec("echo out; echo err >&2; exit 3"))
    assert (both.exit_code, sorted(both.output.splitlines())) == (3, ["err", "out"]), both
    killed = run(box.exec("kill -9 -1; sleep 5"))
    assert killed.exit_code == 137 and "rollway-end" not in killed.output
    assert run(box.exec("echo after")).output == "after\n"


def test_output_written_after_the_end_marker_is_no_engine_loss(box: DockerSandbox) -> None:
    """A process that outlives its command and writes after the wrapper's end marker (a fork bomb's child
    caught mid-write by the wrapper's kill, seen once in CI; a [verifier] user's leftover, never killed by
    the wrapper) made the output not *end* with the marker: read as the engine losing it (OutputLost), an
    error the agent caused. The marker seen is the end; what comes after it is not the command's output."""
    late = run(box.exec_as("root", "(sleep 1; echo late; echo late >&2) & echo early"))
    assert (late.exit_code, late.output) == (0, "early\n"), late
    flood = run(box.exec_as("root", "(sleep 1; head -c 5000 /dev/zero | tr '\\0' x) & echo early"))
    assert (flood.exit_code, flood.output, flood.truncated) == (0, "early\n", False), flood


def test_the_end_marker_cannot_be_read_by_the_command(box: DockerSandbox) -> None:
    """The marker is what tells the command's end from a lost stream: a command that could read it could
    print it early and have the rest of its output (a grader's failing tests) taken as after its end.
    It is in no process's argv and not in the command's environment; the wrapper that holds it is not
    dumpable, so its environment cannot be read either."""
    look = ("grep -sa '[r]ollway-end' /proc/[0-9]*/cmdline /proc/[0-9]*/environ; "
            "env | grep '[r]ollway-end'; echo looked")
    for seen in (run(box.exec(look)), run(box.exec_as("root", look))):
        assert (seen.exit_code, seen.output) == (0, "looked\n"), seen


def test_output_flood_stops_the_exec_and_frees_its_socket(box: DockerSandbox, config: SandboxConfig) -> None:
    run(box.exec("yes"))  # warm the client's connection pool
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(8):
        result = run(box.exec("yes"))
        assert result.truncated and "[output truncated:" in result.output and len(result.output) < 1300
        assert "[command killed: more than" in result.output and result.duration_s < 30  # not the 60-s limit
    assert run(box.exec("pgrep -c yes || true")).output.strip() == "0"  # the exec was stopped
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds + 3  # no socket per flood left open (3: pool noise)


def test_output_that_arrived_with_the_upgrade_headers_is_read_whole(box: DockerSandbox, monkeypatch) -> None:
    """The client reads the exec's upgrade headers late (a loaded machine; forced here by a pause before
    http.client reads them, the only thing injected): the command's output has by then reached the socket and
    http.client buffers it with the headers. It must still be read (seen as "the engine lost the output", an
    OutputLost about once in 100 execs under load)."""
    import http.client
    import time

    real = http.client.HTTPResponse.begin

    def late_begin(self):
        time.sleep(0.5)
        return real(self)

    monkeypatch.setattr(http.client.HTTPResponse, "begin", late_begin)
    for i in range(3):
        result = run(box.exec(f"echo out-{i}"))
        assert (result.exit_code, result.output) == (0, f"out-{i}\n"), result


def test_attach_and_idempotent_destroy(box: DockerSandbox, config: SandboxConfig) -> None:
    again = run(DockerSandboxProvider(config).attach(box.handle))
    assert run(again.exec("cat extra.txt")).output == "e\n"
    run(again.destroy())
    run(box.destroy())
    with pytest.raises(SandboxError, match="gone"):
        run(DockerSandboxProvider(config).attach(box.handle))


def test_failed_setup_removes_the_container(config: SandboxConfig, prefix: str) -> None:
    with pytest.raises(SandboxError, match="setup command"):
        run(DockerSandboxProvider(config).create(SandboxSpec(setup_commands=["echo boom; false"]), prefix))


def test_missing_image_is_a_typed_error_that_names_the_fix(config: SandboxConfig, prefix: str) -> None:
    spec = SandboxSpec(image="rollway-no-such-image:1")
    with pytest.raises(SandboxError, match="not on this Docker engine .*rollway sandbox image build"):
        run(DockerSandboxProvider(config).create(spec, prefix))


def test_container_dying_mid_episode(box: DockerSandbox, client: docker.DockerClient) -> None:
    client.containers.get(box.container_id).kill()
    with pytest.raises(SandboxError, match="not running .*new sandbox"):
        run(box.exec("echo hi"))
    with pytest.raises(SandboxError, match="not running|gone"):
        run(box.read_file("extra.txt"))


class _EngineProxy:
    """Forwards a unix socket to the real engine's socket; `stop()` makes the engine vanish for its
    clients mid-run exactly as a stopped daemon does (connection refused), while the real engine
    (shared with every other test here) keeps running. This proxy is the only stand-in in this file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        self.server.listen(16)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect("/var/run/docker.sock")
            self.conns += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.server.close()
        os.unlink(self.path)
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_engine_stopping_mid_run(config: SandboxConfig, prefix: str, tmp_path: Path) -> None:
    proxy = _EngineProxy(str(tmp_path / "engine.sock"))
    provider = DockerSandboxProvider(config, docker.DockerClient(base_url=f"unix://{proxy.path}"))
    box = run(provider.create(SandboxSpec(), prefix))
    try:
        assert run(box.exec("echo up")).output == "up\n"
        proxy.stop()
        with pytest.raises(SandboxError, match="stopped answering .*setup-docker.sh"):
            run(box.exec("echo hi"))
    finally:
        run(
            DockerSandbox(DockerSandboxProvider(config), box.container_id, prefix).destroy()
        )  # the real engine


def test_unreachable_engine_names_the_fix(config: SandboxConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxError, match="setup-docker.sh"):
        run(DockerSandboxProvider(config).check())


def test_cli_check_exits_2_without_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    args = argparse.Namespace(config=None, overrides=[], type="docker", json=True)
    assert cmd_sandbox.run(args) == 2
    out = capsys.readouterr()
    assert json.loads(out.out)["ok"] is False and "sandbox.type=local" in out.err


def spy_on_sandbox_names(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the sandboxes this test runs commands in (the real exec, watched): other tests run the same
    check side by side under xdist, so a count by the shared `check-` prefix would see their live sandboxes."""
    from rollway.sandboxes.docker import USER, DockerSandbox

    names: set[str] = set()
    real = DockerSandbox._exec

    def watched(self, command, limits, user=USER):
        names.add(self.name)
        return real(self, command, limits, user)

    monkeypatch.setattr(DockerSandbox, "_exec", watched)
    return names


def test_cli_check_on_the_real_engine(client: docker.DockerClient, capsys: pytest.CaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    names = spy_on_sandbox_names(monkeypatch)
    args = argparse.Namespace(config=None, type="docker", json=True, overrides=[
        "sandbox.memory_mb=256", "sandbox.workspace_mb=64", "sandbox.max_file_mb=16", "sandbox.cpus=0.5"])  # fmt: skip
    code = cmd_sandbox.run(args)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["all_protections_hold"] is True, report
    assert names and sum(count_containers(n) for n in names) == 0  # every sandbox of the check was removed


def test_cli_check_runs_again_when_the_engine_loses_a_commands_output(
    client: docker.DockerClient, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's fault is injected (the only fake here): the first command of the first check sandbox
    raises what DockerSandbox raises when the engine drops an exec's output (moby#27289, seen failing the
    check above in a full suite run). The check runs again in a fresh sandbox and reports the real result."""
    from rollway.sandboxes.base import OutputLost
    from rollway.sandboxes.docker import USER, DockerSandbox

    real, lost, names = DockerSandbox._exec, [], set()

    def exec_losing_once(self, command, limits, user=USER):
        names.add(self.name)
        if not lost:
            lost.append(self.name)
            raise OutputLost(f"the Docker engine lost the output of a command in {self.name} (injected)")
        return real(self, command, limits, user)

    monkeypatch.setattr(DockerSandbox, "_exec", exec_losing_once)
    args = argparse.Namespace(config=None, type="docker", json=True, overrides=[
        "sandbox.memory_mb=256", "sandbox.workspace_mb=64", "sandbox.max_file_mb=16", "sandbox.cpus=0.5"])  # fmt: skip
    code = cmd_sandbox.run(args)
    out = capsys.readouterr()
    assert lost and "checking again" in out.err
    assert code == 0 and json.loads(out.out)["all_protections_hold"] is True, out.out
    # This test's sandboxes only: other tests run the same check side by side (seen: a count by the shared
    # `check-` prefix found another test's live sandbox, a container and its volume).
    assert lost[0] in names and sum(count_containers(n) for n in names) == 0


def test_task_image_built_from_the_base_with_pypi_packages(
    client: docker.DockerClient, config: SandboxConfig, prefix: str, capsys: pytest.CaptureFixture
) -> None:
    """`rollway sandbox image build` installs from PyPI at build time; the sandbox itself stays offline."""
    tag = f"rollway-test-task:{prefix}"
    args = argparse.Namespace(sandbox_command="image", tag=tag, pip=["toolz==1.0.0"], run=["echo ok > /etc/task"],
                              base=None)  # fmt: skip
    try:
        assert cmd_sandbox.run(args) == 0, capsys.readouterr().err
        box = run(DockerSandboxProvider(config).create(SandboxSpec(image=tag), prefix))
        try:
            out = run(box.exec("python3 -c 'import toolz; print(toolz.__version__)'; cat /etc/task")).output
            assert out == "1.0.0\nok\n"
        finally:
            run(box.destroy())
    finally:
        client.images.remove(tag, force=True)


def test_swe_tasks_in_containers_end_to_end(client: docker.DockerClient, broker, tmp_path: Path,
                                            toolz_one_task: Path) -> None:
    """SWE tasks built from toolz's source archive, in the default image: the gold patch resolves the
    task and the empty patch does not (tests run with the image's python and pytest); then `rollway up`
    with docker sandboxes resolves it through the pipeline (the scripted policy applies the gold patch
    with editor calls)."""
    import re
    import sys

    import yaml
    from test_envs_swe import editor_fix_calls

    from rollway.envs.config import TasksConfig
    from rollway.envs.factory import build_taskset
    from rollway.envs.swe import load_instances
    tasks = toolz_one_task  # built once per session (conftest.py); converted on load into a row over git
    instance = load_instances(tasks)[0]
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    taskset = build_taskset(TasksConfig(type="swe", path=str(tasks)), SandboxConfig(type="docker"))
    row = taskset.instances[instance["instance_id"]]  # graded in its instance image, built here
    gold = run(taskset.grade_patch(row, row.patch, provider))
    empty = run(taskset.grade_patch(row, "", provider))
    assert (gold.resolved, empty.resolved) == (True, False), (gold, empty)

    finish = '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'
    script = [
        {
            "when": re.escape(instance["FAIL_TO_PASS"][0]),
            "turns": [*editor_fix_calls(instance["patch"]), finish],
        }
    ]
    cfg = {"run": {"name": "swe-docker", "timeout_s": 400}, "tasks": {"type": "swe", "path": str(tasks)},
           "scheduler": {"group_size": 1, "episode_deadline_s": 300},
           "agent": {"max_turns": 6, "max_tokens_per_turn": 4096, "max_total_tokens": 100000},
           "sandbox": {"type": "docker"}, "policy": {"type": "scripted", "script": script}}  # fmt: skip
    (tmp_path / "swe.yaml").write_text(yaml.safe_dump(cfg))
    run_dir, run_id = tmp_path / "run", f"swed{uuid.uuid4().hex[:6]}"
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(tmp_path / "swe.yaml"), "--run-dir",
                          str(run_dir), "--bootstrap", broker.bootstrap, "runtime.processes=one", f"topics.prefix={run_id}-", f"run.id={run_id}"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    traj = json.loads((run_dir / "trajectories.jsonl").read_text().splitlines()[0])
    assert traj["resolved"] and traj["reward"] == 1.0
    # The episode's grading sandbox is named after the episode, so this counts it too (a global "grade-"
    # count would see other tests' gradings running beside this one).
    assert count_containers(run_id) == 0


def test_warm_pool_hands_out_started_containers_and_close_removes_the_idle_ones(
    client: docker.DockerClient, config: SandboxConfig, prefix: str
) -> None:
    provider = DockerSandboxProvider(config.model_copy(update={"warm_pool": 2}))

    async def go() -> None:
        first = await provider.create(SandboxSpec(files={"a.txt": "1\n"}), prefix)  # cold: starts the refill
        assert first.name == prefix
        for _ in range(100):
            if len(provider._pool.get(config.image, [])) == 2:
                break
            await asyncio.sleep(0.1)
        pooled = list(provider._pool[config.image])
        second = await provider.create(SandboxSpec(files={"a.txt": "2\n"}), f"{prefix}-2")
        assert (second.container_id, second.name) == pooled[0] and second.name.startswith("pool-")
        assert await second.read_file("a.txt") == "2\n" and (await second.exec("cat a.txt")).output == "2\n"
        assert await second.diff() == ""  # the pooled container got its own base snapshot
        for box in (first, second):
            await box.destroy()
        await provider.close()  # removes the idle pooled containers (the refill's included)

    run(go())
    assert pooled_containers_of({os.getpid()}) == []  # other tests' pools may run on the engine meanwhile


def test_smoke_job_in_containers_with_a_warm_pool_leaves_nothing(
    client: docker.DockerClient, tmp_path: Path
) -> None:
    """`rollway up` with docker sandboxes: every episode completes; the init stage's close removes its
    idle pooled containers and the reward stage every episode's container."""
    import sys

    run_dir = tmp_path / "run"
    proc = run_with_progress([sys.executable, "-m", "rollway.runners", "up", "--no-report", "examples/smoke.yaml", "--run-dir", str(run_dir),
                           "sandbox.type=docker", "sandbox.warm_pool=2", f"run.id=wp{uuid.uuid4().hex[:6]}"],
                          cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert proc.returncode == 0 and summary["episodes_completed"] == 8, proc.stderr[-3000:]
    # This run's pooled containers, by the init worker that started them (not every "pool-" container).
    init_pids = {json.loads(p.read_text())["pid"] for p in (run_dir / "status").glob("init-*.json")}
    assert init_pids and pooled_containers_of(init_pids) == []


def test_idle_pool_of_a_killed_worker_is_reaped_and_handed_out_containers_are_not(
    client: docker.DockerClient, config: SandboxConfig, prefix: str, tmp_path: Path
) -> None:
    """A SIGKILLed process cannot remove its warm pool; the next provider on this host removes the
    idle containers it left, and leaves alone a pooled container already handed to an episode."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(f"""
import asyncio, json
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.docker import DockerSandboxProvider
from rollway.sandboxes.base import SandboxSpec

async def main():
    provider = DockerSandboxProvider(SandboxConfig(type="docker", image={config.image!r}, warm_pool=2))
    await provider.create(SandboxSpec(), "{prefix}-cold")
    while len(provider._pool.get({config.image!r}, [])) < 2:
        await asyncio.sleep(0.1)
    taken = await provider.create(SandboxSpec(), "{prefix}-taken")
    while len(provider._pool.get({config.image!r}, [])) < 2:
        await asyncio.sleep(0.1)
    print(json.dumps([taken.container_id, [c for c, _ in provider._pool[{config.image!r}]]]), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
""")
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        taken_id, idle_ids = json.loads(worker.stdout.readline())
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    taken = client.containers.get(taken_id)
    assert taken.name == f"rollway-{prefix}-taken"  # renamed after its episode when handed out
    for container_id in idle_ids:
        assert client.containers.get(container_id).name.startswith("rollway-pool-")

    removed = DockerSandboxProvider(config).reap_orphaned_pool()
    assert len(removed) >= 2
    for container_id in idle_ids:
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(container_id)
    assert client.containers.get(taken_id).status == "running"  # an episode's container is never reaped
    # The episodes' own containers are the test's to remove (their reward stage would).
    provider = DockerSandboxProvider(config)
    for container in provider.listed(LABEL):  # other tests remove theirs meanwhile: the listing alone
        if any(name.startswith(f"/rollway-{prefix}") for name in container["Names"]):
            provider.remove(str(container["Id"]), container["Labels"][LABEL])


def test_removing_a_container_another_process_is_removing_waits_for_it_instead_of_failing(
    client: docker.DockerClient, config: SandboxConfig, prefix: str
) -> None:
    """Two processes reaping one orphaned pool (two init workers starting after a crash; in a parallel test
    run, a refill's reaper beside the killed-worker test's): the second removal got the engine's 409
    "removal ... already in progress", read as "not running", and the refill died of it. The removals here
    are the real engine's: one is started on a container whose writable layer holds many files (so its
    removal takes a while) and the provider's is sent while the engine reports it "removing"; the call is
    recorded to show that the engine did answer 409 (tried on a few containers if the first goes too fast)."""
    provider = DockerSandboxProvider(config)
    api = provider.client.api
    conflicts: list[str] = []
    remove_container = api.remove_container

    def recorded(*args: Any, **kwargs: Any) -> Any:
        try:
            return remove_container(*args, **kwargs)
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                conflicts.append(str(exc))
            raise

    api.remove_container = recorded  # type: ignore[method-assign]
    for attempt in range(5):
        name = f"{prefix}-busy{attempt}"
        client.volumes.create(name=f"rollway-{name}", labels={LABEL: name})
        busy = client.containers.run(config.image, ["sh", "-c", "mkdir -p /var/tmp/m && cd /var/tmp/m && "
                                                    "seq 1 10000 | xargs touch && touch /var/tmp/done && sleep 600"],
                                     detach=True, name=f"rollway-{name}", labels={LABEL: name},
                                     volumes={f"rollway-{name}": {"bind": "/workspace", "mode": "rw"}})
        for _ in range(600):  # the files written (an exec of `test -e`, the engine's own answer)
            if busy.exec_run(["test", "-e", "/var/tmp/done"]).exit_code == 0:
                break
        other = threading.Thread(target=client.api.remove_container, args=(busy.id,), kwargs={"force": True})
        other.start()
        status = ""
        for _ in range(2000):
            try:
                status = client.api.inspect_container(busy.id)["State"]["Status"]
            except docker.errors.NotFound:
                break
            if status == "removing":
                break
        if status == "removing":
            provider.remove(busy.id, name)  # raised SandboxError("destroy: ... is not running") before the fix
        other.join()
        provider.remove(busy.id, name)  # the volume, if the first removal came too late for it
        if conflicts:
            break
    assert conflicts and "in progress" in conflicts[0], "the engine never answered 409: the race was not staged"
    assert count_containers(prefix) == 0


def test_reaping_survives_a_pooled_container_removed_while_it_lists(
    client: docker.DockerClient, config: SandboxConfig, prefix: str
) -> None:
    """Another process closing its pool removes its containers while this provider's reaper lists the
    pooled ones (seen in a parallel test run: the refill died of NotFound and the pool never filled).
    The real engine removes a real labelled container between the listing and anything read of it
    after; the only thing staged is the order, through a wrapper on the client's listing call."""
    from rollway.sandboxes.docker import POOL_OWNER_LABEL

    other = client.containers.run(config.image, ["sleep", "60"], detach=True, name=f"rollway-{prefix}-other",
                                  labels={LABEL: f"{prefix}-other", POOL_OWNER_LABEL: f"{socket.gethostname()}:1"})
    provider = DockerSandboxProvider(config.model_copy(update={"warm_pool": 1}))
    api = provider.client.api
    listing = api.containers

    def list_then_lose_one(*args: Any, **kwargs: Any) -> Any:
        found = listing(*args, **kwargs)
        other.remove(force=True)  # gone before the reaper reads or removes it
        return found

    api.containers = list_then_lose_one  # type: ignore[method-assign]

    async def go() -> None:
        first = await provider.create(SandboxSpec(), prefix)  # cold: the refill reaps, then fills the pool
        for _ in range(200):
            if len(provider._pool.get(config.image, [])) == 1 or provider._refills[config.image].done():
                break
            await asyncio.sleep(0.1)
        refill = provider._refills[config.image]
        assert not (refill.done() and refill.exception()), refill.exception()
        assert len(provider._pool[config.image]) == 1
        await first.destroy()
        await provider.close()

    run(go())
