"""The stage runtime against the real embedded broker: dead letters, consumer groups, commits."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from conftest import run

from rollway.actors.agent import AgentActor
from rollway.base.broker import BrokerConfig
from rollway.config.run import RunConfig
from rollway.runtime.actor import Actor, MessageMeta, Output
from rollway.runtime.kafka import BrokerUnavailable, ensure_topics, make_producer, topic_name
from rollway.runtime.queue import KeyLocks
from rollway.runtime.worker import LogReader, StageWorker
from rollway.schemas import AgentStep, DeadLetter, EpisodeKey, InitRequest, decode, encode
from rollway.topics import AGENT_STEPS, DEAD_LETTERS, INIT_REQUESTS

pytestmark = pytest.mark.broker


class Forward(Actor):
    """Turns init-requests into turn-0 agent-steps and remembers what it saw."""

    name = "forward"
    inputs = (INIT_REQUESTS,)

    def __init__(self, fail_on: str | None = None):
        self.seen: list[tuple[str, int]] = []
        self.fail_on = fail_on

    async def handle(self, msg: InitRequest, meta: MessageMeta) -> list[Output]:
        if msg.episode_id == self.fail_on:
            raise RuntimeError("this episode breaks the handler")
        self.seen.append((msg.episode_id, meta.partition))
        return [Output(AGENT_STEPS, msg.episode_id, AgentStep(
            episode=msg.episode, turn=0, sandbox={}))]


def config(prefix: str, partitions: int = 4) -> RunConfig:
    return RunConfig.model_validate({"topics": {"prefix": prefix, "default_partitions": partitions},
                                     "broker": {"connect_timeout_s": 10}})


def init_request(i: int) -> InitRequest:
    return InitRequest(episode=EpisodeKey(episode_id=f"e{i}", group_id="g", task_id="t"), issued_at=time.time(), deadline=time.time() + 60)


async def read_all(cfg: RunConfig, bootstrap: str, spec, expect: int, timeout_s: float = 20.0) -> list:
    consumer = AIOKafkaConsumer(topic_name(spec, cfg.topics), bootstrap_servers=bootstrap,
                                auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    out = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < expect and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                out += records
    finally:
        await consumer.stop()
    return out


async def produce(cfg: RunConfig, bootstrap: str, spec, items: list[tuple[bytes | None, bytes]]) -> None:
    producer = await make_producer(cfg.broker, bootstrap)
    try:
        for key, value in items:
            await producer.send_and_wait(topic_name(spec, cfg.topics), value, key=key)
    finally:
        await producer.stop()


def test_garbage_goes_to_dead_letters_and_the_stage_keeps_running(broker, topic_prefix):
    cfg = config(topic_prefix)

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        actor, stop = Forward(fail_on="e3"), asyncio.Event()
        worker = StageWorker(actor, cfg, broker.bootstrap, concurrency=4, group_id=f"{topic_prefix}fwd")
        task = asyncio.create_task(worker.run(stop))
        await produce(cfg, broker.bootstrap, INIT_REQUESTS,
                      [(b"e1", encode(init_request(1))), (b"bad", b"\xc1 garbage"), (b"e2", encode(init_request(2))),
                       (b"e3", encode(init_request(3)))])
        steps = await read_all(cfg, broker.bootstrap, AGENT_STEPS, expect=2)
        dead = await read_all(cfg, broker.bootstrap, DEAD_LETTERS, expect=2)
        stop.set()
        await task
        return steps, dead

    steps, dead = run(scenario())
    assert sorted(r.key for r in steps) == [b"e1", b"e2"]
    letters = sorted((decode(r.value, DeadLetter) for r in dead), key=lambda d: d.reason)
    assert len(letters) == 2
    decode_letter, handler_letter = letters
    assert decode_letter.value == b"\xc1 garbage" and decode_letter.key == b"bad"
    assert decode_letter.reason.startswith("decode:") and decode_letter.source_topic.endswith("init-requests")
    assert decode_letter.offset >= 0 and decode_letter.stage == "forward"
    assert handler_letter.reason.startswith("handler: RuntimeError") and handler_letter.key == b"e3"


def test_two_workers_split_the_partitions_and_commits_survive_restart(broker, topic_prefix):
    cfg = config(topic_prefix, partitions=4)
    group = f"{topic_prefix}fwd"

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        a, b, stop = Forward(), Forward(), asyncio.Event()
        tasks = [asyncio.create_task(StageWorker(x, cfg, broker.bootstrap, 2, group).run(stop)) for x in (a, b)]
        await asyncio.sleep(3)  # let the group settle on two members
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(f"e{i}".encode(), encode(init_request(i))) for i in range(40)])
        deadline = time.monotonic() + 30
        while len(a.seen) + len(b.seen) < 40 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*tasks)
        # A new worker of the same group starts after the committed offsets: nothing is handled twice.
        c, stop2 = Forward(), asyncio.Event()
        t = asyncio.create_task(StageWorker(c, cfg, broker.bootstrap, 2, group).run(stop2))
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(b"late", encode(init_request(99)))])
        deadline = time.monotonic() + 20
        while not c.seen and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop2.set()
        await t
        return a.seen, b.seen, c.seen

    seen_a, seen_b, seen_c = run(scenario())
    ids_a, ids_b = {e for e, _ in seen_a}, {e for e, _ in seen_b}
    assert ids_a | ids_b == {f"e{i}" for i in range(40)}
    assert not ids_a & ids_b, "a message was handled by both workers"
    assert ids_a and ids_b, "one worker got no partitions"
    assert not {p for _, p in seen_a} & {p for _, p in seen_b}
    assert [e for e, _ in seen_c] == ["e99"]


class DoneAfterFirst(Forward):
    """A stage whose work is done once it has handled one message (as the scheduler once every episode ended)."""

    @property
    def done(self) -> bool:
        return bool(self.seen)


def test_a_stage_done_with_its_work_reads_its_inputs_to_their_end_before_it_stops(broker, topic_prefix):
    """The scheduler is done when every episode has ended, and reward-requests it reads may still be arriving
    then (requests of episodes already graded). Stopping at once left them unread: consumer lag at the run's
    end (a Prometheus check saw the scheduler's reward-requests lag above 0), and a restart handed them again.
    The worker now reads its inputs to where they ended when its work was done, and commits them."""
    cfg = config(topic_prefix, partitions=2)
    group = f"{topic_prefix}done"

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(f"e{i}".encode(), encode(init_request(i))) for i in range(20)])
        actor = DoneAfterFirst()
        await asyncio.wait_for(StageWorker(actor, cfg, broker.bootstrap, 1, group, sole_worker=True).run(asyncio.Event()),
                               120)
        consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)
        await consumer.start()
        try:
            name = topic_name(INIT_REQUESTS, cfg.topics)
            committed = [await consumer.committed(tp) for tp in [TopicPartition(name, p) for p in range(2)]]
        finally:
            await consumer.stop()
        return actor.seen, committed

    seen, committed = run(scenario())
    assert sorted(e for e, _ in seen) == sorted(f"e{i}" for i in range(20))
    assert sum(c or 0 for c in committed) == 20, committed


def test_log_reader_returns_one_episodes_messages(broker, topic_prefix):
    cfg = config(topic_prefix, partitions=1)

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        msgs = [AgentStep(episode=EpisodeKey(episode_id=eid, group_id="g", task_id="t"), turn=k, sandbox={})
                for k in range(3) for eid in ("x", "y")]
        await produce(cfg, broker.bootstrap, AGENT_STEPS, [(m.episode_id.encode(), encode(m)) for m in msgs])
        reader = LogReader(cfg, broker.bootstrap)
        try:
            return await reader(topic_name(AGENT_STEPS, cfg.topics), 0, 1, "x")
        finally:
            await reader.close()

    got = run(scenario())
    assert [(o, m.turn) for o, m in got] == [(2, 1), (4, 2)]


def test_unreachable_broker_retries_then_fails_clearly_within_bound():
    from rollway.runtime.broker import free_port

    cfg = BrokerConfig(connect_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="rollway broker"):
        run(make_producer(cfg, f"127.0.0.1:{free_port()}"))
    assert 1.5 < time.monotonic() - t0 < 10


def test_topics_are_created_with_configured_partitions(broker, topic_prefix):
    cfg = RunConfig.model_validate({"topics": {"prefix": topic_prefix, "partitions": {"agent-steps": 6}}})

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap)
        await consumer.start()
        try:
            return {name: len(consumer.partitions_for_topic(name) or ()) for name in
                    (await consumer.topics()) if name.startswith(topic_prefix)}
        finally:
            await consumer.stop()

    parts = run(scenario())
    assert parts[f"{topic_prefix}agent-steps"] == 6
    assert parts[f"{topic_prefix}init-requests"] == 4
    assert parts[f"{topic_prefix}policy-versions"] == 1


class SlowPerKey(Actor):
    """Holds each message a while and records overlapping handling of one key."""

    name = "slow"
    inputs = (INIT_REQUESTS,)

    def __init__(self):
        self.running: dict[str, int] = {}
        self.overlaps = 0
        self.handled = 0

    async def handle(self, msg: InitRequest, meta: MessageMeta) -> list[Output]:
        self.running[msg.episode_id] = self.running.get(msg.episode_id, 0) + 1
        self.overlaps += self.running[msg.episode_id] > 1
        await asyncio.sleep(0.3)
        self.running[msg.episode_id] -= 1
        self.handled += 1
        return []


def test_messages_of_one_key_never_run_at_once(broker, topic_prefix):
    """Three messages of one key, two slots: the third starts while the second has just been woken
    for the key's lock; it must still wait for it (per-key order is the runtime's promise)."""
    cfg = config(topic_prefix, partitions=1)

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        actor, stop = SlowPerKey(), asyncio.Event()
        worker = StageWorker(actor, cfg, broker.bootstrap, concurrency=2, prefetch=1, group_id=f"{topic_prefix}slow")
        task = asyncio.create_task(worker.run(stop))
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(b"e1", encode(init_request(1)))] * 3)
        deadline = time.monotonic() + 30
        while actor.handled < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await task
        return actor

    actor = run(scenario())
    assert actor.handled == 3
    assert actor.overlaps == 0


class RanksLikeTheAgent(Actor):
    """The agent's ranking rule (later turns first, earliest first once a final-wave message is seen)
    with a handler that only records the order and holds the first message a while."""

    name = "ranked"
    inputs = (AGENT_STEPS,)
    priority, _rank = AgentActor.priority, AgentActor._rank

    def __init__(self):
        self.final_wave = False
        self.order: list[tuple[str, int]] = []

    async def handle(self, msg: AgentStep, meta: MessageMeta) -> list[Output]:
        self.order.append((msg.episode_id, msg.turn))
        if len(self.order) == 1:
            await asyncio.sleep(1.0)  # the rest arrive and queue meanwhile
        return []


def test_backlog_is_ranked_again_when_the_run_starts_draining(broker, topic_prefix):
    """Queued turns ranked 'later turn first' must be re-ranked 'earliest turn first' when a
    final-wave message arrives; otherwise a first turn queued before the wave waits behind it."""
    cfg = config(topic_prefix, partitions=1)
    step = lambda e, turn, final: (e.encode(), encode(AgentStep(  # noqa: E731
        episode=EpisodeKey(episode_id=e, group_id="g", task_id="t"), turn=turn, sandbox={}, final_wave=final)))

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        actor, stop = RanksLikeTheAgent(), asyncio.Event()
        worker = StageWorker(actor, cfg, broker.bootstrap, concurrency=1, prefetch=8, group_id=f"{topic_prefix}rank")
        task = asyncio.create_task(worker.run(stop))
        await produce(cfg, broker.bootstrap, AGENT_STEPS,
                      [step("busy", 9, False), step("new", 0, False), step("old", 3, False), step("wave", 1, True)])
        deadline = time.monotonic() + 30
        while len(actor.order) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await task
        return actor.order

    order = run(scenario())
    assert order[0] == ("busy", 9)
    assert order[1:] == [("new", 0), ("wave", 1), ("old", 3)]


def test_key_locks_keep_one_key_exclusive_across_a_woken_waiter_and_clean_up():
    """Message 3 of a key arrives in the instant after message 1 released the key's lock and before
    the woken message 2 took it: it must queue behind message 2, not get a fresh lock beside it.
    (Both stage runtimes, the aiokafka one and the faust one, lock keys with KeyLocks.)"""
    locks, running, order, spawned = KeyLocks(), [], [], []
    overlaps = 0

    async def message(name: str, spawn: str | None = None, fail: bool = False) -> None:
        nonlocal overlaps
        async with locks.hold("episode-1"):
            running.append(name)
            overlaps += len(running) > 1
            order.append(name)
            await asyncio.sleep(0.01)
            running.remove(name)
            if spawn:  # its first step runs before the woken waiter's
                spawned.append(asyncio.create_task(message(spawn)))
            if fail:
                raise RuntimeError("the handler failed")

    async def scenario() -> None:
        first = asyncio.create_task(message("m1", spawn="m3"))
        await asyncio.sleep(0)
        second = asyncio.create_task(message("m2", fail=True))
        await first
        with pytest.raises(RuntimeError):
            await second
        await asyncio.gather(*spawned)

    run(scenario())
    assert overlaps == 0 and order == ["m1", "m2", "m3"]
    assert len(locks) == 0 and not locks.users, "no lock is kept once nobody holds or awaits it"


class Stuck(Actor):
    """Forwards init-requests; its first handle of `slow_id` blocks until cancelled (a long tool call
    or grading still running when its partition moves), later ones forward at once."""

    name = "stuck"
    inputs = (INIT_REQUESTS,)

    def __init__(self, slow_id: str | None):
        self.slow_id = slow_id
        self.started = asyncio.Event()
        self.cancelled = False

    async def handle(self, msg: InitRequest, meta: MessageMeta) -> list[Output]:
        if msg.episode_id == self.slow_id:
            self.slow_id = None
            self.started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return [Output(AGENT_STEPS, msg.episode_id, AgentStep(
            episode=msg.episode, turn=0, sandbox={}))]


def test_a_handler_still_running_when_its_partition_moves_is_cancelled_and_never_produces(broker, topic_prefix):
    """A second worker joins while the first is stuck in a handler: the rebalance revokes the
    partition, which cancels the running handler before revocation completes; the message is run
    again by whoever owns the partition next, and the cancelled handler produces nothing (exactly
    one output in all, and it does not come after a late second one)."""
    cfg = config(topic_prefix, partitions=1)
    group = f"{topic_prefix}stuck"

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        first, second, stop = Stuck("e0"), Stuck(None), asyncio.Event()
        t1 = asyncio.create_task(StageWorker(first, cfg, broker.bootstrap, 2, group).run(stop))
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(b"e0", encode(init_request(0)))])
        await asyncio.wait_for(first.started.wait(), 30)
        t2 = asyncio.create_task(StageWorker(second, cfg, broker.bootstrap, 2, group).run(stop))
        out = await read_all(cfg, broker.bootstrap, AGENT_STEPS, expect=1, timeout_s=60)
        out = await read_all(cfg, broker.bootstrap, AGENT_STEPS, expect=2, timeout_s=4)  # a late duplicate?
        stop.set()
        await asyncio.wait_for(asyncio.gather(t1, t2), 60)
        return first.cancelled, out

    cancelled, out = run(scenario())
    assert cancelled, "the revoked handler was left running"
    assert [r.key for r in out] == [b"e0"], "exactly one output: the cancelled handler must not produce"


def test_a_cancelled_message_runs_again_when_its_partition_comes_back_to_the_same_worker(broker, topic_prefix):
    """A rebalance that gives the partition back to the same worker (here: another member joins the
    group for a topic of its own) cancels the stuck handler; the message must be fetched again from
    the committed offset and run once, not skipped because the consumer's position was past it."""
    from aiokafka import AIOKafkaConsumer

    cfg = config(topic_prefix, partitions=1)
    group = f"{topic_prefix}back"

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        worker, stop = Stuck("e0"), asyncio.Event()
        task = asyncio.create_task(StageWorker(worker, cfg, broker.bootstrap, 2, group).run(stop))
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(b"e0", encode(init_request(0))),
                                                            (b"e1", encode(init_request(1)))])
        await asyncio.wait_for(worker.started.wait(), 30)
        other = AIOKafkaConsumer(topic_name(DEAD_LETTERS, cfg.topics), bootstrap_servers=broker.bootstrap,
                                 group_id=group, enable_auto_commit=False)
        await other.start()  # joins the group: every partition is revoked and assigned again
        try:
            out = await read_all(cfg, broker.bootstrap, AGENT_STEPS, expect=2, timeout_s=60)
            out = await read_all(cfg, broker.bootstrap, AGENT_STEPS, expect=3, timeout_s=4)
        finally:
            await other.stop()
        stop.set()
        await asyncio.wait_for(task, 60)
        return worker.cancelled, out

    cancelled, out = run(scenario())
    assert cancelled, "the rebalance did not cancel the running handler"
    keys = [r.key for r in out]
    # e0 runs again exactly once; e1 (done but not committed behind e0) may run twice: at-least-once,
    # which the consumers downstream absorb by their (episode, turn) idempotency.
    assert keys.count(b"e0") == 1 and keys.count(b"e1") >= 1, keys


def test_topic_scan_skips_a_deeply_nested_record(broker, topic_prefix):
    """A restarted scheduler rebuilds its state by scanning topics: a record nested 200,000 deep
    (RecursionError in the decoder) is skipped like any undecodable one, not the end of the scan."""
    from rollway.runtime.scan import StreamingTopicScanner

    cfg = config(topic_prefix, partitions=1)
    good = init_request(1)
    nested = encode(init_request(2)).replace(b"\xa1g", b"\x91" * 200_000 + b"\xc0", 1)

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        await produce(cfg, broker.bootstrap, INIT_REQUESTS, [(b"e2", nested), (b"e1", encode(good))])
        return [msg async for msg in StreamingTopicScanner(cfg, broker.bootstrap, stall_s=30)(INIT_REQUESTS)]

    assert run(scenario()) == [good]
