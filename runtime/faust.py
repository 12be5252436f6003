"""Runs one actor as a faust-streaming agent: the StageWorker contract on Faust's consumer, producer,
timers and a changelog-backed table of the episodes this stage has already handled.

Every actor hook is honoured as the aiokafka `StageWorker` honours it (tests/test_runtime_conformance.py
runs one suite against both engines):

- At-least-once: a message is acked to Faust only after every output is acknowledged by the broker,
  and Faust commits, per partition, only offsets below the first unacked one. A crash redelivers
  whatever was in flight.
- `held_offsets`: a handled message whose offset the actor still holds (buffered, not yet durable)
  stays unacked until the actor lets go of it, so Faust's commit stops below it and a restarted
  worker gets it again. On a rebalance held and queued messages are dropped unacked (their next
  owner reads them again), so Faust's wait for in-flight messages never waits on them.
- Rebalance: when one starts, running handlers are cancelled (so none produces after its partition
  moved) and their events, with the held and queued ones, go back to the log unacked. A batch
  Faust's fetch loop drops because the flow stopped is read again: a partition with no committed
  offset goes back to the log's start (`_seek_committed_or_earliest`).
- Ordering: one Faust agent (concurrency 1) takes events in log order and starts a task per message,
  up to the stage's concurrency; a per-key lock taken in arrival order keeps one key's messages in
  log order, as in the aiokafka worker.
- `priority` with `prefetch` > 0: up to `prefetch` events beyond the concurrency wait in the same
  priority backlog as the aiokafka worker's (re-ranked when `priority_epoch` changes).
- `done`: the worker first reads its inputs to where they ended when the actor became done (late
  messages about finished work, at most `LATE_READ_S`), as the aiokafka worker does.
- `tick`, `on_error`, dead letters, outputs that can never be produced (the input dead-lettered,
  the episode failed: `deliver`), `StaleMessage` skips and telemetry (one line per handled message,
  runtime/telemetry.py) as in the aiokafka worker, through the same functions.
- Exactly-once effect: for init, reward, learner and sink, the stage keeps a Faust `Table` per input
  topic (memory store, compacted changelog topic) of the dedup keys it has handled, so a worker that
  takes a partition over, on this machine or another, skips redelivered episodes. An entry is
  written after the outputs are acked (a dead-lettered message counts as handled), so a crash in
  between repeats the work once, as the aiokafka worker would. A message the actor still holds
  after handling gets no entry: its redelivery must reach the actor. The agent deduplicates turns
  itself from the log (and must see duplicates to tear down their sandboxes); the scheduler ignores
  outcomes of finished tickets. The tables stay bounded: each keeps the newest `table_window` keys
  per partition and deletes older ones with changelog tombstones. A table is restored up to its
  changelog's end as a fetch reports it, not as ListOffsets answers it: the embedded broker answers
  ListOffsets with the last batch's base offset + 1, so Faust's own recovery stopped before the last
  entries of a batch and a restarted worker handled their episodes again (`_changelog_ends`).
- Refused: `broker.fetch_max_wait_ms` set for a stage on Faust (Faust fixes it at 1500 ms); see
  `unsupported_settings`, checked when the config loads and again when a worker starts.
- Metrics: the aiokafka worker's series (runtime/metrics.py: heartbeat, in flight, backlog, handled
  and dead-lettered messages, consumer lag per owned input partition as the log's end minus the
  offset Faust committed), so the shipped alerts and dashboard watch a Faust stage too.
- Groups: the consumer group is the aiokafka worker's, so a stage can switch engines between runs
  and keep its committed offsets. Do not run both engines in one group at once: Faust's assignor
  (protocol "faust") and aiokafka's ("roundrobin") have no protocol in common.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import IllegalStateError

from rollway.base.broker import BrokerConfig, unsupported_settings
from rollway.base.config import ConfigError
from rollway.base.files import write_json_atomic
from rollway.runtime import metrics
from rollway.runtime.actor import Actor, MessageMeta, Output
from rollway.runtime.kafka import client_kwargs, create_topics, log_end_offsets, start_with_retry, topic_name
from rollway.runtime.queue import Backlog, KeyLocks
from rollway.runtime.settings import StreamConfig
from rollway.runtime.telemetry import TelemetryLog
from rollway.runtime.worker import (
    COMMIT_INTERVAL_S,
    LAG_INTERVAL_S,
    LAG_TIMEOUT_S,
    LATE_READ_S,
    STATUS_INTERVAL_S,
    TICK_INTERVAL_S,
    OutputSender,
    dead_letter,
    deliver,
    handle_or_dead_letter,
    send_dead_letter,
)
from rollway.schemas.codec import DecodeError, decode
from rollway.schemas.messages import (
    EpisodeFailure,
    InitRequest,
    Message,
    RewardRequest,
    Trajectory,
)
from rollway.topics import TopicSpec
from rollway.topics.topology import STAGES

log = structlog.get_logger()

# Stages whose dedup (topics/topology.py) is their own log-driven state, not a table of handled keys.
NO_DEDUP_STAGES = frozenset(s.name for s in STAGES if s.dedup in ("tickets", "rebuild"))
"""Stages whose actors deduplicate themselves (see the module docstring)."""


def dedup_key(msg: Message) -> str | None:
    """The identity whose effect must happen once; None: this message is not deduplicated."""
    if isinstance(msg, (InitRequest, RewardRequest)):
        return f"{msg.episode_id}/{msg.attempt}"
    if isinstance(msg, Trajectory):
        return msg.episode_id  # sink and learner keep one trajectory per episode
    if isinstance(msg, EpisodeFailure):
        return f"failure/{msg.episode_id}/{msg.attempt}/{msg.stage}"
    return None


def table_name(spec: TopicSpec) -> str:
    return f"handled-{spec.name}"


def changelog_name(group_id: str, spec: TopicSpec) -> str:
    # Faust names a table's changelog "<app id>-<table>-changelog"; the app id is the consumer group.
    return f"{group_id}-{table_name(spec)}-changelog"


def faust_brokers(bootstrap: str) -> list[str]:
    return [f"kafka://{host.strip()}" for host in bootstrap.split(",") if host.strip()]


def faust_credentials(cfg: BrokerConfig) -> Any | None:
    """BrokerConfig's security settings as Faust `broker_credentials` (None for PLAINTEXT)."""
    import faust

    ssl_context = None
    if cfg.security_protocol.endswith("SSL"):
        from aiokafka.helpers import create_ssl_context

        ssl_context = create_ssl_context(cafile=cfg.ssl_cafile)
    if cfg.security_protocol.startswith("SASL"):
        password = cfg.sasl_password.get_secret_value() if cfg.sasl_password else None
        return faust.SASLCredentials(username=cfg.sasl_username, password=password,
                                     mechanism=cfg.sasl_mechanism, ssl_context=ssl_context)
    if ssl_context is not None:
        return faust.SSLCredentials(ssl_context)
    return None


