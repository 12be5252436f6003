"""One runtime contract: every stage engine (the aiokafka StageWorker, the faust-streaming FaustStage)
honours every actor hook, checked by the same tests against the real embedded broker.

The probe actor reads agent-steps, which neither engine deduplicates (Faust's dedup table skips
init requests, reward requests, trajectories and failures it has handled), so every delivery
reaches the actor on both engines and the tests can count them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from conftest import run
from test_stage_runtime import produce, read_all

from rollway.base.run_dir import RunDir
from rollway.config.run import RunConfig, faust_installed, load_config
from rollway.runtime.actor import Actor, MessageMeta, Output, StaleMessage, failure_output
from rollway.runtime.faust import FaustStage, ensure_changelog_topics
from rollway.runtime.kafka import ensure_topics, topic_name
from rollway.runtime.telemetry import read_telemetry
from rollway.runtime.worker import StageWorker
from rollway.schemas import AgentStep, DeadLetter, EpisodeFailure, EpisodeKey, decode, encode
from rollway.topics import AGENT_STEPS, ALL_TOPICS, DEAD_LETTERS, EPISODE_FAILURES, TopicSpec

pytestmark = pytest.mark.broker

OUT = TopicSpec("conformance-out", AgentStep, keyed_by_episode=True)
"""Where the probe writes one message per input it handled (and per tick, when asked)."""

ENGINES = ("aiokafka", pytest.param("faust", marks=pytest.mark.skipif(
    not faust_installed(), reason="the faust engine is an optional extra: pip install 'rollway[faust]'")))


def step(episode: str, turn: int, **flags: Any) -> AgentStep:
    """An agent step whose sandbox dict carries the probe's instructions (hold, fail, stop, sleep_s)."""
    return AgentStep(episode=EpisodeKey(episode_id=episode, group_id="g", task_id="t"), turn=turn, sandbox=flags)


class Probe(Actor):
    """Records every hook the runtime calls. Instructions ride in the message: `fail` raises in
    handle, `hold` keeps the offset in held_offsets, `stop` makes the actor done, `sleep_s` delays,
    `gate` waits for the test to open `self.gate`, `stale` raises StaleMessage, `huge_int` returns an
    output MessagePack cannot encode, `pad` returns an output of that many bytes more."""

    name = "probe"
    inputs = (AGENT_STEPS,)

    def __init__(self, tick_outputs: bool = False):
        self.seen: list[tuple[str, int, int]] = []  # (episode, turn, offset) in handling order
        self.holding: set[tuple[str, int, int]] = set()
        self.gate = asyncio.Event()
        self.tick_outputs, self.ticks = tick_outputs, 0
        self.running: dict[str, int] = {}
        self.max_running, self.key_overlaps = 0, 0
        self.set_up = self.closed = self.stopping = False
        self.cancelled = 0
        self.reversed = False

    async def setup(self) -> None:
        self.set_up = True

    async def handle(self, msg: AgentStep, meta: MessageMeta) -> list[Output]:
        self.running[msg.episode_id] = self.running.get(msg.episode_id, 0) + 1
        self.key_overlaps += self.running[msg.episode_id] > 1
        self.max_running = max(self.max_running, sum(self.running.values()))
        try:
            self.seen.append((msg.episode_id, msg.turn, meta.offset))
            if msg.sandbox.get("gate"):
                try:
                    await self.gate.wait()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            await asyncio.sleep(msg.sandbox.get("sleep_s", 0.0))
            if msg.sandbox.get("fail"):
                raise RuntimeError("the probe was told to fail")
            if msg.sandbox.get("stale"):
                raise StaleMessage("the probe was told this turn is stale")
            if msg.sandbox.get("huge_int"):
                return [Output(OUT, msg.episode_id, step(msg.episode_id, msg.turn, view_range=[1, 2**65]))]
            if msg.sandbox.get("pad"):
                return [Output(OUT, msg.episode_id, step(msg.episode_id, msg.turn, pad="x" * msg.sandbox["pad"]))]
            if msg.sandbox.get("hold"):
                self.holding.add((meta.topic, meta.partition, meta.offset))
            self.stopping = self.stopping or bool(msg.sandbox.get("stop"))
            return [Output(OUT, msg.episode_id, step(msg.episode_id, msg.turn))]
        finally:
            self.running[msg.episode_id] -= 1

    def held_offsets(self) -> set[tuple[str, int, int]]:
        return set(self.holding)

    def priority(self, msg: AgentStep) -> float:
        if msg.sandbox.get("flip") and not self.reversed:
            self.reversed = True  # the ranking rule changed: what is queued must be ranked again
            self.priority_epoch += 1
        return -float(msg.turn) if self.reversed else float(msg.turn)

    def on_error(self, msg: AgentStep, error: BaseException) -> list[Output]:
        return [failure_output(msg, self.name, error)]

    async def tick(self) -> list[Output]:
        self.ticks += 1
        return [Output(OUT, "tick", step("tick", self.ticks))] if self.tick_outputs else []

    @property
    def done(self) -> bool:
        return self.stopping

    async def close(self) -> None:
        self.closed = True


