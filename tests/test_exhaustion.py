"""Shared resources an episode could exhaust on a worker: the gateway's connections and descriptors,
request sizes and read times, host threads blocked on special files, tool time limits.

Real gateway, real harness programs in the real bubblewrap jail, real local sandboxes; the scripted
policy (the model) is the only fake."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollway.actors.harness import HarnessRunner, KeepingRecorder
from rollway.gateway import Gateway, MemoryRecorder
from rollway.gateway.config import GatewayLimits, HarnessConfig
from rollway.policies.chat import BytesChatML
from rollway.policies.config import ScriptRule
from rollway.policies.scripted import ScriptedPolicy
from rollway.sandboxes.base import SandboxSpec
from rollway.sandboxes.config import LocalSandboxConfig
from rollway.sandboxes.local import LocalSandboxProvider
from rollway.schemas.messages import EpisodeKey

# One program for both episodes: the instruction says whether it attacks or behaves.
PROGRAM = r'''
import json, os, resource, socket, sys, time, urllib.request
if sys.argv[1] == "honest":
    for i in range(2):
        req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps({
            "model": "m", "messages": [{"role": "user", "content": "call %d" % i}]}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
        print(json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]["message"]["content"])
    sys.exit(0)
try:  # take every descriptor the jail allows
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
except (ValueError, OSError):
    pass
for _ in range(7):  # several processes: a per-process descriptor limit alone does not bound the gateway
    if os.fork() == 0:
        break
held = []
path = ".rollway/gateway.sock" if os.path.exists(".rollway/gateway.sock") else "/rollway-gateway/gateway.sock"
for _ in range(1500):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)  # blocking: waits while the listen backlog is full
        held.append(s)
    except OSError:
        s.close()
        break
time.sleep(3600)
'''


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("kind", ["local", "docker"])
def test_a_harness_episode_holding_thousands_of_connections_leaves_the_other_episodes_served(tmp_path, kind):
    """The attack of issue 39: one harness episode opens thousands of connections to its gateway
    socket and holds them. Its open connections stay at the limit, the worker's descriptors stay
    bounded, and another episode's calls are answered while the attacker is still running. In the
    local jail and in Docker containers (the socket's folder bound into each)."""
    source = tmp_path / "task"
    source.mkdir()
    (source / "README").write_text("task\n")
    limits = GatewayLimits(max_connections=16, max_refused=10**6)  # the attacker keeps going
    cfg = HarnessConfig(command=["python3", "-c", PROGRAM, "{instruction}"], time_limit_s=600, silence_limit_s=600,
                        limits=limits)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The worker's descriptor limit (often 1024..65536): low enough here that the attack can reach it.
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
    try:
        attacker, honest = asyncio.run(_attack_and_serve(tmp_path, source, cfg, kind))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert honest["stop_reason"] == "harness_exit", honest
    assert honest["calls"] == 2 and honest["finished_while_attacked"], honest
    assert attacker["peak_connections"] <= 16 and attacker["refused"] > 0, attacker
    assert attacker["peak_descriptors"] - attacker["baseline"] < 300, attacker


def _provider(tmp_path: Path, kind: str):
    if kind == "local":
        return LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path / "boxes")))
    from docker_engine import ensure_engine

    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.docker import DockerSandboxProvider

    ensure_engine()
    return DockerSandboxProvider(SandboxConfig(type="docker", gateway_root=str(tmp_path / "gateway")))