def build_app(cfg: StreamConfig, bootstrap: str, group_id: str, run_dir: Path) -> Any:
    """A Faust app that consumes as `group_id`, never declares topics and serves no web pages."""
    import faust

    for name in ("faust", "mode"):  # their INFO lines (recovery tables, spinners) drown the stage's own
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    datadir = run_dir / "faust" / group_id  # the memory store keeps no files; Faust wants the folder
    datadir.parent.mkdir(parents=True, exist_ok=True)

    class RollwayApp(faust.App):
        """A Faust app that tells the stage when a rebalance starts, before Faust waits for every
        unacked message (the stage lets go of the ones it keeps unacked on purpose)."""

        before_rebalance: Any = None

        def on_rebalance_start(self) -> None:
            if self.before_rebalance is not None:
                self.before_rebalance()
            super().on_rebalance_start()

    return RollwayApp(
        group_id, broker=faust_brokers(bootstrap), broker_credentials=faust_credentials(cfg.broker),
        value_serializer="raw", key_serializer="raw", store="memory://",
        web_enabled=False, autodiscover=False, datadir=str(datadir),
        # rollway creates every topic itself (core.kafka.ensure_topics, ensure_changelog_topics):
        # no topic creation rights are needed, and no leader topic because nothing runs on_leader.
        topic_allow_declare=False, topic_disable_leader=True,
        consumer_auto_offset_reset="earliest", producer_acks=-1,
        broker_commit_interval=COMMIT_INTERVAL_S, table_standby_replicas=0,
        # The aiokafka worker's settings instead of Faust's 60 s: Tansu answers a new group's first
        # JoinGroup only after half the session timeout, so Faust's default meant a 30 s start.
        broker_session_timeout=cfg.broker.session_timeout_ms / 1000,
        broker_heartbeat_interval=cfg.broker.heartbeat_interval_ms / 1000,
        producer_max_request_size=cfg.broker.max_message_bytes, consumer_max_fetch_size=cfg.broker.max_message_bytes,
    )


