"""What the stream runtime reads of a run's configuration: the broker and topic settings and whether to
trace fetches. The run config (config/run.py, which sits above the domains) satisfies it; the runtime
never imports that config."""

from __future__ import annotations

from typing import Protocol

from rollway.base.broker import BrokerConfig, TopicsConfig


class TraceSettings(Protocol):
    trace: bool
    """Record when each message was polled and fetched in the telemetry lines."""


class StreamConfig(Protocol):
    broker: BrokerConfig
    topics: TopicsConfig
    run: TraceSettings
