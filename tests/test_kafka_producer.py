"""Idempotent producers where the broker grants them, against the real embedded broker (Tansu with
memory storage, which turns InitProducerId down): the fallback is quick, said in the log, and works."""

from __future__ import annotations

import logging
import time

import pytest
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import UnknownError
from conftest import run

from rollway.base.broker import BrokerConfig
from rollway.runtime import kafka
from rollway.runtime.kafka import make_producer, producer_is_idempotent

pytestmark = pytest.mark.broker


def test_embedded_broker_refuses_idempotence_and_the_producer_falls_back(broker, topic_prefix, monkeypatch,
                                                                         caplog):
    monkeypatch.setattr(kafka, "_idempotence", {})  # a fresh process: other tests' producers asked already

    async def scenario():
        # What the broker itself answers an idempotent producer (measured, not assumed).
        raw = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, enable_idempotence=True, acks="all")
        with pytest.raises(UnknownError):
            await raw.start()
        await raw.stop()
        caplog.clear()  # what aiokafka logged for the raw producer above
        with structlog.testing.capture_logs() as logs, caplog.at_level(logging.INFO, logger="aiokafka"):
            t0 = time.monotonic()
            producer = await make_producer(BrokerConfig(connect_timeout_s=120), broker.bootstrap)
            took = time.monotonic() - t0
        try:
            sent = await producer.send_and_wait(f"{topic_prefix}idem", b"v", key=b"k")
        finally:
            await producer.stop()
        return logs, took, sent

    logs, took, sent = run(scenario())
    assert producer_is_idempotent(broker.bootstrap) is False
    assert any("refuses idempotent producers" in e["event"] for e in logs)
    # aiokafka's own error line for the expected refusal is not repeated at error level by every stage
    assert not [r for r in caplog.records if "InitProducerIdRequest" in r.getMessage()]
    assert took < 60, "the refusal must not wait out connect_timeout_s"  # 120 s; a loaded machine stalls for 10
    assert sent.offset == 0


def test_scans_and_lag_reach_records_a_short_list_offsets_answer_leaves_out(broker, topic_prefix):
    """The embedded broker (Tansu 0.6) answers ListOffsets with the last batch's base offset + 1: three
    records produced in one batch get end offset 1, not 3 (measured). `rollway up` then waited 90 s for a
    consumer lag that could not reach 0, and scans up to that end missed records. The scanner and
    `log_end_offsets` must reach the high watermark the broker's fetches report."""
    import asyncio

    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from rollway.runtime.kafka import log_end_offsets, make_consumer, read_to_end

    topic = f"{topic_prefix}scan"

    async def scenario():
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
        await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", linger_ms=50)
        await producer.start()
        sent = [await producer.send(topic, f"v{i}".encode(), partition=0) for i in range(3)]  # one batch
        await asyncio.gather(*sent)
        await producer.stop()
        tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
        consumer = await make_consumer(BrokerConfig(), broker.bootstrap, group_id=None)
        try:
            listed = await consumer.end_offsets([tp0, tp1])
            ends = await log_end_offsets(consumer, [tp0, tp1])
            scanned = [(tp.partition, r.offset) async for tp, r in read_to_end(consumer, dict.fromkeys(listed),
                                                                              listed, timeout_s=30)]
        finally:
            await consumer.stop()
        return listed[tp0], (ends[tp0], ends[tp1]), scanned

    listed, ends, scanned = run(scenario())
    print("ListOffsets answered", listed, "for 3 records")
    assert ends == (3, 0)
    assert scanned == [(0, 0), (0, 1), (0, 2)]


def test_one_message_size_limit_for_producers_consumers_and_created_topics(broker, topic_prefix):
    """broker.max_message_bytes is the producer's max_request_size, the consumers' fetch size and the
    max.message.bytes of every topic rollway creates (read back from the broker), so a cluster that
    honours topic settings accepts what rollway produces."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from rollway.base.broker import TopicsConfig
    from rollway.runtime.kafka import ensure_topics, make_consumer
    from rollway.topics import ALL_TOPICS

    cfg = BrokerConfig(max_message_bytes=2 * 1024 * 1024, connect_timeout_s=10)
    topics = TopicsConfig(prefix=topic_prefix)

    async def scenario():
        await ensure_topics(cfg, topics, broker.bootstrap)
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            names = [topics.prefix + t.name for t in ALL_TOPICS]
            answers = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
        finally:
            await admin.close()
        settings = {resource[3]: {entry[0]: entry[1] for entry in resource[4]}
                    for answer in answers for resource in answer.resources}
        producer = await make_producer(cfg, broker.bootstrap)
        consumer = await make_consumer(cfg, broker.bootstrap, group_id=None)
        try:
            return settings, producer._max_request_size, consumer._fetcher._max_partition_fetch_bytes
        finally:
            await producer.stop()
            await consumer.stop()

    settings, request_size, fetch_size = run(scenario())
    assert len(settings) == len(ALL_TOPICS)
    assert {s.get("max.message.bytes") for s in settings.values()} == {str(2 * 1024 * 1024)}
    assert request_size == fetch_size == 2 * 1024 * 1024
