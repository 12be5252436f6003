"""The faust-streaming engine against the real embedded broker: outputs, dead letters, a dedup table
that survives a worker restart, and the smoke job with stages on Faust."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import msgspec
import pytest
from aiokafka import AIOKafkaProducer
from conftest import ROOT, run
from jobs import run_with_progress

pytest.importorskip("faust", reason="the faust engine is an optional extra: pip install 'rollway[faust]' (dev has it)")
from test_stage_runtime import Forward, config, init_request, produce, read_all

from rollway.base.broker import BrokerConfig
from rollway.runtime.faust import (
    FaustStage,
    changelog_name,
    dedup_key,
    ensure_changelog_topics,
    faust_credentials,
    run_faust_worker,
)
from rollway.runtime.kafka import ensure_topics
from rollway.schemas import AgentStep, DeadLetter, EpisodeKey, decode, encode
from rollway.topics import AGENT_STEPS, DEAD_LETTERS, INIT_REQUESTS

pytestmark = pytest.mark.broker


async def start_worker(actor: Forward, cfg, bootstrap: str, group: str, run_dir: Path,
                       concurrency: int = 2) -> tuple[asyncio.Task, asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_faust_worker(actor, cfg, bootstrap, concurrency, group, run_dir, stop))
    return task, stop


def faust_state(stage) -> str:
    """Where a worker that handles nothing stands: its partitions and its tables' recovery."""
    try:
        recovery, consumer = stage.app.tables.recovery, stage.app.consumer
        return (f"assigned={sorted(str(tp) for tp in consumer.assignment())} "
                f"in_recovery={recovery.in_recovery} active_remaining={recovery.active_remaining_total()} "
                f"paused={sorted(str(tp) for tp in consumer._paused_partitions)} "
                f"active={sorted(str(tp) for tp in (consumer._active_partitions or ()))} "
                f"flow_active={consumer.flow_active} can_resume_flow={consumer.can_resume_flow.is_set()} "
                f"positions={fetch_positions(consumer)} read_offsets={dict(consumer._read_offset)} "
                f"committed={dict(consumer._committed_offset)} generation={stage.app.consumer_generation_id} "
                f"buffered={fetch_buffered(consumer)}")
    except Exception as err:  # noqa: BLE001 - a diagnostic only
        return f"(faust state unreadable: {err!r})"


def fetch_positions(consumer) -> dict:
    """The fetcher's next offset per assigned partition (None: not yet reset), read off its state."""
    state = consumer._thread._ensure_consumer()._fetcher._subscriptions.subscription.assignment
    out = {}
    for tp in state.tps:
        tp_state = state.state_value(tp)
        out[f"{tp.topic[-8:]}/{tp.partition}"] = tp_state._position if tp_state else None
    return out


def fetch_buffered(consumer) -> dict:
    """Records the fetcher holds, not yet handed to Faust, per partition."""
    records = consumer._thread._ensure_consumer()._fetcher._records
    return {f"{tp.topic[-8:]}/{tp.partition}": type(res).__name__ for tp, res in list(records.items())}


async def wait_for(predicate, timeout_s: float = 150.0, state=lambda: "") -> None:
    # Generous: a restarted member waits out the old one on Tansu (about 8 s idle, more under load; in
    # one full-suite run on a fresh clone the restarted worker got nothing for 48 s, past the old 60 s).
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for the faust worker {state()}"
        await asyncio.sleep(0.1)


async def run_until(stage, stop: asyncio.Event, predicate, timeout_s: float = 150.0, state=lambda: "") -> None:
    """Runs the stage until `predicate` holds, then stops it; a stall reports the stage's state."""
    task = asyncio.create_task(stage.run(stop))
    try:
        await wait_for(predicate, timeout_s, state=lambda: f"{state()} seen={stage.actor.seen} stats={stage.stats} "
                                                            f"{faust_state(stage)}")
    finally:
        stop.set()
        await task


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