async def _attack_and_serve(tmp_path: Path, source: Path, cfg: HarnessConfig, kind: str) -> tuple[dict, dict]:
    engine = ScriptedPolicy([ScriptRule(turns=["fine"])], BytesChatML())
    gateway = Gateway(engine, BytesChatML(), KeepingRecorder(MemoryRecorder()), limits=cfg.limits)
    await gateway.start()
    runner = HarnessRunner(cfg, gateway, gateway.recorder)
    provider = _provider(tmp_path, kind)
    tag = f"exhaust-{os.getpid()}"
    box_a = await provider.create(SandboxSpec(source_dir=str(source)), f"{tag}-a")
    box_b = await provider.create(SandboxSpec(source_dir=str(source)), f"{tag}-b")
    baseline = _open_descriptors()
    stats = {"baseline": baseline, "peak_descriptors": baseline, "peak_connections": 0}

    async def watch() -> None:
        while True:
            stats["peak_descriptors"] = max(stats["peak_descriptors"], _open_descriptors())
            for handle in gateway.episodes.values():
                if handle.episode.episode_id == "attacker":
                    stats["peak_connections"] = max(stats["peak_connections"], handle.connections)
                    stats["refused"] = handle.refused
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    key = EpisodeKey(episode_id="attacker", group_id="g", task_id="t")
    attack = asyncio.create_task(runner.play(key, "attack", box_a, []))
    deadline = time.monotonic() + 300
    # The attack is under way: thousands of connections made (held or refused). Watched from the gateway:
    # a command in a container while its program runs would be the sandbox's own, not the attacker's.
    while stats.get("refused", 0) + stats["peak_connections"] < 2000 and not attack.done():
        assert time.monotonic() < deadline, "the attacking program never finished opening connections"
        await asyncio.sleep(0.2)
    honest = {}
    try:
        outcome = await asyncio.wait_for(
            runner.play(EpisodeKey(episode_id="honest", group_id="g", task_id="t"), "honest", box_b, []), 300)
        honest = {"stop_reason": outcome.stop_reason, "calls": len(outcome.turns),
                  "finished_while_attacked": not attack.done()}
    except Exception as err:  # noqa: BLE001 - reported by the assertion
        honest = {"stop_reason": f"{type(err).__name__}: {err}"}
    finally:
        attack.cancel()
        await asyncio.gather(attack, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await runner.close()
        for box in (box_a, box_b):
            await box.destroy()
        await provider.close()
    return stats, honest


def test_an_episode_that_keeps_making_refused_connections_is_ended_at_its_refusal_limit(tmp_path):
    """Refused connections count against the episode: past `max_refused` it ends with
    `harness_refused_limit`, instead of keeping the gateway busy accepting and closing."""
    source = tmp_path / "task"
    source.mkdir()
    (source / "README").write_text("task\n")
    cfg = HarnessConfig(command=["python3", "-c", PROGRAM, "{instruction}"], time_limit_s=600, silence_limit_s=600,
                        limits=GatewayLimits(max_connections=4, max_refused=50))

    async def scenario() -> tuple[str, int]:
        gateway = Gateway(ScriptedPolicy([ScriptRule(turns=["fine"])], BytesChatML()), BytesChatML(),
                          KeepingRecorder(MemoryRecorder()), limits=cfg.limits)
        await gateway.start()
        runner = HarnessRunner(cfg, gateway, gateway.recorder)
        box = await LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path / "boxes"))).create(
            SandboxSpec(source_dir=str(source)), "refused-1")
        try:
            outcome = await asyncio.wait_for(runner.play(EpisodeKey(episode_id="a", group_id="g", task_id="t"),
                                                         "attack", box, []), 300)
            return outcome.stop_reason, next(iter(gateway.episodes.values())).refused
        finally:
            await runner.close()
            await box.destroy()

    stop_reason, refused = asyncio.run(scenario())
    assert stop_reason == "harness_refused_limit"
    assert refused >= 50


async def _gateway_with_episode(**limits) -> tuple[Gateway, object, str]:
    gateway = Gateway(ScriptedPolicy([ScriptRule(turns=["fine"])], BytesChatML()), BytesChatML(), MemoryRecorder(),
                      limits=GatewayLimits(**limits))
    await gateway.start()
    handle = gateway.open_episode(EpisodeKey(episode_id="e", group_id="g", task_id="t"))
    return gateway, handle, f"/e/{handle.token}/v1/chat/completions"


