"""Redeliveries rollway expects are skipped quietly: a finished episode's turns delivered again (a
worker crashed after producing, before committing) leave nothing in dead-letters or
episode-failures. Real embedded broker, real bubblewrap sandboxes, the real agent stage; only the
model is faked (the scripted policy)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from conftest import ROOT, run
from test_actors import play_seen
from test_stage_runtime import produce

from rollway.actors.agent import AgentActor
from rollway.actors.services import Services
from rollway.config.run import RunConfig, load_config
from rollway.runtime.kafka import ensure_topics, topic_name
from rollway.runtime.worker import LogReader, StageWorker
from rollway.schemas import AgentStep, EpisodeKey, encode
from rollway.topics import AGENT_STEPS, DEAD_LETTERS, EPISODE_FAILURES, REWARD_REQUESTS

pytestmark = pytest.mark.broker


async def play_finished_episode(s: Services) -> list[AgentStep]:
    """init -> agent turns -> reward (which tears the sandbox down); the agent-steps it produced,
    in order, handled as if at offsets 0, 1, ... of a one-partition topic."""
    traj, seen = await play_seen(s, EpisodeKey(episode_id="s-g0-s0", group_id="s-g0", task_id="toy-001"))
    steps = [m for m in seen if isinstance(m, AgentStep)]
    assert traj.reward == 1.0 and not Path(steps[0].sandbox["path"]).exists()
    return steps


async def committed(cfg: RunConfig, bootstrap: str, group: str) -> int | None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        return await consumer.committed(TopicPartition(topic_name(AGENT_STEPS, cfg.topics), 0))
    finally:
        await consumer.stop()


async def log_ends(cfg: RunConfig, bootstrap: str, *specs) -> int:
    """Records in these topics, all partitions together."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        await consumer.topics()
        tps = [TopicPartition(topic_name(s, cfg.topics), p) for s in specs
               for p in consumer.partitions_for_topic(topic_name(s, cfg.topics)) or ()]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


def test_finished_episodes_redelivered_turns_are_skipped_quietly(broker, topic_prefix, tmp_path):
    """Every turn of a graded episode is delivered again to a fresh agent worker: turn 0 finds a later
    turn in the log, middle turns too, and the last turn finds its sandbox destroyed by grading.
    None of it is a poison message: no dead letter, no episode failure, the offsets are committed."""
    cfg = load_config(ROOT / "examples" / "smoke.yaml",
                      [f"topics.prefix={topic_prefix}", "topics.default_partitions=1", "broker.connect_timeout_s=10"])
    s = Services(cfg, tmp_path / "run")
    group = f"{topic_prefix}agent"

    async def scenario():
        steps = await play_finished_episode(s)
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        await produce(cfg, broker.bootstrap, AGENT_STEPS, [(m.episode_id.encode(), encode(m)) for m in steps])
        reader, stop = LogReader(cfg, broker.bootstrap), asyncio.Event()
        worker = StageWorker(AgentActor(s, reader), cfg, broker.bootstrap, 1, group)
        task = asyncio.create_task(worker.run(stop))
        try:
            deadline = time.monotonic() + 60
            while await committed(cfg, broker.bootstrap, group) != len(steps):
                assert time.monotonic() < deadline and not task.done(), "the redelivered turns were not committed"
                await asyncio.sleep(0.2)
        finally:
            stop.set()
            await task
            await reader.close()
        return worker.stats, await log_ends(cfg, broker.bootstrap, DEAD_LETTERS, EPISODE_FAILURES, REWARD_REQUESTS)

    try:
        stats, written = run(scenario())
    finally:
        run(s.close())
    assert stats["dead_lettered"] == 0 and written == 0, "a stale redelivery was treated as a poison message"
