"""The broker settings every process needs (connection, consumer timing, topic names and sizes): the
stream runtime (runtime/) reads them without the run config's domain sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from rollway.base.config import StrictModel

ONE_PROCESS_FETCH_MAX_WAIT_MS = 100
"""`fetch_max_wait_ms` of a one-process job left at its default: its six consumers share one event loop,
so their idle fetches are cheap, and a hop then waits at most 0.1 s instead of 0.5 s on the embedded
broker (docs/benchmarks.md, "rollway up's own cost")."""


class BrokerConfig(StrictModel):
    bootstrap: str | None = None
    """Kafka bootstrap servers (host:port[,host:port]). None starts the embedded broker."""
    port: int = Field(0, ge=0, le=65535)
    """Port for the embedded broker; 0 picks a free one."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Kafka security protocol, passed to every client."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism when the protocol is SASL_*."""
    sasl_username: str | None = None
    """SASL user name."""
    sasl_password: SecretStr | None = None
    """SASL password; never printed in logs or reports."""
    ssl_cafile: str | None = None
    """CA bundle for SSL connections."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """How long a client keeps retrying (with backoff) before giving up on an unreachable broker."""
    session_timeout_ms: int = Field(6000, ge=1000)
    """A consumer that stops heartbeating (a killed worker) loses its partitions after this long."""
    heartbeat_interval_ms: int = Field(1500, ge=100)
    """Consumer heartbeat period; well under session_timeout_ms."""
    max_poll_interval_ms: int = Field(300_000, ge=1000)
    """A consumer that does not poll for this long leaves its group. Stage workers keep polling
    (with their partitions paused when every slot is busy), so long handlers (training, grading)
    never reach it; it only catches a worker whose event loop is stuck."""
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024, le=1024 * 1024 * 1024)
    """The largest message rollway produces: the producers' max_request_size, the max.message.bytes
    of every topic rollway creates, and the consumers' fetch sizes. An output above it (a very long
    trajectory) is not produced: its input is dead-lettered and the episode is graded 0 on the turns
    that fit (docs/security/grading.md), instead of a produce retried forever. On Apache Kafka see docs/security/operations.md."""
    fetch_max_wait_ms: int = Field(500, ge=1)
    """Longest a consumer's fetch waits at the broker for new data. The embedded broker (Tansu) does
    not answer a waiting fetch when data arrives, so this is added to every hop there: set it to
    about 10 for low hop latency (at the cost of more idle fetch requests). A one-process job
    (`runtime.processes`) uses ONE_PROCESS_FETCH_MAX_WAIT_MS unless this is set."""

    @model_validator(mode="after")
    def _sasl_needs_mechanism(self) -> BrokerConfig:
        if self.security_protocol.startswith("SASL") and not self.sasl_mechanism:
            raise ValueError("broker.sasl_mechanism is required when security_protocol is SASL_*")
        return self


class TopicsConfig(StrictModel):
    prefix: str = ""
    """Prepended to every topic name and consumer group, so runs can share one broker."""
    default_partitions: int = Field(4, ge=1)
    """Partitions for every topic not listed in `partitions`."""
    partitions: dict[str, int] = Field(default_factory=dict)
    """Partitions per topic name (without prefix), e.g. {agent-steps: 8}."""
    replication_factor: int = Field(1, ge=1)
    """Replication factor for created topics (1 for the embedded broker)."""


FAUST_FETCH_MAX_WAIT_MS = 1500
"""faust-streaming's aiokafka driver passes this to its consumer, whatever the config says."""


def unsupported_settings(broker: BrokerConfig, stages: list[str]) -> list[str]:
    """Settings the Faust engine (runtime/faust.py) cannot honour for these stages, each as a
    message naming its key and what to do instead (empty: nothing to refuse)."""
    problems = []
    if "fetch_max_wait_ms" in broker.model_fields_set and broker.fetch_max_wait_ms != FAUST_FETCH_MAX_WAIT_MS:
        for stage in stages:
            problems.append(
                f"broker.fetch_max_wait_ms={broker.fetch_max_wait_ms} cannot be honoured by stage {stage!r} "
                f"on the faust engine (faust-streaming fixes it at {FAUST_FETCH_MAX_WAIT_MS} ms): set "
                f"runtime.engines.{stage}=aiokafka, or leave broker.fetch_max_wait_ms unset")
    return problems
