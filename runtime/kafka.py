"""Kafka clients built from config: security settings, connect retries, topic creation."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
    UnknownError,
    UnsupportedVersionError,
)

from rollway.base.broker import BrokerConfig, TopicsConfig
from rollway.topics import ALL_TOPICS, TopicSpec

log = structlog.get_logger()


class BrokerUnavailable(RuntimeError):
    """No broker answered within broker.connect_timeout_s."""

    infrastructure = True
    """Observed from outside the sandbox: never the agent's doing (base/blame.py)."""


def client_kwargs(cfg: BrokerConfig, bootstrap: str) -> dict[str, Any]:
    """Connection settings shared by every producer, consumer and admin client."""
    kw: dict[str, Any] = {"bootstrap_servers": bootstrap, "security_protocol": cfg.security_protocol}
    if cfg.security_protocol.startswith("SASL"):
        kw["sasl_mechanism"] = cfg.sasl_mechanism
        kw["sasl_plain_username"] = cfg.sasl_username
        kw["sasl_plain_password"] = cfg.sasl_password.get_secret_value() if cfg.sasl_password else None
    if cfg.security_protocol.endswith("SSL"):
        from aiokafka.helpers import create_ssl_context

        kw["ssl_context"] = create_ssl_context(cafile=cfg.ssl_cafile)
    return kw


def topic_name(spec: TopicSpec, topics: TopicsConfig) -> str:
    return topics.prefix + spec.name


def stage_group_id(stage: str, topics: TopicsConfig, run_id: str | None) -> str:
    """The consumer group of one stage of one run: `<prefix>rollway-<run id>-<stage>`.

    Two runs on one broker never share a group (a shared group split each topic's partitions
    between the runs' workers, and each run's sink and learner dropped the other's episodes as not
    theirs). Every process of a run derives the same id from the run's resolved config (`rollway up`
    writes run.id into the stage config; a multi-machine `rollway stage` run sets run.id, or a
    topic prefix of its own, in the config every machine loads). Without a run id the topic prefix
    alone tells runs apart: `<prefix>rollway-<stage>`."""
    middle = f"{run_id}-" if run_id else ""
    return f"{topics.prefix}rollway-{middle}{stage}"


def partitions_for(spec: TopicSpec, topics: TopicsConfig) -> int:
    if spec.partitions is not None:
        return spec.partitions
    return topics.partitions.get(spec.name, topics.default_partitions)


async def start_with_retry(client: Any, cfg: BrokerConfig, what: str,
                           fatal: tuple[type[BaseException], ...] = ()) -> None:
    """Start an aiokafka client, retrying with exponential backoff until connect_timeout_s; errors
    in `fatal` are raised at once (the broker answered, and no retry will change its answer)."""
    deadline = time.monotonic() + cfg.connect_timeout_s
    delay = 0.2
    while True:
        try:
            await client.start()
            return
        except fatal:
            await _close_quietly(client)
            raise
        except (KafkaConnectionError, KafkaError, OSError) as err:
            await _close_quietly(client)
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrokerUnavailable(
                    f"{what}: no Kafka broker answered at {client_bootstrap(client)} within "
                    f"{cfg.connect_timeout_s:.0f}s ({err}); start one with `rollway broker` or pass "
                    f"--bootstrap HOST:PORT") from None
            log.warning("broker unreachable, retrying", client=what, retry_in_s=round(min(delay, left), 2),
                        error=str(err))
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)


def client_bootstrap(client: Any) -> str:
    servers = getattr(getattr(client, "_client", None), "_bootstrap_servers", None)
    return str(servers) if servers else "the configured bootstrap"


async def _close_quietly(client: Any) -> None:
    try:
        await client.stop() if hasattr(client, "stop") else await client.close()
    except Exception:  # noqa: BLE001 - closing a client that never connected
        pass


IDEMPOTENCE_REFUSED = (UnknownError, UnsupportedVersionError, ClusterAuthorizationFailedError)
"""How a broker turns down an idempotent producer's InitProducerId: the embedded broker (Tansu,
memory storage) answers UnknownError; a Kafka older than 0.11 does not know the request; a cluster
may deny the IdempotentWrite permission."""

_idempotence: dict[str, bool] = {}
"""Per bootstrap: whether its broker granted an idempotent producer (asked once per process)."""