async def _exchange(port: int, data: bytes, read_timeout_s: float = 120) -> bytes:
    """Send raw bytes, read until the gateway closes the connection (or `read_timeout_s`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), read_timeout_s)
    finally:
        writer.close()


def test_a_body_larger_than_the_limit_is_refused_from_its_header_before_it_is_read():
    """A request that announces a 1 GiB body gets 413 at once: the gateway reads none of it (the test
    sends none) and counts the refusal against the episode, and in its metrics by status."""
    from rollway.runtime.metrics import REGISTRY

    def refusals_413() -> float:
        return REGISTRY.get_sample_value("rollway_gateway_refusals_total", {"stage": "agent", "code": "413"}) or 0.0

    before = refusals_413()

    async def scenario() -> tuple[bytes, int]:
        gateway, handle, path = await _gateway_with_episode(max_request_bytes=1 << 20)
        try:
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {1 << 30}\r\n\r\n").encode()
            return await _exchange(gateway.port, head), handle.refused
        finally:
            await gateway.stop()

    answer, refused = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 413") and b"max_request_bytes" in answer
    assert refused == 1 and refusals_413() == before + 1


def test_a_body_without_a_length_is_cut_off_at_the_limit():
    """Chunked bodies announce no size: reading stops at the limit (413), not at the end of memory."""

    async def scenario() -> tuple[bytes, int]:
        gateway, handle, path = await _gateway_with_episode(max_request_bytes=64 << 10)
        try:
            chunk = b"x" * 32768
            body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n").encode()
            return await _exchange(gateway.port, head + body), handle.refused
        finally:
            await gateway.stop()

    answer, refused = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert refused == 1


def test_a_connection_that_never_finishes_its_request_head_is_closed_at_the_header_limit():
    """Slowloris: a request head sent a byte at a time (and an idle connection) is closed once the
    header limit passes, however much it trickles."""

    async def scenario() -> tuple[float, float]:
        gateway, _handle, path = await _gateway_with_episode(header_timeout_s=2)
        try:
            started = time.monotonic()
            idle = await _exchange(gateway.port, b"")
            idle_s = time.monotonic() - started
            reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
            started = time.monotonic()
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Pad: ".encode() + b"a" * 4000
            closed_after = None
            for byte in head:
                writer.write(bytes([byte]))
                try:
                    await writer.drain()
                except ConnectionError:
                    break
                if reader.at_eof() or writer.is_closing():
                    break
                await asyncio.sleep(0.01)
                if await _closed(reader):
                    break
            closed_after = time.monotonic() - started
            writer.close()
            assert idle == b""
            return idle_s, closed_after
        finally:
            await gateway.stop()

    idle_s, trickle_s = asyncio.run(scenario())
    assert idle_s < 60  # closed by the gateway (2 s limit), long before the read's own 120 s
    assert trickle_s < 30  # 4000 bytes at 10 ms each would take 40 s


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.001) == b""
    except TimeoutError:
        return False


def test_a_body_that_trickles_in_is_refused_at_the_body_limit():
    async def scenario() -> tuple[bytes, int]:
        gateway, handle, path = await _gateway_with_episode(body_timeout_s=1)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
            writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Content-Length: 100\r\n\r\n{").encode())
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 120)  # the rest of the body never comes
            writer.close()
            return answer, handle.refused
        finally:
            await gateway.stop()

    answer, refused = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in answer
    assert refused == 1


# -- special files in the workspace ------------------------------------------------------------------


def _fifo_sandbox(tmp_path: Path, name: str):
    """A real local sandbox whose agent (in the jail) made FIFOs and links where source files belong."""
    from rollway.sandboxes.local import LocalSandboxProvider

    source = tmp_path / f"src-{name}"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "core.py").write_text("def parse(text):\n    return text\n")
    (source / "answer.txt").write_text("3\n")
    sandbox = asyncio.run(LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path / "boxes"))).create(
        SandboxSpec(source_dir=str(source)), name))
    made = asyncio.run(sandbox.exec("mkfifo helpers.py pkg/zz_fifo.py answer2.txt && ln -s /etc/passwd pkg/leak.py "
                                    "&& ln -s /etc outside && ln -s pkg inside"))
    assert made.exit_code == 0, made.output
    return sandbox


def _release_fifos(workspace: str) -> None:
    """Open each FIFO for writing and close it: a reader blocked on one (before the fix) gets EOF."""
    for path in Path(workspace).rglob("*"):
        if path.is_fifo():
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def test_search_skips_fifos_and_links_named_like_source_files(tmp_path):
    """`mkfifo helpers.py` then `search`: the host thread parsing the workspace must not block on the
    FIFO (it blocked forever and wedged the agent stage), and links are not followed out."""
    from rollway.tools.base import outside_episode
    from rollway.tools.search import SearchTool

    sandbox = _fifo_sandbox(tmp_path, "fifo-search")
    try:
        async def search(arguments: dict) -> str:
            return (await asyncio.wait_for(SearchTool().call(arguments, sandbox, outside_episode()), 120)).content

        found = asyncio.run(search({"action": "definition", "name": "parse"}))
        outline = asyncio.run(search({"action": "outline", "path": "pkg"}))
        through_link = asyncio.run(search({"action": "outline", "path": "inside"}))
    finally:
        _release_fifos(sandbox.workspace_path)
        asyncio.run(sandbox.destroy())
    assert "pkg/core.py:1" in found
    assert "root:" not in outline and "leak" not in outline
    assert "core.py" in through_link  # a link that stays inside the workspace is still followed


def test_reading_or_writing_a_fifo_or_a_link_out_fails_at_once_with_what_it_is(tmp_path):
    """Sandbox.read_file / write_file from the host (the editor, graders): a FIFO is refused, not
    opened (a grader reading `answer2.txt` would block forever); a link out of the workspace too."""
    from rollway.sandboxes.base import SandboxError

    sandbox = _fifo_sandbox(tmp_path, "fifo-read")

    async def attempts() -> list[str]:
        errors = []
        for call in (sandbox.read_file("answer2.txt"), sandbox.write_file("helpers.py", "x = 1\n"),
                     sandbox.read_file("pkg/leak.py"), sandbox.write_file("outside/hosts", "pwned\n")):
            try:
                await asyncio.wait_for(call, 60)
                errors.append("no error")
            except SandboxError as err:
                errors.append(str(err))
        return errors

    try:
        errors = asyncio.run(attempts())
        read_back = asyncio.run(sandbox.read_file("answer.txt"))
        asyncio.run(sandbox.write_file("pkg/new/made.py", "y = 2\n"))
        made = asyncio.run(sandbox.exec("cat pkg/new/made.py && echo more >> pkg/new/made.py"))
    finally:
        _release_fifos(sandbox.workspace_path)
        asyncio.run(sandbox.destroy())
    assert "FIFO" in errors[0] and "FIFO" in errors[1], errors
    assert "no error" not in errors, errors
    assert read_back == "3\n"
    assert made.exit_code == 0 and "y = 2" in made.output  # written files stay the jail user's to edit


# -- time limits: tool calls and the whole run -------------------------------------------------------

WEDGE_TOOL = '''
import asyncio, threading, time
from rollway.tools.base import Tool, ToolResult


class Wedge(Tool):
    """A tool stuck for good: in a thread of the loop's shared pool, or in the event loop itself."""

    name = "wedge"
    description = "Get stuck."
    parameters = {"type": "object", "properties": {"how": {"type": "string"}}, "required": ["how"]}

    def __init__(self, cfg=None):
        self.cfg = cfg

    async def call(self, arguments, sandbox, context):
        if arguments["how"] == "thread":
            await asyncio.to_thread(threading.Event().wait)
        else:
            time.sleep(3600)
        return ToolResult("done")