def test_dedup_table_survives_a_worker_restart(broker, topic_prefix, tmp_path):
    """A second worker of the group rebuilds the handled set from the changelog and skips a
    redelivered (episode, attempt) while a new attempt of the same episode still runs."""
    cfg = config(topic_prefix, partitions=2)
    group = f"{topic_prefix}init"

    async def one_worker(items: list, expect_seen: int, expect_skipped: int) -> FaustStage:
        actor, stop = Forward(), asyncio.Event()
        stage = FaustStage(actor, cfg, broker.bootstrap, 2, group, tmp_path)
        await ensure_changelog_topics(cfg, broker.bootstrap, group, [INIT_REQUESTS])
        task = asyncio.create_task(stage.run(stop))
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(m.episode_id.encode(), encode(m)) for m in items])
        await wait_for(lambda: len(actor.seen) >= expect_seen and stage.stats["skipped_duplicates"] >= expect_skipped,
                       state=lambda: f"seen={actor.seen} stats={stage.stats} {faust_state(stage)}")
        stop.set()
        await task
        return stage

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        first = await one_worker([init_request(1), init_request(2), init_request(1)], 2, 1)
        first_try = init_request(2)
        retry = msgspec.structs.replace(first_try, episode=msgspec.structs.replace(first_try.episode, attempt=1))
        second = await one_worker([init_request(2), retry, init_request(5)], 2, 1)
        return first, second

    first, second = run(scenario())
    assert sorted(e for e, _ in first.actor.seen) == ["e1", "e2"]
    assert sorted(e for e, _ in second.actor.seen) == ["e2", "e5"]  # e2 is attempt 1 here
    assert second.stats["skipped_duplicates"] == 1 and second.stats["handled"] == 2


def test_a_table_whose_changelog_entries_share_one_batch_comes_back_whole(broker, topic_prefix, tmp_path):
    """The embedded broker answers ListOffsets with the last batch's base offset + 1, and Faust's table
    recovery reads a changelog up to that answer: two dedup entries written in one batch came back as
    one, and the restarted worker handled the other episode again. Here the changelog holds both
    entries in one batch (written as Faust writes them: JSON key, the time as the value)."""
    cfg = config(topic_prefix, partitions=2)
    group = f"{topic_prefix}init"
    items = [init_request(1), init_request(2), init_request(1)]  # keys e1 and e2 both hash to partition 1

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        await ensure_changelog_topics(cfg, broker.bootstrap, group, [INIT_REQUESTS])
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(m.episode_id.encode(), encode(m)) for m in items])
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=500)
        await producer.start()
        try:
            sent = [await producer.send(changelog_name(group, INIT_REQUESTS), b"1.0", key=key, partition=1)
                    for key in (b'"e1/0"', b'"e2/0"')]
            offsets = [(await f).offset for f in sent]
        finally:
            await producer.stop()
        actor, stop = Forward(), asyncio.Event()
        stage = FaustStage(actor, cfg, broker.bootstrap, 2, group, tmp_path)
        await run_until(stage, stop, lambda: stage.stats["skipped_duplicates"] + stage.stats["handled"] >= 3)
        return offsets, stage

    offsets, stage = run(scenario())
    assert offsets == [0, 1]
    assert stage.actor.seen == [] and stage.stats["skipped_duplicates"] == 3


def test_a_batch_dropped_as_the_flow_stops_is_read_again_by_a_group_with_no_commits(broker, topic_prefix, tmp_path):
    """A rebalance that begins while Faust's fetch loop waits stops the flow, and the batch the fetch
    then returns (already from the new assignment) is dropped; Faust seeks back to the committed
    offsets, but aiokafka's seek skips a partition with none. A fresh group's worker stood past its
    only messages and handled nothing (seen twice in ten full-suite runs, 150 s without progress).
    The race is forced here: the flow is stopped, as a revocation stops it, the moment the first
    fetch with input records returns; the broker, Faust and aiokafka are real."""
    cfg = config(topic_prefix, partitions=2)
    group = f"{topic_prefix}fresh"
    items = [init_request(i) for i in range(4)]

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        await ensure_changelog_topics(cfg, broker.bootstrap, group, [INIT_REQUESTS])
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(m.episode_id.encode(), encode(m)) for m in items])
        actor, stop = Forward(), asyncio.Event()
        stage = FaustStage(actor, cfg, broker.bootstrap, 2, group, tmp_path)
        consumer, inputs, dropped = stage.app.consumer, set(stage.specs), []
        fetch = consumer._wait_next_records

        async def fetch_then_revoke(timeout: float):
            records, active = await fetch(timeout)
            if not dropped and any(tp.topic in inputs for tp in records or {}):
                dropped.extend(r.offset for tp, batch in records.items() if tp.topic in inputs for r in batch)
                consumer.stop_flow()  # as on_partitions_revoked does
                asyncio.get_running_loop().call_later(0.5, consumer.resume_flow)  # as recovery's end does
            return records, active

        consumer._wait_next_records = fetch_then_revoke
        await run_until(stage, stop, lambda: stage.stats["handled"] >= len(items), timeout_s=60.0,
                        state=lambda: f"dropped={dropped}")
        return dropped, actor

    dropped, actor = run(scenario())
    assert dropped, "the forced race never happened: no fetch returned input records"
    assert sorted(e for e, _ in actor.seen) == sorted(m.episode_id for m in items)