def config(prefix: str, partitions: int) -> RunConfig:
    return RunConfig.model_validate({"topics": {"prefix": prefix, "default_partitions": partitions},
                                     "broker": {"connect_timeout_s": 10, "session_timeout_ms": 3000,
                                                "heartbeat_interval_ms": 1000}})


class Running:
    """One worker of `engine` running in the background of the test's event loop."""

    def __init__(self, engine: str, actor: Probe, cfg: RunConfig, bootstrap: str, group: str, run_dir: Path,
                 concurrency: int = 1, prefetch: int = 0, telemetry_path: Path | None = None):
        self.actor, self.stop = actor, asyncio.Event()
        if engine == "aiokafka":
            self.worker: Any = StageWorker(actor, cfg, bootstrap, concurrency, group, prefetch=prefetch,
                                           telemetry_path=telemetry_path)
        else:
            self.worker = FaustStage(actor, cfg, bootstrap, concurrency, group, run_dir, prefetch=prefetch,
                                     telemetry_path=telemetry_path)
        self.engine, self.cfg, self.bootstrap, self.group = engine, cfg, bootstrap, group
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> Running:
        if self.engine == "faust":
            await ensure_changelog_topics(self.cfg, self.bootstrap, self.group, list(self.actor.inputs))
        self.task = asyncio.create_task(self.worker.run(self.stop))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 60)


async def until(predicate, what: str, timeout_s: float = 60.0) -> None:
    # Generous: a Faust member joining a group the previous member just left waits several seconds.
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def prepare(cfg: RunConfig, bootstrap: str, steps: list[AgentStep | tuple[bytes, bytes]]) -> None:
    await ensure_topics(cfg.broker, cfg.topics, bootstrap, (*ALL_TOPICS, OUT))
    await produce(cfg, bootstrap, AGENT_STEPS,
                  [m if isinstance(m, tuple) else (m.episode_id.encode(), encode(m)) for m in steps])