def _refusal_filter(record: logging.LogRecord) -> bool:
    """Drops aiokafka's error line for a refused InitProducerId while rollway probes idempotence."""
    return not record.getMessage().startswith("Unexpected error during InitProducerIdRequest")


def producer_is_idempotent(bootstrap: str) -> bool | None:
    """What the broker at `bootstrap` answered (None: no producer made yet)."""
    return _idempotence.get(bootstrap)


async def make_producer(cfg: BrokerConfig, bootstrap: str) -> AIOKafkaProducer:
    """A producer that waits for every in-sync replica. Idempotent (enable_idempotence) where the
    broker supports it, so a retried send after a lost ack is never written twice; otherwise a
    plain at-least-once producer, said once in the log. Consumers are idempotent either way.
    No linger: every rollway send is awaited on its own (a stage's output, a gateway call before its
    answer), so a batch timer only delays it (2 ms of linger cost 2.4 ms a send on the embedded broker);
    sends made while a request is in flight still go out together."""
    kw = dict(acks="all", linger_ms=0, max_request_size=cfg.max_message_bytes, **client_kwargs(cfg, bootstrap))
    if _idempotence.get(bootstrap, True):
        producer = AIOKafkaProducer(enable_idempotence=True, **kw)
        sender_log = logging.getLogger("aiokafka.producer.sender")
        sender_log.addFilter(_refusal_filter)  # the refusal is expected: rollway says it once, at info
        try:
            await start_with_retry(producer, cfg, "producer", fatal=IDEMPOTENCE_REFUSED)
            _idempotence[bootstrap] = True
            return producer
        except IDEMPOTENCE_REFUSED as err:
            _idempotence[bootstrap] = False
            log.info("the broker refuses idempotent producers; producing without (at least once, "
                     "consumers deduplicate)", bootstrap=bootstrap, error=type(err).__name__)
        finally:
            sender_log.removeFilter(_refusal_filter)
    producer = AIOKafkaProducer(**kw)
    await start_with_retry(producer, cfg, "producer")
    return producer


async def make_consumer(cfg: BrokerConfig, bootstrap: str, *topics: str, group_id: str | None,
                        **extra: Any) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(
        *topics, group_id=group_id, enable_auto_commit=False, auto_offset_reset="earliest",
        # Room for the largest message rollway produces (a broker returns one oversized batch anyway).
        max_partition_fetch_bytes=cfg.max_message_bytes, fetch_max_bytes=2 * cfg.max_message_bytes,
        session_timeout_ms=cfg.session_timeout_ms, heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        fetch_max_wait_ms=cfg.fetch_max_wait_ms,
        **client_kwargs(cfg, bootstrap), **extra)
    await start_with_retry(consumer, cfg, f"consumer {group_id or ''}".strip())
    return consumer