def test_dedup_keys_and_credentials():
    assert dedup_key(init_request(7)) == "e7/0"
    assert dedup_key(AgentStep(episode=EpisodeKey(episode_id="e7", group_id="g", task_id="t"), turn=1, sandbox={})) is None
    assert faust_credentials(BrokerConfig()) is None
    sasl = faust_credentials(BrokerConfig(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                                          sasl_username="u", sasl_password="p"))
    assert (sasl.protocol.value, sasl.mechanism.value, sasl.password) == ("SASL_SSL", "SCRAM-SHA-512", "p")
    assert faust_credentials(BrokerConfig(security_protocol="SSL")).protocol.value == "SSL"


@pytest.mark.e2e
def test_smoke_job_with_reward_learner_and_sink_on_faust(tmp_path):
    run_dir = tmp_path / "run"
    out = run_with_progress(
        [sys.executable, "-m", "rollway.runners", "up", "--no-report", "examples/smoke.yaml", "runtime.engines.reward=faust",
         "runtime.engines.learner=faust", "runtime.engines.sink=faust", "--run-dir", str(run_dir)],
        cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes_scheduled"] == summary["episodes_completed"] == 8
    assert summary["episodes_failed"] == 0 and summary["trajectories_written"] == 8
    records = (run_dir / "learner-records.jsonl").read_text().splitlines()
    assert len({json.loads(line)["episode_id"] for line in records}) == len(records) == 8
    for stage in ("reward", "learner", "sink"):
        assert "faust stage worker started" in (run_dir / "logs" / f"{stage}-0.out").read_text()
    assert "faust stage worker" not in (run_dir / "logs" / "agent-0.out").read_text()


def test_dedup_table_is_bounded_by_tombstones_and_stays_so_after_restart(broker, topic_prefix, tmp_path, monkeypatch):
    """With a window of 2 keys per partition, older keys are deleted from the table and tombstoned in
    its changelog: a restarted worker restores only the newest keys, and still skips their repeats."""
    monkeypatch.setattr(FaustStage, "table_window", 2)
    cfg = config(topic_prefix, partitions=1)
    group = f"{topic_prefix}init"

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        await ensure_changelog_topics(cfg, broker.bootstrap, group, [INIT_REQUESTS])
        return [await one_worker([init_request(i) for i in range(5)]), await one_worker([init_request(4)])]

    async def one_worker(items: list) -> tuple[set, list]:
        actor, stop = Forward(), asyncio.Event()
        stage = FaustStage(actor, cfg, broker.bootstrap, 1, group, tmp_path)
        task = asyncio.create_task(stage.run(stop))
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(m.episode_id.encode(), encode(m)) for m in items])
        await wait_for(lambda: len(actor.seen) + stage.stats["skipped_duplicates"] >= len(items))
        # The key is written to the table after its handler returned: wait for the last one (and the
        # eviction it causes) before reading the table, not for the handler alone.
        await wait_for(lambda: dedup_key(items[-1]) in next(iter(stage.tables.values())).keys())
        snapshot = (set(next(iter(stage.tables.values())).keys()), list(actor.seen))
        stop.set()
        await task
        return snapshot

    (kept, seen_first), (restored, seen_second) = run(scenario())
    assert len(seen_first) == 5 and kept == {"e3/0", "e4/0"}
    assert restored == {"e3/0", "e4/0"}, "the changelog's tombstones must delete the old keys on restore"
    assert seen_second == [], "a kept key is still deduplicated after the restart"
