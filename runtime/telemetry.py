"""Telemetry recorded by the stage runtimes, not carried in messages: one line per message a worker
handled, in the run folder beside the workers' status (`RunDir.telemetry_path`), and the figures read
back from those lines (stage seconds, queue waits, episode timelines, hop latency)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from rollway.base.run_dir import RunDir
from rollway.schemas.messages import EpisodeKey

FLUSH_INTERVAL_S = 0.5
"""A worker's lines reach the file at most this late (and at its close)."""


class Handled(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """stage runtime -> run folder (`telemetry/STAGE-HOST.PID.jsonl`): one message one worker handled.

    Invariants: `produced_at <= started_at <= ended_at` (one machine's clock; `produced_at` has the
    record timestamp's millisecond resolution). A redelivered message (a crash, a rebalance) gets a
    line per handling; `outcome` says what the handling was."""

    stage: str
    topic: str
    partition: int
    offset: int
    bytes: int
    """Size of the record's value."""
    episode: EpisodeKey | None = None
    """The message's episode; None for messages of no episode (policy versions) and undecodable ones."""
    turn: int | None = None
    """The agent turn the message asks for (agent-steps only)."""
    outcome: str = "handled"
    """handled (including a handler error, which dead-letters the message), undecodable, or duplicate
    (skipped by the Faust runtime's dedup table)."""
    produced_at: float
    """When the producer sent it: the Kafka record's own timestamp (CreateTime), unix seconds."""
    polled_at: float | None = None
    """Start of the poll that fetched it (run.trace only; the broker-transit figure needs it)."""
    fetched_at: float | None = None
    """When the poll returned it (run.trace only)."""
    started_at: float
    """When its handling started (after any wait for a free slot or for its key)."""
    ended_at: float
    """When its handling ended (before its outputs were produced)."""

    @property
    def episode_id(self) -> str | None:
        return self.episode.episode_id if self.episode is not None else None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Handled)


class TelemetryLog:
    """A worker's telemetry file. With `path` None nothing is written (a worker outside a run folder,
    as in unit tests); with `fetch_times` the poll and fetch times are kept too (`run.trace`)."""

    def __init__(self, path: Path | None, stage: str, fetch_times: bool = False):
        self.stage, self.fetch_times = stage, fetch_times
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "ab", buffering=1 << 16)  # noqa: SIM115 - closed by close()
        self.fetches: dict[tuple[str, int, int], tuple[float, float]] = {}
        self._flushed = time.monotonic()

    def fetched(self, topic: str, partition: int, offset: int, polled_at: float, fetched_at: float) -> None:
        if self.file is not None and self.fetch_times:
            self.fetches[(topic, partition, offset)] = (polled_at, fetched_at)

    def record(self, topic: str, partition: int, offset: int, timestamp_ms: int, value: bytes | None,
               msg: Any, started_at: float, ended_at: float, outcome: str = "handled", stage: str | None = None) -> None:
        """One handled message (`msg` None when it could not be decoded); `stage` defaults to the log's."""
        if self.file is None:
            return
        polled, fetched = self.fetches.pop((topic, partition, offset), (None, None))
        line = Handled(stage=stage or self.stage, topic=topic, partition=partition, offset=offset, bytes=len(value or b""),
                       episode=getattr(msg, "episode", None), turn=getattr(msg, "turn", None), outcome=outcome,
                       produced_at=timestamp_ms / 1000, polled_at=polled, fetched_at=fetched,
                       started_at=started_at, ended_at=ended_at)
        self.file.write(_encoder.encode(line) + b"\n")
        if time.monotonic() - self._flushed >= FLUSH_INTERVAL_S:
            self.file.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def read_telemetry(run_dir: Path | str) -> list[Handled]:
    """Every worker's lines of a run folder (empty for a folder recorded without telemetry)."""
    out: list[Handled] = []
    for path in sorted(RunDir(run_dir).telemetry_dir.glob("*.jsonl")):
        out += [_decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
    return out


def handled(records: Iterable[Handled]) -> list[Handled]:
    """The records of messages a handler ran on (no duplicates skipped, no undecodable bytes)."""
    return [r for r in records if r.outcome == "handled"]


def attempt_records(records: Iterable[Handled], episode_id: str, attempt: int) -> list[Handled]:
    """The records of one attempt of one episode."""
    return [r for r in records if r.episode is not None and r.episode.episode_id == episode_id
            and r.episode.attempt == attempt]


def stage_seconds(records: Iterable[Handled], episodes: set[str] | None = None) -> dict[str, float]:
    """Seconds summed per stage over handled messages (of `episodes` when given): `STAGE` is the
    handling time, `STAGE_queue` the time from production to the start of handling (broker transit
    plus waiting for a free slot)."""
    totals: dict[str, float] = {}
    for r in handled(records):
        if episodes is not None and r.episode_id not in episodes:
            continue
        totals[r.stage] = totals.get(r.stage, 0.0) + (r.ended_at - r.started_at)
        queue = f"{r.stage}_queue"
        totals[queue] = totals.get(queue, 0.0) + max(0.0, r.started_at - r.produced_at)
    return totals


class EpisodeStages(msgspec.Struct, kw_only=True):
    """When one attempt of an episode went through the stages (unix seconds; 0.0: not seen)."""

    issued: float = 0.0
    """The init request's production (the scheduler issued the attempt)."""
    init_start: float = 0.0
    init_end: float = 0.0
    agent_end: float = 0.0
    """The end of its last agent turn's handling."""
    reward_start: float = 0.0
    reward_end: float = 0.0


def episode_stages(records: Iterable[Handled]) -> dict[tuple[str, int], EpisodeStages]:
    """Per (episode id, attempt), its stage times; a message handled twice counts its last handling."""
    out: dict[tuple[str, int], EpisodeStages] = {}
    for r in sorted(handled(records), key=lambda r: r.started_at):
        if r.episode is None:
            continue
        st = out.setdefault((r.episode.episode_id, r.episode.attempt), EpisodeStages())
        if r.stage == "init":
            st.issued, st.init_start, st.init_end = r.produced_at, r.started_at, r.ended_at
        elif r.stage == "agent":
            st.agent_end = max(st.agent_end, r.ended_at)
        elif r.stage == "reward":
            st.reward_start, st.reward_end = r.started_at, r.ended_at
    return out