async def ensure_topics(cfg: BrokerConfig, topics: TopicsConfig, bootstrap: str,
                        specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> None:
    """Create missing topics with their configured partition counts (existing ones are kept), each
    accepting messages up to `broker.max_message_bytes` (the limit the producers are built with)."""
    admin = AIOKafkaAdminClient(**client_kwargs(cfg, bootstrap))
    await start_with_retry(admin, cfg, "admin")
    try:
        existing = set(await admin.list_topics())
        new = [NewTopic(topic_name(s, topics), partitions_for(s, topics), topics.replication_factor,
                        topic_configs=topic_configs(s, cfg))
               for s in specs if topic_name(s, topics) not in existing]
        if new:
            await create_topics(admin, new)
    finally:
        await admin.close()


def topic_configs(spec: TopicSpec, cfg: BrokerConfig) -> dict[str, str]:
    """The settings rollway creates `spec`'s topic with."""
    return {"retention.ms": str(spec.retention_ms), "max.message.bytes": str(cfg.max_message_bytes)}


async def create_topics(admin: AIOKafkaAdminClient, new: list[NewTopic], timeout_s: float = 15.0) -> None:
    """Create topics (tolerating a concurrent creator) and wait until the metadata lists them: a
    consumer subscribing to a topic not yet in the metadata would stall."""
    try:
        await admin.create_topics(new)
    except TopicAlreadyExistsError:
        pass  # another process created them first
    names = {t.name for t in new}
    deadline = time.monotonic() + timeout_s
    while not names <= set(await admin.list_topics()):
        if time.monotonic() > deadline:
            raise BrokerUnavailable(f"topics {sorted(names)} were not created within {timeout_s}s")
        await asyncio.sleep(0.1)


async def topic_partitions(consumer: AIOKafkaConsumer, names: Iterable[str]) -> list[TopicPartition]:
    """Every partition of the topics `names`, by topic in the given order and then by partition (one
    metadata fetch first: `partitions_for_topic` reads the consumer's cached metadata). A topic the broker
    does not have contributes none."""
    await consumer.topics()
    return [TopicPartition(name, p) for name in names for p in sorted(consumer.partitions_for_topic(name) or ())]


async def log_end_offsets(consumer: AIOKafkaConsumer, tps: list[Any], probe_ms: int = 1000) -> dict[Any, int]:
    """The log end offset of each of `tps` (one past its last record): ListOffsets' answer, raised to
    the high watermark a fetch at that offset reports. The embedded broker (Tansu 0.6) was seen answering
    ListOffsets one short of the fetch high watermark on a partition (records 0, 1, 2; end 2), so a lag
    computed from it never reached 0. `consumer` must not be subscribed (it is assigned `tps`)."""
    ends = dict(await consumer.end_offsets(tps))
    tps = [tp for tp in tps if ends[tp] > 0]  # 0 is an empty partition: a short answer is at least 1
    if not tps:
        return ends
    consumer.assign(list(tps))
    for tp in tps:
        # From the last record ListOffsets admits: the fetch returns at least that record, so its high
        # watermark arrives at once (a fetch at the end itself waited out the probe on this broker).
        consumer.seek(tp, ends[tp] - 1)
    deadline = time.monotonic() + probe_ms / 1000
    while time.monotonic() < deadline and any(consumer.highwater(tp) is None for tp in tps):
        await consumer.getmany(*tps, timeout_ms=max(1, int((deadline - time.monotonic()) * 1000)))
    for tp in tps:
        hw = consumer.highwater(tp)
        if hw is not None and hw > ends[tp]:
            ends[tp] = hw
    return ends


async def read_to_end(consumer: AIOKafkaConsumer, starts: dict[Any, int | None], ends: dict[Any, int],
                      timeout_s: float | None = None) -> Any:
    """The one log scanner: yields (partition, record) for every record of each assigned partition
    from `starts[tp]` (None: its beginning) up to, not including, its end, partition by partition
    in offset order. `ends` (usually ListOffsets' answer) is raised to the high watermark the fetches
    report, since a broker may answer ListOffsets short (see `log_end_offsets`): the scan never stops
    before a record the broker already serves. A partition whose position reaches its end without a
    record there (a gap: aborted transaction markers, compaction) is done too. After `timeout_s` (None:
    no bound) the partitions not finished are given up with a warning naming them (a broker that
    stopped serving them)."""
    # An end of 0 is an empty partition (a short ListOffsets answer is still at least the last batch's
    # base offset + 1); scanning it would only wait out fetch timeouts.
    starts = {tp: start for tp, start in starts.items() if ends.get(tp, 1) > 0}
    if not starts:
        return
    consumer.assign(list(starts))
    # One ListOffsets for every partition to start from its beginning: aiokafka's seek_to_beginning
    # waits for a fetcher cycle per call (about 0.4 s each here).
    from_start = [tp for tp, start in starts.items() if start is None]
    beginnings = await consumer.beginning_offsets(from_start) if from_start else {}
    for tp, start in starts.items():
        consumer.seek(tp, beginnings[tp] if start is None else start)
    ends = dict(ends)
    todo = set(starts)  # every partition is fetched once at least: its end may have been answered short
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while todo:
        if deadline is not None and time.monotonic() > deadline:
            log.warning("topic scan incomplete: the broker stopped serving these partitions",
                        partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in todo), timeout_s=timeout_s)
            return
        batch = await consumer.getmany(*todo, timeout_ms=1000)
        for tp in todo:
            hw = consumer.highwater(tp)
            if hw is not None and hw > ends[tp]:
                ends[tp] = hw
        for tp, records in batch.items():
            for record in records:
                if record.offset < ends[tp]:
                    yield tp, record
            if records and records[-1].offset + 1 >= ends[tp]:
                todo.discard(tp)
        for tp in list(todo):
            if consumer.highwater(tp) is None:
                continue  # no fetch answered yet: its end is not known for sure
            try:
                position = await asyncio.wait_for(consumer.position(tp), 5.0)
            except TimeoutError:
                continue  # no valid position yet; the deadline bounds the wait
            if position >= ends[tp]:
                todo.discard(tp)
