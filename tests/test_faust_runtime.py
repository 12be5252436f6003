"""The faust-streaming engine against the real embedded broker: outputs, dead letters, a dedup table
that survives a worker restart, and the smoke job with stages on Faust."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run
from test_stage_runtime import Forward, config, init_request, produce, read_all

from rollway.runners.faust_runtime import FaustStage, dedup_key, ensure_changelog_topics, run_faust_worker
from rollway.core.kafka import ensure_topics
from rollway.schemas import AgentStep, DeadLetter, decode, encode
from rollway.topics import AGENT_STEPS, DEAD_LETTERS, INIT_REQUESTS

pytestmark = pytest.mark.broker


class InitForward(Forward):
    """Forward under a deduplicated stage's name (init: one effect per (episode, attempt))."""

    name = "init"


async def start_worker(actor: Forward, cfg, bootstrap: str, group: str, run_dir: Path,
                       concurrency: int = 2) -> tuple[asyncio.Task, asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_faust_worker(actor, cfg, bootstrap, concurrency, group, run_dir, stop))
    return task, stop


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the faust worker"
        await asyncio.sleep(0.1)


def test_faust_worker_forwards_and_dead_letters_garbage(broker, topic_prefix, tmp_path):
    cfg = config(topic_prefix)

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        actor = Forward(fail_on="e3")
        task, stop = await start_worker(actor, cfg, broker.bootstrap, f"{topic_prefix}fwd", tmp_path)
        await produce(cfg, broker.bootstrap, INIT_REQUESTS,
                      [(b"e1", encode(init_request(1))), (b"bad", b"\xc1 garbage"),
                       (b"e2", encode(init_request(2))), (b"e3", encode(init_request(3))),
                       (b"e4", encode(init_request(4)))])
        steps = await read_all(cfg, broker.bootstrap, AGENT_STEPS, expect=3)
        dead = await read_all(cfg, broker.bootstrap, DEAD_LETTERS, expect=2)
        stop.set()
        await task
        return steps, dead

    steps, dead = run(scenario())
    assert sorted(r.key for r in steps) == [b"e1", b"e2", b"e4"]
    assert all(decode(r.value, AgentStep).turn == 0 for r in steps)
    letters = sorted((decode(r.value, DeadLetter) for r in dead), key=lambda d: d.reason)
    assert len(letters) == 2
    decode_letter, handler_letter = letters
    assert decode_letter.value == b"\xc1 garbage" and decode_letter.key == b"bad"
    assert decode_letter.reason.startswith("decode:") and decode_letter.source_topic == f"{topic_prefix}init-requests"
    assert decode_letter.offset >= 0 and decode_letter.stage == "forward"
    assert handler_letter.reason.startswith("handler: RuntimeError") and handler_letter.key == b"e3"