async def committed(cfg: RunConfig, bootstrap: str, group: str, partition: int = 0) -> int | None:
    """The group's committed offset on agent-steps' `partition` (None: nothing committed)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        return await consumer.committed(TopicPartition(topic_name(AGENT_STEPS, cfg.topics), partition))
    finally:
        await consumer.stop()


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


def test_handles_produces_and_commits(engine, broker, topic_prefix, tmp_path):
    """Every message is handled once and produces its output; a new worker of the group starts after
    the committed offsets; setup and close are called."""
    cfg, group = config(topic_prefix, partitions=4), f"{topic_prefix}probe"

    async def scenario():
        await prepare(cfg, broker.bootstrap, [step(f"e{i}", 0) for i in range(8)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path, concurrency=2) as first:
            await until(lambda: len(first.actor.seen) == 8, "8 messages handled")
        outputs = await read_all(cfg, broker.bootstrap, OUT, expect=8)
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path) as second:
            await produce(cfg, broker.bootstrap, AGENT_STEPS, [(b"late", encode(step("late", 0)))])
            await until(lambda: second.actor.seen, "the late message")
            await asyncio.sleep(1.0)  # room for a wrongly redelivered message to show up
        return first.actor, outputs, second.actor

    first, outputs, second = run(scenario())
    assert first.set_up and first.closed
    assert sorted(e for e, _, _ in first.seen) == sorted(f"e{i}" for i in range(8))
    assert sorted(r.key for r in outputs) == sorted(f"e{i}".encode() for i in range(8))
    assert [e for e, _, _ in second.seen] == ["late"]


def test_one_keys_messages_run_in_log_order(engine, broker, topic_prefix, tmp_path):
    """Concurrency runs different keys at once, but never two messages of one key, and one key's
    messages start in log order."""
    cfg = config(topic_prefix, partitions=1)
    msgs = [step(key, turn, sleep_s=0.02 * ((turn * 7 + ord(key)) % 4)) for turn in range(6) for key in "abc"]

    async def scenario():
        await prepare(cfg, broker.bootstrap, msgs)
        async with Running(engine, Probe(), cfg, broker.bootstrap, f"{topic_prefix}probe", tmp_path,
                           concurrency=4) as w:
            await until(lambda: len(w.actor.seen) == len(msgs), "every message handled")
        return w.actor

    actor = run(scenario())
    for key in "abc":
        assert [t for e, t, _ in actor.seen if e == key] == list(range(6))
    assert actor.key_overlaps == 0
    assert actor.max_running > 1, "the stage's concurrency was not used"


def test_dead_letters_decode_and_handler_failures(engine, broker, topic_prefix, tmp_path):
    """Undecodable bytes and a raising handler each go to dead-letters with the reason; the handler's
    failure also produces the actor's on_error outputs; the stage keeps going."""
    cfg = config(topic_prefix, partitions=2)

    async def scenario():
        await prepare(cfg, broker.bootstrap, [(b"junk", b"\xc1 not msgpack"), step("bad", 0, fail=True),
                                              step("ok", 0)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, f"{topic_prefix}probe", tmp_path) as w:
            await until(lambda: len(w.actor.seen) == 2, "two decodable messages handled")
            dead = await read_all(cfg, broker.bootstrap, DEAD_LETTERS, expect=2)
            failures = await read_all(cfg, broker.bootstrap, EPISODE_FAILURES, expect=1)
            outputs = await read_all(cfg, broker.bootstrap, OUT, expect=1)
        return dead, failures, outputs

    dead, failures, outputs = run(scenario())
    letters = sorted((decode(r.value, DeadLetter) for r in dead), key=lambda d: d.reason)
    assert [d.reason.split(":")[0] for d in letters] == ["decode", "handler"]
    assert letters[0].value == b"\xc1 not msgpack" and letters[0].key == b"junk"
    assert letters[1].key == b"bad" and "told to fail" in letters[1].reason and letters[1].stage == "probe"
    failure = decode(failures[0].value, EpisodeFailure)
    assert (failure.episode_id, failure.stage) == ("bad", "probe") and "told to fail" in failure.reason
    assert [r.key for r in outputs] == [b"ok"]


def test_tick_runs_periodically_and_its_outputs_are_produced(engine, broker, topic_prefix, tmp_path):
    cfg = config(topic_prefix, partitions=1)

    async def scenario():
        await prepare(cfg, broker.bootstrap, [])
        async with Running(engine, Probe(tick_outputs=True), cfg, broker.bootstrap, f"{topic_prefix}probe",
                           tmp_path) as w:
            await until(lambda: w.actor.ticks >= 4, "four ticks")
            ticks = await read_all(cfg, broker.bootstrap, OUT, expect=3)
        return ticks

    ticks = run(scenario())
    turns = [decode(r.value, AgentStep).turn for r in ticks]
    assert len(turns) >= 3 and turns == sorted(turns)


def test_held_offset_is_not_committed_until_released(engine, broker, topic_prefix, tmp_path):
    """A handled message whose offset the actor holds (buffered, not durable) blocks the commit at
    its offset: a restarted worker of the group gets it again (and what follows it); once the actor
    lets go, the commit moves past it."""
    cfg, group = config(topic_prefix, partitions=1), f"{topic_prefix}probe"

    async def scenario():
        await prepare(cfg, broker.bootstrap, [step("a", 0), step("x", 0, hold=True), step("b", 0)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path) as first:
            await until(lambda: len(first.actor.seen) == 3 and first.actor.holding, "three handled, one held")
            await until_committed(cfg, broker.bootstrap, group, 1)
            await asyncio.sleep(1.5)  # three commit intervals: the commit must stay at the held offset
        after_stop = await committed(cfg, broker.bootstrap, group)
        # The restarted worker holds x again, then lets go of it while running.
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path) as second:
            await until(lambda: len(second.actor.seen) == 2 and second.actor.holding, "x and b redelivered")
            await asyncio.sleep(1.0)
            while_held = await committed(cfg, broker.bootstrap, group)
            second.actor.holding.clear()
            await until_committed(cfg, broker.bootstrap, group, 3)
        return first.actor, after_stop, second.actor, while_held

    first, after_stop, second, while_held = run(scenario())
    assert [e for e, _, _ in first.seen] == ["a", "x", "b"]
    assert after_stop == 1, "the commit went past the held offset"
    assert [(e, o) for e, _, o in second.seen] == [("x", 1), ("b", 2)]
    assert while_held == 1


async def until_committed(cfg: RunConfig, bootstrap: str, group: str, offset: int) -> None:
    deadline = time.monotonic() + 30
    while (got := await committed(cfg, bootstrap, group)) != offset:
        assert time.monotonic() < deadline, f"committed offset stayed {got}, expected {offset}"
        await asyncio.sleep(0.2)


def test_prefetched_messages_start_by_priority(engine, broker, topic_prefix, tmp_path):
    """With prefetch, messages fetched while the only slot is busy wait in a backlog and start highest
    priority first (the probe's priority is the turn number)."""
    cfg = config(topic_prefix, partitions=1)
    turns = [0, 3, 1, 5, 2, 4]

    async def scenario():
        await prepare(cfg, broker.bootstrap, [step(f"e{t}", t, gate=t == 0) for t in turns])
        async with Running(engine, Probe(), cfg, broker.bootstrap, f"{topic_prefix}probe", tmp_path,
                           concurrency=1, prefetch=5) as w:
            await until(lambda: len(w.worker.backlog) == 5, "five messages in the backlog")
            w.actor.gate.set()
            await until(lambda: len(w.actor.seen) == 6, "every message handled")
        return w.actor

    actor = run(scenario())
    assert [t for _, t, _ in actor.seen] == [0, 5, 4, 3, 2, 1]


@pytest.mark.parametrize("engine", ["aiokafka", "faust"])
def test_running_handler_is_cancelled_when_its_partition_is_revoked(engine, broker, topic_prefix, tmp_path):
    """A handler still running when a rebalance takes its partition away is cancelled before the
    revocation completes, so it can never produce after the partition moved; the message stays
    uncommitted for the next owner."""
    cfg, group = config(topic_prefix, partitions=1), f"{topic_prefix}probe"

    async def scenario():
        await prepare(cfg, broker.bootstrap, [step("slow", 0, gate=True)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path) as first:
            await until(lambda: first.actor.seen, "the slow handler started")
            second = Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path)
            second.actor.gate.set()
            try:
                async with second:  # joining the group revokes every partition (eager rebalance)
                    await until(lambda: first.actor.cancelled, "the first handler cancelled", timeout_s=15)
                    first.actor.gate.set()
                    await until(lambda: len(first.actor.seen) + len(second.actor.seen) >= 2,
                                "the message handled again by its next owner")
            finally:
                first.actor.gate.set()  # a runtime that did not cancel it: let it end, so the test ends
            outputs = await read_all(cfg, broker.bootstrap, OUT, expect=2, timeout_s=3)
        return first.actor, outputs

    first, outputs = run(scenario())
    assert first.cancelled == 1
    assert len(outputs) == 1, "only the partition's new owner may produce"


def test_a_new_priority_epoch_reranks_the_backlog(engine, broker, topic_prefix, tmp_path):
    """An actor whose ranking rule changed bumps priority_epoch; the runtime then ranks what it had
    queued again (here: lowest turn first from the flip on)."""
    cfg = config(topic_prefix, partitions=1)

    async def scenario():
        steps = [step("e0", 0, gate=True)] + [step(f"e{t}", t) for t in (3, 1, 5, 2, 4)] + [step("e9", 9, flip=True)]
        await prepare(cfg, broker.bootstrap, steps)
        async with Running(engine, Probe(), cfg, broker.bootstrap, f"{topic_prefix}probe", tmp_path,
                           concurrency=1, prefetch=6) as w:
            await until(lambda: len(w.worker.backlog) == 6, "six messages in the backlog")
            w.actor.gate.set()
            await until(lambda: len(w.actor.seen) == 7, "every message handled")
        return w.actor

    assert [t for _, t, _ in run(scenario()).seen] == [0, 1, 2, 3, 4, 5, 9]


def test_done_actor_stops_its_worker_once_its_inputs_are_read_to_their_end(engine, broker, topic_prefix, tmp_path):
    """A done actor (the scheduler once every episode ended) stops its worker, which first reads its inputs
    to where they ended then and commits them: late messages about the finished work (reward requests of
    graded episodes) are not left as lag at the run's end, nor handed to a restart again."""
    cfg = config(topic_prefix, partitions=1)
    group = f"{topic_prefix}probe"

    async def scenario():
        late = [step(f"late{i}", 0, sleep_s=0.05) for i in range(20)]  # a second of work after done
        await prepare(cfg, broker.bootstrap, [step("a", 0), step("last", 0, stop=True), *late])
        w = Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path)
        await w.__aenter__()
        await asyncio.wait_for(w.task, 60)  # no stop event: the worker ends because the actor is done
        return w.actor, await committed(cfg, broker.bootstrap, group)

    actor, offset = run(scenario())
    assert [e for e, _, _ in actor.seen] == ["a", "last", *(f"late{i}" for i in range(20))] and actor.closed
    assert offset == 22


