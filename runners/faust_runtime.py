"""Runs one actor as a faust-streaming agent: the StageWorker contract on Faust's consumer, producer,
timers and a changelog-backed table of the episodes this stage has already handled.

Guarantees, and how they compare with the aiokafka `StageWorker`:

- At-least-once: an event is acked only after every output is acknowledged by the broker (the
  agent body awaits the sends), and Faust commits, per partition, only offsets below the first
  unacked one. A crash redelivers whatever was in flight.
- Exactly-once effect: for init, reward, learner and sink, the stage keeps a Faust `Table` per input
  topic (memory store, compacted changelog topic) of the dedup keys it has handled, so a worker that
  takes a partition over, on this machine or another, skips redelivered episodes. An entry is
  written after the outputs are acked (a dead-lettered message counts as handled), so a crash in
  between repeats the work once, as the aiokafka worker would. The agent deduplicates turns itself
  from the log (and must see duplicates to tear down their sandboxes); the scheduler ignores
  outcomes of finished tickets.
- Ordering: with `concurrency == 1` an agent handles a partition strictly in log order, as the
  aiokafka worker does. With `concurrency > 1` Faust's actors share one queue, so two messages of one
  partition, even of one key, may be handled in either order; a per-key lock still keeps one episode
  to one handler at a time. That is enough here because one episode has at most one outstanding
  message per topic in normal operation (turn k+1 exists only after turn k was handled); the rare
  overlaps (a re-issued attempt, a redelivery) are told apart by attempt and turn in the message.
- Groups: the consumer group is the aiokafka worker's, so a stage can switch engines between runs
  and keep its committed offsets. Do not run both engines in one group at once: Faust's assignor
  (protocol "faust") and aiokafka's ("roundrobin") have no protocol in common.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from rollway.actors.base import Actor, MessageMeta, Output
from rollway.core.config import BrokerConfig, RunConfig
from rollway.core.files import write_json_atomic
from rollway.core.kafka import client_kwargs, create_topics, start_with_retry, topic_name
from rollway.runners.stage_queue import KeyLocks
from rollway.runners.stage_runtime import (
    COMMIT_INTERVAL_S,
    STATUS_INTERVAL_S,
    TICK_INTERVAL_S,
    dead_letter,
    handle_or_dead_letter,
)
from rollway.schemas.codec import DecodeError, decode, encode
from rollway.schemas.messages import (
    EpisodeFailure,
    InitRequest,
    Message,
    RewardRequest,
    Trajectory,
)
from rollway.topics import TopicSpec

log = structlog.get_logger()

NO_DEDUP_STAGES = frozenset({"scheduler", "agent"})
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


def build_app(cfg: RunConfig, bootstrap: str, group_id: str, run_dir: Path) -> Any:
    """A Faust app that consumes as `group_id`, never declares topics and serves no web pages."""
    import faust

    for name in ("faust", "mode"):  # their INFO lines (recovery tables, spinners) drown the stage's own
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    datadir = run_dir / "faust" / group_id  # the memory store keeps no files; Faust wants the folder
    datadir.parent.mkdir(parents=True, exist_ok=True)
    return faust.App(
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
        producer_max_request_size=16 * 1024 * 1024, consumer_max_fetch_size=16 * 1024 * 1024,
    )


async def ensure_changelog_topics(cfg: RunConfig, bootstrap: str, group_id: str, specs: list[TopicSpec]) -> None:
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


class FaustStage:
    """One worker process of one stage as a Faust app: one agent over the actor's input topics."""

    def __init__(self, actor: Actor, cfg: RunConfig, bootstrap: str, concurrency: int, group_id: str,
                 run_dir: Path, status_path: Path | None = None):
        self.actor, self.cfg, self.group_id, self.status_path = actor, cfg, group_id, status_path
        self.app = build_app(cfg, bootstrap, group_id, run_dir)
        self.specs: dict[str, TopicSpec] = {topic_name(t, cfg.topics): t for t in actor.inputs}
        self.tables: dict[str, Any] = {} if actor.name in NO_DEDUP_STAGES else {
            name: self.app.Table(table_name(spec), default=None, key_type=str, value_type=float)
            for name, spec in self.specs.items()}
        self.key_locks = KeyLocks()
        self.stats = {"handled": 0, "skipped_duplicates": 0, "dead_lettered": 0, "produced": 0}
        self.in_flight = 0
        self.failure: BaseException | None = None
        self._register(concurrency)

    def _register(self, concurrency: int) -> None:
        source = self.app.topic(*self.specs, key_type=bytes, value_type=bytes)

        async def process(stream: Any) -> None:
            async for event in stream.events():
                self.in_flight += 1
                try:
                    await self._guard(self._process(event))
                finally:
                    self.in_flight -= 1

        async def tick() -> None:
            await self._guard(self._tick())

        self.app.agent(source, name=f"rollway-{self.actor.name}", concurrency=concurrency)(process)
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
        await self.actor.setup()
        self.app.in_worker = True  # what faust.Worker sets; we run inside the caller's event loop
        try:
            await self.app.start()
            log.info("faust stage worker started", stage=self.actor.name, group=self.group_id,
                     topics=list(self.specs), dedup_tables=len(self.tables))
            await self._wait(stop)
        finally:
            await self.app.stop()
            await self.actor.close()
            self.write_status()
            log.info("faust stage worker stopped", stage=self.actor.name, **self.stats)
        if self.failure is not None:
            raise self.failure

    async def _wait(self, stop: asyncio.Event) -> None:
        last_status = 0.0
        while not (stop.is_set() or self.actor.done or self.failure or self.app.should_stop):
            if time.monotonic() - last_status >= STATUS_INTERVAL_S:
                self.write_status()
                last_status = time.monotonic()
            await asyncio.sleep(0.1)

    def write_status(self) -> None:
        """The same status file as StageWorker's, for `rollway up`'s progress display."""
        if self.status_path is None:
            return
        status = {"stage": self.actor.name, "pid": os.getpid(), "engine": "faust", "in_flight": self.in_flight,
                  "backlog": 0, **self.stats, "updated_at": time.time(), "partitions": self._input_partitions()}
        self.status_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.status_path, status)

    def _input_partitions(self) -> int:
        """Input partitions this worker owns (`rollway up` starts the scheduler once all own some)."""
        try:
            return sum(tp.topic in self.specs for tp in self.app.consumer.assignment())
        except Exception:  # noqa: BLE001 - not started or already stopped: owns nothing
            return 0

    async def _tick(self) -> None:
        await self._send(await self.actor.tick())

    async def _process(self, event: Any) -> None:
        message = event.message
        spec = self.specs[message.topic]
        try:
            msg = decode(event.value, spec.value)
        except DecodeError as err:
            await self._send([self._dead_letter(event, f"decode: {err}")])
            return
        key = dedup_key(msg)
        table = self.tables.get(message.topic)
        async with self.key_locks.hold(event.key):
            if table is not None and key is not None and table.get(key) is not None:
                self.stats["skipped_duplicates"] += 1
                return
            meta = MessageMeta(message.topic, message.partition, message.offset, int(message.timestamp * 1000))
            outputs = await handle_or_dead_letter(self.actor, msg, meta, lambda r: self._dead_letter(event, r))
            self.stats["handled"] += 1
            await self._send(outputs)
            if table is not None and key is not None:
                table[key] = time.time()  # after the acks: a crash before this only repeats work

    def _dead_letter(self, event: Any, reason: str) -> Output:
        m = event.message
        self.stats["dead_lettered"] += 1
        return dead_letter(self.actor.name, m.topic, m.partition, m.offset, event.key, event.value, reason)

    async def _send(self, outputs: list[Output]) -> None:
        """Produce each output and wait for the broker's ack, retrying with backoff while the broker
        is away (the event stays unacked, so its offset is not committed meanwhile)."""
        for out in outputs:
            key = out.key.encode() if out.key is not None else None
            await self._send_one(topic_name(out.topic, self.cfg.topics), key, encode(out.value))
            self.stats["produced"] += 1

    async def _send_one(self, topic: str, key: bytes | None, value: bytes) -> None:
        delay = 0.2
        while True:
            try:
                await self.app.producer.send_and_wait(topic, key, value, partition=None, timestamp=None,
                                                      headers=None)
                return
            except KafkaError as err:
                log.warning("produce failed, retrying", stage=self.actor.name, error=str(err), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


async def run_faust_worker(actor: Actor, cfg: RunConfig, bootstrap: str, concurrency: int, group_id: str,
                           run_dir: Path, stop: asyncio.Event, status_path: Path | None = None) -> None:
    """Run `actor` as a Faust worker until `stop` is set or the actor is done."""
    stage = FaustStage(actor, cfg, bootstrap, concurrency, group_id, run_dir, status_path)
    if stage.tables:
        await ensure_changelog_topics(cfg, bootstrap, group_id, [stage.specs[name] for name in stage.tables])
    await stage.run(stop)