async def ensure_changelog_topics(cfg: StreamConfig, bootstrap: str, group_id: str, specs: list[TopicSpec]) -> None:
    """Create each dedup table's compacted changelog with its source topic's partition count (Faust
    writes a table entry to the partition of the event that caused it, and checks the counts match)."""
    admin = AIOKafkaAdminClient(**client_kwargs(cfg.broker, bootstrap))
    await start_with_retry(admin, cfg.broker, "admin")
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if changelog_name(group_id, s) not in existing]
        if not missing:
            return
        described = await admin.describe_topics([topic_name(s, cfg.topics) for s in missing])
        counts = {d["topic"]: len(d["partitions"]) for d in described}
        new = [NewTopic(changelog_name(group_id, s), counts[topic_name(s, cfg.topics)], cfg.topics.replication_factor,
                        topic_configs={"cleanup.policy": "compact"}) for s in missing]
        await create_topics(admin, new)  # Faust subscribes to the changelogs at start
    finally:
        await admin.close()


class PartitionAcks:
    """Hands one partition's handled events to Faust in offset order. Faust commits up to the first
    gap in the offsets acked to it, but it takes a gap of exactly one offset right after the
    committed one (and any gap when 0 is committed) for no gap, and would commit past an event still
    held or running; so an event is acked only once every earlier one of its partition is."""

    def __init__(self) -> None:
        self.unfinished: set[int] = set()
        self.done: dict[int, Any] = {}
        self.barrier: float = float("inf")
        """Events at or after this offset are forgotten, not acked (set by `drop`)."""
        self.detached = False
        """Set by `drop`: a rebalance began; nothing finishing later may stay held."""

    def start(self, offset: int) -> None:
        self.unfinished.add(offset)

    def finish(self, offset: int, event: Any) -> tuple[list[Any], list[Any]]:
        """(events to ack now, events to forget) once `event` is finished."""
        self.unfinished.discard(offset)
        if offset >= self.barrier:
            return [], [event]
        self.done[offset] = event
        low = min(self.unfinished, default=float("inf"))
        ready = [self.done.pop(o) for o in sorted(self.done) if o < low]
        return ready, []

    def drop(self, from_offset: int | None) -> list[Any]:
        """Detach these books (a rebalance began) and forget every event from `from_offset` on
        (None: none): returns the finished ones not acked yet. Events before it that are still
        running ack when they finish."""
        self.detached = True
        if from_offset is not None:
            self.barrier = min(self.barrier, from_offset)
        self.unfinished = {o for o in self.unfinished if o < self.barrier}
        forget = [e for o, e in self.done.items() if o >= self.barrier]
        self.done = {o: e for o, e in self.done.items() if o < self.barrier}
        return forget