@pytest.mark.parametrize("fetch_times", [False, True], ids=["plain", "run.trace"])
def test_telemetry_has_one_line_per_handled_message(engine, broker, topic_prefix, tmp_path, fetch_times):
    """The runtime records every message it handles, with the record's own production time: nothing
    about it rides in the message."""
    cfg = config(topic_prefix, partitions=2).model_copy(deep=True)
    cfg.run.trace = fetch_times
    path = RunDir(tmp_path).telemetry_path("probe", "host.1")
    sent_after = time.time()

    async def scenario():
        await prepare(cfg, broker.bootstrap, [step(f"e{i}", i) for i in range(4)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, f"{topic_prefix}probe", tmp_path,
                           concurrency=2, telemetry_path=path) as w:
            await until(lambda: len(w.actor.seen) == 4, "four messages handled")

    run(scenario())
    records = read_telemetry(tmp_path)
    assert sorted((r.episode_id, r.turn) for r in records) == [(f"e{i}", i) for i in range(4)]
    for r in records:
        assert r.stage == "probe" and r.topic == topic_name(AGENT_STEPS, cfg.topics) and r.outcome == "handled"
        assert r.episode == EpisodeKey(episode_id=r.episode_id, group_id="g", task_id="t") and r.bytes > 0
        assert sent_after - 0.001 <= r.produced_at <= r.started_at <= r.ended_at
        if fetch_times:
            assert r.polled_at <= r.fetched_at <= r.started_at and r.produced_at <= r.fetched_at + 0.001
        else:
            assert r.polled_at is None and r.fetched_at is None


def test_settings_an_engine_cannot_honour_are_refused_by_key():
    """Faust's consumer fixes its fetch wait; asking for another on a Faust stage is refused by name."""
    with pytest.raises(ValueError, match=r"broker.fetch_max_wait_ms=10 .*'sink'.*runtime.engines.sink=aiokafka"):
        load_config(None, ["runtime.engines.sink=faust", "broker.fetch_max_wait_ms=10"])
    load_config(None, ["runtime.engines.sink=faust"])  # Faust's own default is fine
    load_config(None, ["broker.fetch_max_wait_ms=10"])  # and any wait on aiokafka


def limited_config(prefix: str, max_message_bytes: int) -> RunConfig:
    return RunConfig.model_validate({"topics": {"prefix": prefix, "default_partitions": 1},
                                     "broker": {"connect_timeout_s": 10, "session_timeout_ms": 3000,
                                                "heartbeat_interval_ms": 1000, "max_message_bytes": max_message_bytes}})


def letters_and_failures(dead: list, failures: list) -> tuple[list[DeadLetter], list[EpisodeFailure]]:
    return [decode(r.value, DeadLetter) for r in dead], [decode(r.value, EpisodeFailure) for r in failures]


def test_unencodable_output_dead_letters_its_input_and_the_partition_goes_on(engine, broker, topic_prefix, tmp_path):
    """A handler output MessagePack cannot hold (a hostile tool argument: an integer above 2**64)
    dead-letters its input with the reason and fails the episode, the offset is committed, and the
    next record of the partition is handled (it used to kill the handler task unobserved and freeze
    the partition's commits)."""
    cfg, group = config(topic_prefix, partitions=1), f"{topic_prefix}probe"

    async def scenario():
        await prepare(cfg, broker.bootstrap, [step("bad", 0, huge_int=True), step("ok", 0)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path) as w:
            await until(lambda: len(w.actor.seen) == 2, "both messages handled")
            dead = await read_all(cfg, broker.bootstrap, DEAD_LETTERS, expect=1)
            failures = await read_all(cfg, broker.bootstrap, EPISODE_FAILURES, expect=1)
            outputs = await read_all(cfg, broker.bootstrap, OUT, expect=1)
            await until_committed(cfg, broker.bootstrap, group, 2)
        return dead, failures, outputs

    dead, failures, outputs = run(scenario())
    (letter,), (failure,) = letters_and_failures(dead, failures)
    assert letter.key == b"bad" and letter.reason.startswith("output:") and "cannot be encoded" in letter.reason
    assert letter.value == encode(step("bad", 0, huge_int=True)), "the dead letter holds the input's bytes"
    assert (failure.episode_id, failure.stage, failure.retryable) == ("bad", "probe", False)
    assert [r.key for r in outputs] == [b"ok"]


def test_deeply_nested_record_is_dead_lettered_and_the_worker_keeps_running(engine, broker, topic_prefix, tmp_path):
    """A record nested 200,000 arrays deep (RecursionError in the decoder) is a decode dead letter,
    on the prefetch path (which ranks records by decoding them) too."""
    cfg, group = config(topic_prefix, partitions=1), f"{topic_prefix}probe"
    marker = encode(step("deep", 0, x="MARKER"))
    nested = marker.replace(b"\xa6MARKER", b"\x91" * 200_000 + b"\xc0")
    assert nested != marker

    async def scenario():
        await prepare(cfg, broker.bootstrap, [(b"deep", nested), step("ok", 0)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path, prefetch=2) as w:
            await until(lambda: len(w.actor.seen) == 1, "the next message handled")
            dead = await read_all(cfg, broker.bootstrap, DEAD_LETTERS, expect=1)
            await until_committed(cfg, broker.bootstrap, group, 2)
        return w.actor, dead

    actor, dead = run(scenario())
    (letter,) = [decode(r.value, DeadLetter) for r in dead]
    assert letter.key == b"deep" and letter.reason.startswith("decode:") and letter.value == nested
    assert [e for e, _, _ in actor.seen] == ["ok"]


def test_oversized_output_is_dead_lettered_not_retried_forever(engine, broker, topic_prefix, tmp_path):
    """An output over broker.max_message_bytes (a long trajectory) dead-letters its input with a size
    reason and fails the episode, instead of a produce retried every 5 s forever; the partition goes
    on. The bound below is far above a normal hop; a retry loop never dead-letters at all."""
    cfg, group = limited_config(topic_prefix, 64 * 1024), f"{topic_prefix}probe"

    async def scenario():
        await prepare(cfg, broker.bootstrap, [step("big", 0, pad=200_000), step("ok", 0)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path) as w:
            await until(lambda: len(w.actor.seen) == 2, "both messages handled")
            dead = await read_all(cfg, broker.bootstrap, DEAD_LETTERS, expect=1, timeout_s=30)
            failures = await read_all(cfg, broker.bootstrap, EPISODE_FAILURES, expect=1)
            outputs = await read_all(cfg, broker.bootstrap, OUT, expect=1)
            await until_committed(cfg, broker.bootstrap, group, 2)
        return dead, failures, outputs

    dead, failures, outputs = run(scenario())
    (letter,), (failure,) = letters_and_failures(dead, failures)
    assert letter.key == b"big" and "max_message_bytes=65536" in letter.reason
    assert failure.episode_id == "big" and not failure.retryable and "max_message_bytes" in failure.reason
    assert [r.key for r in outputs] == [b"ok"]


def test_stale_redelivery_is_skipped_without_a_dead_letter(engine, broker, topic_prefix, tmp_path):
    """A StaleMessage (an expected redelivery) produces nothing and dead-letters nothing; the
    failing message after it shows the dead-letter topic was read past where its letter would be."""
    cfg, group = config(topic_prefix, partitions=1), f"{topic_prefix}probe"

    async def scenario():
        await prepare(cfg, broker.bootstrap, [step("old", 3, stale=True), step("bad", 0, fail=True), step("ok", 0)])
        async with Running(engine, Probe(), cfg, broker.bootstrap, group, tmp_path) as w:
            await until(lambda: len(w.actor.seen) == 3, "three messages handled")
            dead = await read_all(cfg, broker.bootstrap, DEAD_LETTERS, expect=1)
            failures = await read_all(cfg, broker.bootstrap, EPISODE_FAILURES, expect=1)
            outputs = await read_all(cfg, broker.bootstrap, OUT, expect=1)
            await until_committed(cfg, broker.bootstrap, group, 3)
        return dead, failures, outputs

    dead, failures, outputs = run(scenario())
    letters, fails = letters_and_failures(dead, failures)
    assert [d.key for d in letters] == [b"bad"]
    assert [f.episode_id for f in fails] == ["bad"]
    assert [r.key for r in outputs] == [b"ok"]