'''


def _wedged_run(tmp_path: Path, how: str, timeout_s: float) -> tuple[subprocess.CompletedProcess, float, Path]:
    (tmp_path / "wedge.py").write_text(WEDGE_TOOL)
    call = f'<tool_call>{{"name": "wedge", "arguments": {{"how": "{how}"}}}}</tool_call>'
    job = {"run": {"name": "wedged", "timeout_s": timeout_s},
           "tasks": {"type": "toy", "count": 1},
           "scheduler": {"group_size": 1, "max_attempts": 1},
           "agent": {"max_turns": 2},
           "tools": {"enabled": [f"python:{tmp_path / 'wedge.py'}:Wedge", "finish"], "call_timeout_s": 5,
                     "bash_timeout_s": 2},
           "policy": {"type": "scripted", "chat_format": "bytes-chatml",
                      "script": [{"when": "", "turns": [call, '<tool_call>{"name": "finish", "arguments": {}}</tool_call>']}]}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(tmp_path / "job.yaml"),
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=timeout_s + 300)
    return out, time.monotonic() - started, run_dir


def test_a_tool_stuck_in_a_thread_times_out_and_the_run_still_ends(tmp_path):
    """A tool call stuck in a blocking call gets an error observation at tools.call_timeout_s and the
    episode goes on; the stuck thread does not keep `rollway up` from exiting once the job is done."""

    out, wall_s, run_dir = _wedged_run(tmp_path, "thread", 600)
    assert out.returncode == 0, out.stderr[-3000:]
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 1
    observation = json.dumps(trajs[0]["turns"][0])
    assert "did not finish within its time limit" in observation
    assert wall_s < 400  # the job took seconds; the process ended within its exit grace after it


def test_run_timeout_ends_a_run_whose_stage_is_wedged_and_the_run_folder_says_why(tmp_path):
    """A stage stuck in a blocking call on its event loop (no await ever returns): run.timeout_s still
    ends `rollway up`, with a non-zero exit and job-failed.json naming the limit."""

    out, wall_s, run_dir = _wedged_run(tmp_path, "loop", 40)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "run.timeout_s" in json.loads((run_dir / "job-failed.json").read_text())["reason"]
    assert wall_s < 40 + 200


# -- descriptor limits inside sandboxes --------------------------------------------------------------


def test_each_process_in_a_local_jail_has_a_descriptor_limit_it_cannot_raise(tmp_path):
    from rollway.sandboxes.local import LocalSandboxProvider

    source = tmp_path / "src"
    source.mkdir()
    provider = LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path / "boxes"), max_open_files=256))
    sandbox = asyncio.run(provider.create(SandboxSpec(source_dir=str(source)), "nofile-1"))
    try:
        out = asyncio.run(sandbox.exec("ulimit -n; ulimit -Hn; ulimit -n 100000 2>&1 || echo refused")).output
    finally:
        asyncio.run(sandbox.destroy())
    assert out.split()[:2] == ["256", "256"] and "refused" in out, out


def test_each_process_in_a_docker_sandbox_has_a_descriptor_limit_and_fifos_are_not_read(tmp_path):
    """The container's nofile ulimit, and read_file of a FIFO the agent made (through the engine's
    archive API) fails at once instead of blocking."""
    from docker_engine import ensure_engine

    from rollway.sandboxes.base import SandboxError
    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.docker import DockerSandboxProvider

    ensure_engine()
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.txt").write_text("a\n")
    provider = DockerSandboxProvider(SandboxConfig(type="docker", max_open_files=256, exec_timeout_s=60))
    sandbox = asyncio.run(provider.create(SandboxSpec(source_dir=str(source)), f"nofile-{os.getpid()}"))
    try:
        out = asyncio.run(sandbox.exec("ulimit -n; ulimit -Hn; mkfifo pipe.txt && echo made")).output

        async def read_fifo() -> str:
            try:
                return await asyncio.wait_for(sandbox.read_file("pipe.txt"), 120)
            except SandboxError as err:
                return f"refused: {err}"

        fifo = asyncio.run(read_fifo())
    finally:
        asyncio.run(sandbox.destroy())
    assert out.split()[:3] == ["256", "256", "made"], out
    assert fifo.startswith("refused") or fifo == "", fifo