class FaustStage:
    """One worker process of one stage as a Faust app: one agent over the actor's input topics that
    starts a task per message (see the module docstring for the guarantees)."""

    table_window = 4096
    """Dedup keys kept per input partition; an older one is deleted (a tombstone in the compacted
    changelog), so the tables stay bounded. Redeliveries come from the committed offset on, and a
    worker commits soon after it handles: a key this many messages old is never asked for again."""

    def __init__(self, actor: Actor, cfg: StreamConfig, bootstrap: str, concurrency: int, group_id: str,
                 run_dir: Path, status_path: Path | None = None, prefetch: int = 0,
                 telemetry_path: Path | None = None):
        self.actor, self.cfg, self.group_id, self.status_path = actor, cfg, group_id, status_path
        self.concurrency, self.prefetch = concurrency, prefetch
        self.app = build_app(cfg, bootstrap, group_id, run_dir)
        self.bootstrap = bootstrap
        self.probe: AIOKafkaConsumer | None = None
        self.app.consumer.highwaters = self._changelog_ends  # what table recovery reads up to
        self._seek_to_committed = self.app.consumer.seek_to_committed
        self.app.consumer.seek_to_committed = self._seek_committed_or_earliest
        self.app.before_rebalance = self._drop_unfinished
        self.specs: dict[str, TopicSpec] = {topic_name(t, cfg.topics): t for t in actor.inputs}
        self.tables: dict[str, Any] = {} if actor.name in NO_DEDUP_STAGES else {
            name: self.app.Table(table_name(spec), default=None, key_type=str, value_type=float)
            for name, spec in self.specs.items()}
        self.key_locks = KeyLocks()
        self.backlog = Backlog()
        """Events fetched beyond `concurrency`, started by `actor.priority` (prefetch > 0 only)."""
        self.tasks: dict[asyncio.Task, Any] = {}
        """Running handlers and their events."""
        self.held: dict[tuple[str, int, int], tuple[Any, PartitionAcks]] = {}
        """Handled events whose offsets the actor still holds: kept unacked, so uncommitted."""
        self.acks: dict[Any, PartitionAcks] = {}
        self.table_keys: dict[tuple[str, int], OrderedDict[str, None]] = {}
        """Per input partition, the dedup keys in its table, oldest first (for `table_window`)."""
        self.telemetry = TelemetryLog(telemetry_path, actor.name, fetch_times=cfg.run.trace)
        self.stats = {"handled": 0, "skipped_duplicates": 0, "dead_lettered": 0, "produced": 0}
        self.sender = OutputSender(actor.name, cfg, self._produce, self.stats)
        self.failure: BaseException | None = None
        self.closing = False
        self.metrics = metrics.WorkerMetrics(actor.name, concurrency)
        self._read: dict[TopicPartition, int] = {}
        """Per input partition, the offset after the last event taken (a done stage reads up to the end)."""
        self._committed_before: dict[TopicPartition, int] = {}
        """The group's committed offset (the log's start where none) of input partitions as Faust sought
        them, for the lag of a partition this worker has not committed yet."""
        self._register()

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    async def _changelog_ends(self, *tps: Any) -> dict[Any, int]:
        """Faust's recovery reads each table's changelog up to the end this returns. Its own answer is
        ListOffsets', which the embedded broker gives short (the last batch's base offset + 1: two
        dedup entries written in one batch read as one), so the table came back without the last
        entries; `log_end_offsets` raises it to the end a fetch reports. One probe consumer serves
        every recovery of this worker (stopping one inside Faust's recovery task was seen to leave
        that task cancelled)."""
        if not tps:
            return {}
        ends = await log_end_offsets(await self._probe(), [TopicPartition(tp.topic, tp.partition) for tp in tps])
        return {tp: ends[TopicPartition(tp.topic, tp.partition)] for tp in tps}

    async def _probe(self) -> AIOKafkaConsumer:
        if self.probe is None:
            self.probe = AIOKafkaConsumer(**client_kwargs(self.cfg.broker, self.bootstrap), enable_auto_commit=False)
            await self.probe.start()
        return self.probe

    async def _seek_committed_or_earliest(self) -> dict[Any, int | None]:
        """Faust seeks every partition to its committed offset after a table recovery, and when its
        fetch loop drops a batch because the flow stopped (a rebalance began while the fetch waited:
        the batch may already come from the new assignment). aiokafka's seek skips a partition with
        no committed offset (or 0), so a fresh group's partition stayed past the dropped batch and
        its messages were never handled. Here such an input partition goes back to the start of
        the log, where `auto_offset_reset=earliest` put it in the first place: to the offset the
        broker names, not by an offset reset, whose moment without a position crashed Faust's
        livelock check (it reads every assigned partition's position)."""
        committed = await self._seek_to_committed()
        fresh = [TopicPartition(tp.topic, tp.partition) for tp, offset in committed.items()
                 if not offset and tp.topic in self.specs]
        self._committed_before.update({TopicPartition(tp.topic, tp.partition): offset
                                       for tp, offset in committed.items() if offset and tp.topic in self.specs})
        if fresh:
            starts = await (await self._probe()).beginning_offsets(fresh)
            self._committed_before.update(starts)
            try:
                await self.app.consumer._thread.seek_wait(starts)
            except IllegalStateError:  # a rebalance took a partition meanwhile: its next owner seeks it
                log.info("faust seek skipped: partitions moved meanwhile", stage=self.actor.name)
        return committed

    def _register(self) -> None:
        source = self.app.topic(*self.specs, key_type=bytes, value_type=bytes)

        async def take(stream: Any) -> None:
            async for event in stream.events():
                await self._guard(self._admit(event))

        async def tick() -> None:
            await self._guard(self._tick())

        # One agent keeps log order; it starts the handling tasks itself (bounded by concurrency).
        self.app.agent(source, name=f"rollway-{self.actor.name}", concurrency=1)(take)
        self.app.timer(TICK_INTERVAL_S, name=f"rollway-{self.actor.name}-tick")(tick)

    async def _guard(self, work: Any) -> None:
        """Runtime faults (not handler faults) stop the worker, as they do the aiokafka worker."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - re-raised by run()
            self.failure = self.failure or err
            raise

    async def run(self, stop: asyncio.Event) -> None:
        refused = unsupported_settings(self.cfg.broker, [self.actor.name])
        if refused:
            raise ConfigError("; ".join(refused))
        await self.actor.setup()
        # What imports and setup made lives as long as the process: frozen, a full collection no longer
        # walks it (in the gateway's bench one took 271 ms, and every episode's call waited behind it).
        gc.freeze()
        self.app.in_worker = True  # what faust.Worker sets; we run inside the caller's event loop
        try:
            await self.app.start()
            log.info("faust stage worker started", stage=self.actor.name, group=self.group_id,
                     topics=list(self.specs), dedup_tables=len(self.tables), concurrency=self.concurrency,
                     prefetch=self.prefetch)
            await self._wait(stop)
            await self._drain()
            try:  # what app.stop would commit, so that the last lag figure counts it
                await self.app.consumer.commit()
            except Exception as err:  # noqa: BLE001 - app.stop commits again; a metric never stops the stage
                log.info("faust commit before the last lag figure failed", stage=self.actor.name, error=repr(err))
            await self.observe_lag()  # the final figures a last scrape reads
        finally:
            self.closing = True
            self._drop_unfinished()
            await self.app.stop()
            if self.probe is not None:
                await self.probe.stop()
            await self.actor.close()
            self.telemetry.close()
            self.write_status()
            log.info("faust stage worker stopped", stage=self.actor.name, **self.stats)
        if self.failure is not None:
            raise self.failure

    async def _wait(self, stop: asyncio.Event) -> None:
        last_status = last_lag = 0.0
        finish: tuple[float, dict[TopicPartition, int]] | None = None
        while not (stop.is_set() or self.failure or self.app.should_stop):
            if self.actor.done:  # as the aiokafka worker: its inputs read to where they ended then (LATE_READ_S)
                finish = finish or (time.monotonic() + LATE_READ_S, await self._input_ends())
                if self._read_up_to(*finish):
                    break
            self._release_held()
            if time.monotonic() - last_status >= STATUS_INTERVAL_S:
                self.write_status()
                last_status = time.monotonic()
            if time.monotonic() - last_lag >= LAG_INTERVAL_S:
                await self.observe_lag()
                last_lag = time.monotonic()
            full = len(self.tasks) + len(self.backlog) >= self.concurrency + self.prefetch
            self.metrics.loop(self.in_flight, len(self.backlog), full, self._input_partitions())
            await asyncio.sleep(0.1)

    async def observe_lag(self) -> None:
        """Per owned input partition: the log's end minus the group's committed offset (Kafka's consumer
        lag), the end as a fetch reports it (runtime/kafka.py: log_end_offsets)."""
        try:
            ends = await self._log_ends()
            committed = dict(self.app.consumer._committed_offset)  # noqa: SLF001 - what Faust committed, per partition
        except Exception as err:  # noqa: BLE001 - a metric never stops the stage (a broker away, a rebalance)
            log.debug("consumer lag not measured this round", stage=self.actor.name, error=repr(err))
            return
        lags = {}
        for tp, end in ends.items():
            done = max(committed.get(tp) or 0, self._committed_before.get(tp, 0))  # a partition owned before
            lags[(tp.topic, tp.partition)] = max(0, end - done)
        self.metrics.lag(lags)

    def _owned_inputs(self) -> list[TopicPartition]:
        return sorted(TopicPartition(tp.topic, tp.partition) for tp in self.app.consumer.assignment()
                      if tp.topic in self.specs)

    async def _log_ends(self) -> dict[TopicPartition, int]:
        """The log's end of each owned input partition, as a fetch reports it (within LAG_TIMEOUT_S)."""
        tps = self._owned_inputs()
        return await asyncio.wait_for(log_end_offsets(await self._probe(), tps), LAG_TIMEOUT_S) if tps else {}

    async def _input_ends(self) -> dict[TopicPartition, int]:
        try:
            return await self._log_ends()
        except Exception:  # noqa: BLE001 - a broker away: nothing more is read
            return {}

    def _read_up_to(self, until: float, ends: dict[TopicPartition, int]) -> bool:
        """Whether a done stage has handled its inputs up to `ends` (or `until` has passed): see
        StageWorker._read_up_to."""
        if time.monotonic() > until:
            return True
        if self.tasks or self.backlog:
            return False
        owned = set(self._owned_inputs())
        return all(self._read.get(tp, self._committed_before.get(tp, 0)) >= end
                   for tp, end in ends.items() if tp in owned)

    async def _drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking events and let running handlers finish (their acks commit at app.stop)."""
        self.closing = True
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        self._release_held()

    def write_status(self) -> None:
        """The same status file as StageWorker's, for `rollway up`'s progress display."""
        if self.status_path is None:
            return
        status = {"stage": self.actor.name, "pid": os.getpid(), "engine": "faust", "in_flight": self.in_flight,
                  "backlog": len(self.backlog), "held": len(self.held), **self.stats, "updated_at": time.time(),
                  "partitions": self._input_partitions()}
        self.status_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.status_path, status)

    def _input_partitions(self) -> int:
        """Input partitions this worker owns (`rollway up` starts the scheduler once all own some)."""
        try:
            return sum(tp.topic in self.specs for tp in self.app.consumer.assignment())
        except Exception:  # noqa: BLE001 - not started or already stopped: owns nothing
            return 0

    async def _tick(self) -> None:
        await self.sender.send_each(await self.actor.tick(), "tick")
        self._release_held()

    # -- admission: log order, bounded concurrency, priority backlog ---------------------------
    async def _admit(self, event: Any) -> None:
        """Start the event now or queue it by priority, then wait until there is room for the next
        (the agent takes no further event meanwhile: back-pressure)."""
        event.message.incref()  # ours until handled and no longer held (the stream's ack alone won't do)
        if self.closing:
            self._forget(event)  # never acked: redelivered to whoever owns the partition next
            return
        where = TopicPartition(event.message.topic, event.message.partition)
        self._read[where] = max(self._read.get(where, 0), event.message.offset + 1)
        acks = self.acks.setdefault(event.message.tp, PartitionAcks())
        acks.start(event.message.offset)
        now = time.time()
        self.telemetry.fetched(event.message.topic, event.message.partition, event.message.offset, now, now)
        if not self.prefetch:
            self._spawn(event, acks)
        else:
            epoch = self.actor.priority_epoch
            self.backlog.push(self._priority(event), event.message.tp, (event, acks))
            if self.actor.priority_epoch != epoch:
                self.backlog.rerank(lambda _tp, item: self._priority(item[0]))
            self._start_backlog()
        while self.tasks and len(self.tasks) + len(self.backlog) >= self.concurrency + self.prefetch:
            await asyncio.wait(list(self.tasks), return_when=asyncio.FIRST_COMPLETED)

    def _priority(self, event: Any) -> float:
        try:
            return self.actor.priority(decode(event.value, self.specs[event.message.topic].value))
        except DecodeError:
            return float("inf")  # dead-letter it right away

    def _start_backlog(self) -> None:
        while self.backlog and len(self.tasks) < self.concurrency and not self.closing:
            _, (event, acks) = self.backlog.pop()
            self._spawn(event, acks)

    def _spawn(self, event: Any, acks: PartitionAcks) -> None:
        # The task copies this context, so Faust's current event (for table writes) is this event.
        task = asyncio.create_task(self._guard(self._process(event, acks)))
        self.tasks[task] = event
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self.failure = self.failure or task.exception()
        self._start_backlog()

    # -- handling ---------------------------------------------------------------------------
    async def _process(self, event: Any, acks: PartitionAcks) -> None:
        try:
            await self._handle_event(event, acks)
        except asyncio.CancelledError:
            self._forget(event)  # cancelled by a rebalance: its outputs were not all produced
            raise

    async def _handle_event(self, event: Any, acks: PartitionAcks) -> None:
        message = event.message
        spec = self.specs[message.topic]
        timestamp_ms = int(message.timestamp * 1000)  # Faust gives the record's timestamp in seconds
        try:
            msg = decode(event.value, spec.value)
        except DecodeError as err:
            now = time.time()
            self.telemetry.record(message.topic, message.partition, message.offset, timestamp_ms, event.value, None,
                                  now, now, outcome="undecodable")
            self.metrics.handled(message.topic, "undecodable", message.timestamp, now, now)
            await send_dead_letter(self.sender, self._dead_letter(event, f"decode: {err}"))
            self._finish(event, acks)
            return
        key = dedup_key(msg)
        table = self.tables.get(message.topic)
        async with self.key_locks.hold(event.key):
            if table is not None and key is not None and table.get(key) is not None:
                self.stats["skipped_duplicates"] += 1
                now = time.time()
                self.telemetry.record(message.topic, message.partition, message.offset, timestamp_ms, event.value,
                                      msg, now, now, outcome="duplicate")
                self._finish(event, acks)
                return
            meta = MessageMeta(message.topic, message.partition, message.offset, timestamp_ms)
            with structlog.contextvars.bound_contextvars(episode_id=getattr(msg, "episode_id", None)):
                started = time.time()
                outputs = await handle_or_dead_letter(self.actor, msg, meta, lambda r: self._dead_letter(event, r))
                self.stats["handled"] += 1
                ended = time.time()
                self.telemetry.record(message.topic, message.partition, message.offset, timestamp_ms, event.value,
                                      msg, started, ended)
                self.metrics.handled(message.topic, "handled", message.timestamp, started, ended)
            await deliver(self.sender, self.actor, outputs, msg, lambda r: self._dead_letter(event, r))
            held = self._where(event) in self.actor.held_offsets()
            if table is not None and key is not None and not held:
                self._remember(table, message, key)  # after the acks: a crash before this only repeats work
        self._finish(event, acks, held)

    def _remember(self, table: Any, message: Any, key: str) -> None:
        """Add `key` to the table (Faust writes it to the changelog partition of the event being
        handled, which is `message`'s) and delete the partition's oldest keys beyond the window."""
        where = (message.topic, message.partition)
        if where not in self.table_keys:
            # Keys restored from the changelog, in log order (the memory store records their partition).
            restored = getattr(table.data, "_key_partition", {})
            self.table_keys[where] = OrderedDict((k, None) for k, p in restored.items() if p == message.partition)
        order = self.table_keys[where]
        table[key] = time.time()
        order[key] = None
        order.move_to_end(key)
        while len(order) > self.table_window:
            old, _ = order.popitem(last=False)
            if old in table:
                del table[old]

    @staticmethod
    def _where(event: Any) -> tuple[str, int, int]:
        m = event.message
        return m.topic, m.partition, m.offset

    def _finish(self, event: Any, acks: PartitionAcks, held: bool = False) -> None:
        """A handled event: keep it unacked while the actor holds its offset, else ack it and the
        events after it that were only waiting for it."""
        if held and not acks.detached:
            self.held[self._where(event)] = (event, acks)
            return
        if held:  # finished during a rebalance: it and everything after it go back to the log
            for dropped in acks.drop(event.message.offset):
                self._forget(dropped)
        ready, forget = acks.finish(event.message.offset, event)
        for done in ready:
            done.ack()
        for dropped in forget:
            self._forget(dropped)

    def _release_held(self) -> None:
        """Ack the held events whose offsets the actor no longer holds (their effect is durable)."""
        if not self.held:
            return
        still = self.actor.held_offsets()
        for where in [w for w in self.held if w not in still]:
            self._finish(*self.held.pop(where))

    def _forget(self, event: Any) -> None:
        """Drop an unfinished event without acking it: it stays uncommitted, so the partition's next
        owner (maybe this worker again) reads it again. Faust's revocation waits until its consumer's
        unacked set is empty, and a dropped event would never leave it otherwise."""
        self.app.consumer._unacked_messages.discard(event.message)  # noqa: SLF001 - see docstring

    def _drop_unfinished(self) -> None:
        """Before a rebalance (and at shutdown): cancel running handlers, so none produces after its
        partition moved, and forget their events, the held and queued ones (see `_forget`) and every
        later event of their partitions; handled events before them are still acked."""
        dropped = [event for event, _ in self.held.values()] + list(self.tasks.values())
        for task in self.tasks:
            task.cancel()
        self.held.clear()
        while self.backlog:
            dropped.append(self.backlog.pop()[1][0])
        lowest: dict[Any, int] = {}
        for event in dropped:
            tp = event.message.tp
            lowest[tp] = min(lowest.get(tp, event.message.offset), event.message.offset)
            self._forget(event)
        for tp, acks in self.acks.items():
            for event in acks.drop(lowest.get(tp)):
                self._forget(event)
        self.acks = {}  # events fetched after the rebalance start new books
        self._read = {}  # a partition owned again is read again from its committed offset
        self.table_keys = {}  # rebuilt from the tables as restored after the rebalance

    def _dead_letter(self, event: Any, reason: str) -> Output:
        m = event.message
        self.stats["dead_lettered"] += 1
        self.metrics.dead_letter(reason)
        return dead_letter(self.actor.name, m.topic, m.partition, m.offset, event.key, event.value, reason)

    async def _produce(self, topic: str, key: bytes | None, value: bytes) -> None:
        """One produce for `OutputSender` (which retries while the broker is away; the event stays
        unacked meanwhile, so its offset is not committed)."""
        await self.app.producer.send_and_wait(topic, key, value, partition=None, timestamp=None, headers=None)


async def run_faust_worker(actor: Actor, cfg: StreamConfig, bootstrap: str, concurrency: int, group_id: str,
                           run_dir: Path, stop: asyncio.Event, status_path: Path | None = None,
                           prefetch: int = 0, telemetry_path: Path | None = None) -> None:
    """Run `actor` as a Faust worker until `stop` is set or the actor is done."""
    stage = FaustStage(actor, cfg, bootstrap, concurrency, group_id, run_dir, status_path, prefetch, telemetry_path)
    if stage.tables:
        await ensure_changelog_topics(cfg, bootstrap, group_id, [stage.specs[name] for name in stage.tables])
    await stage.run(stop)
