"""Idempotent producers where the broker grants them, against the real embedded broker (Tansu with
memory storage, which turns InitProducerId down): the fallback is quick, said in the log, and works."""

from __future__ import annotations

import time

import pytest
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import UnknownError
from conftest import run

from rollway.core import kafka
from rollway.core.config import BrokerConfig
from rollway.core.kafka import make_producer, producer_is_idempotent

pytestmark = pytest.mark.broker


def test_embedded_broker_refuses_idempotence_and_the_producer_falls_back(broker, topic_prefix, monkeypatch):
    monkeypatch.setattr(kafka, "_idempotence", {})  # a fresh process: other tests' producers asked already

    async def scenario():
        # What the broker itself answers an idempotent producer (measured, not assumed).
        raw = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, enable_idempotence=True, acks="all")
        with pytest.raises(UnknownError):
            await raw.start()
        await raw.stop()
        with structlog.testing.capture_logs() as logs:
            t0 = time.monotonic()
            producer = await make_producer(BrokerConfig(connect_timeout_s=20), broker.bootstrap)
            took = time.monotonic() - t0
        try:
            sent = await producer.send_and_wait(f"{topic_prefix}idem", b"v", key=b"k")
        finally:
            await producer.stop()
        return logs, took, sent

    logs, took, sent = run(scenario())
    assert producer_is_idempotent(broker.bootstrap) is False
    assert any("refuses idempotent producers" in e["event"] for e in logs)
    assert took < 10, "the refusal must not wait out connect_timeout_s"
    assert sent.offset == 0
