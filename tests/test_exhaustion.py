"""Shared resources an episode could exhaust on a worker: the gateway's connections and descriptors,
request sizes and read times, host threads blocked on special files, tool time limits.

Real gateway, real harness programs in the real bubblewrap jail, real local sandboxes; the scripted
policy (the model) is the only fake."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time
from pathlib import Path

import pytest

from rollway.actors.harness import KeepingRecorder, HarnessRunner
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
for _ in range(1500):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(".rollway/gateway.sock")  # blocking: waits while the listen backlog is full
        held.append(s)
    except OSError:
        s.close()
        break
open("opened-%d" % os.getpid(), "w").write(str(len(held)))
time.sleep(3600)
'''


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_harness_episode_holding_thousands_of_connections_leaves_the_other_episodes_served(tmp_path):
    """The attack of issue 39: one harness episode opens thousands of connections to its gateway
    socket and holds them. Its open connections stay at the limit, the worker's descriptors stay
    bounded, and another episode's calls are answered while the attacker is still running."""
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
        attacker, honest = asyncio.run(_attack_and_serve(tmp_path, source, cfg))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert honest["stop_reason"] == "harness_exit", honest
    assert honest["calls"] == 2 and honest["finished_while_attacked"], honest
    assert attacker["peak_connections"] <= 16 and attacker["refused"] > 0, attacker
    assert attacker["peak_descriptors"] - attacker["baseline"] < 300, attacker


async def _attack_and_serve(tmp_path: Path, source: Path, cfg: HarnessConfig) -> tuple[dict, dict]:
    engine = ScriptedPolicy([ScriptRule(turns=["fine"])], BytesChatML())
    gateway = Gateway(engine, BytesChatML(), KeepingRecorder(MemoryRecorder()), limits=cfg.limits)
    await gateway.start()
    runner = HarnessRunner(cfg, gateway, gateway.recorder)
    provider = LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path / "boxes")))
    box_a = await provider.create(SandboxSpec(source_dir=str(source)), "exhaust-a")
    box_b = await provider.create(SandboxSpec(source_dir=str(source)), "exhaust-b")
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
    workspace = Path(box_a.workspace_path)
    deadline = time.monotonic() + 300
    # All eight attacking processes have opened (or been refused) what they could, or the attacker ended.
    while len(list(workspace.glob("opened-*"))) < 8 and not attack.done():
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
    sends none) and counts the refusal against the episode."""

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
    assert refused == 1


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
