"""Runs one actor as a Kafka stream processor: consume, handle (bounded concurrency, in order per
key), produce, then commit; undecodable or failing messages, and inputs whose outputs can never be
produced, go to dead-letters, so no input wedges its partition."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    CorruptRecordException,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
)

from rollway.base.faults import fault_point
from rollway.base.files import write_json_atomic
from rollway.base.redaction import redact
from rollway.runtime import metrics
from rollway.runtime.actor import Actor, FatalActorError, MessageMeta, Output, OutputRefused, StaleMessage
from rollway.runtime.kafka import (
    ensure_topics,
    make_consumer,
    make_producer,
    read_to_end,
    topic_name,
    topic_partitions,
)
from rollway.runtime.queue import Backlog, KeyLocks
from rollway.runtime.settings import StreamConfig
from rollway.runtime.telemetry import TelemetryLog
from rollway.schemas.codec import DecodeError, EncodeError, decode, encode
from rollway.schemas.messages import AgentStep, DeadLetter
from rollway.topics import DEAD_LETTERS, TopicSpec
from rollway.topics.topology import UndeclaredOutput, check_output

log = structlog.get_logger()

COMMIT_INTERVAL_S = 0.5
TICK_INTERVAL_S = 0.2
TOPIC_CHECK_INTERVAL_S = 5.0
STATUS_INTERVAL_S = 0.5
LATE_READ_S = 30.0
"""How long a stage whose work is done (the scheduler once every episode ended) goes on reading its inputs to
where they ended then, so a finished run leaves none of them unread."""
LAG_INTERVAL_S = 1.0
"""How often a worker asks the broker for its partitions' log end offsets (the consumer lag metric)."""
LAG_TIMEOUT_S = 2.0
"""The loop waits at most this long for those answers (a broker that is away must not hold the loop)."""
MAX_REASON_CHARS = 4000
"""A dead letter's reason is cut to this: error texts may quote hostile model output."""

REFUSED_BY_BROKER = (MessageSizeTooLargeError, RecordListTooLargeError, CorruptRecordException)
"""Produce errors about the message itself: no retry can deliver it (every other KafkaError is
retried, since a broker that is away or electing a leader answers with one of those)."""
RECORD_OVERHEAD_BYTES = 512
"""Room kept under `broker.max_message_bytes` for the record batch's own header."""

Produce = Callable[[str, bytes | None, bytes], Awaitable[Any]]
"""(topic, key, value) -> awaits the broker's ack."""


async def handle_or_dead_letter(actor: Actor, msg: Any, meta: MessageMeta,
                                dead_letter_for: Callable[[str], Output]) -> list[Output]:
    """`actor.handle`, or on an exception the dead letter plus the actor's failure outputs: a failing
    message must not stop the stage (shared by the aiokafka and Faust runtimes). A `StaleMessage`
    is an expected redelivery: skipped with an info line, nothing produced."""
    try:
        return await actor.handle(msg, meta)
    except (asyncio.CancelledError, FatalActorError):
        raise
    except StaleMessage as err:
        metrics.REDELIVERIES.labels(actor.name).inc()
        log.info("stale redelivery skipped", stage=actor.name, offset=meta.offset, reason=str(err)[:500])
        return []
    except Exception as err:  # noqa: BLE001 - see docstring
        log.exception("handler failed; message dead-lettered", stage=actor.name,
                      episode_id=getattr(msg, "episode_id", None), offset=meta.offset)
        return [dead_letter_for(f"handler: {type(err).__name__}: {err}"), *failure_outputs(actor, msg, err)]


def failure_outputs(actor: Actor, msg: Any, error: BaseException) -> list[Output]:
    """The actor's `on_error` outputs for a decoded input (none for an undecodable one). A raising
    `on_error` is logged and yields none: the dead letter still goes out."""
    if msg is None:
        return []
    try:
        return actor.on_error(msg, error)
    except Exception:  # noqa: BLE001 - see docstring
        log.exception("on_error failed; only the dead letter is produced", stage=actor.name)
        return []


class OutputSender:
    """Encodes and produces a worker's outputs, each acknowledged by the broker before the next.
    Retries with backoff while the broker is away (a broker restart loses no output); raises
    `OutputRefused` for an output no retry can deliver (unencodable, over `broker.max_message_bytes`,
    refused by the broker for what it is), so its input is dead-lettered instead of retried forever."""

    def __init__(self, stage: str, cfg: StreamConfig, produce: Produce, stats: dict[str, int],
                 on_backoff: Callable[[float], Awaitable[None]] | None = None):
        self.stage, self.cfg, self.produce, self.stats, self.on_backoff = stage, cfg, produce, stats, on_backoff

    def encode(self, out: Output) -> tuple[str, bytes | None, bytes]:
        """(topic, key, value) of `out`, or OutputRefused when it cannot be a message on this broker."""
        what = f"{type(out.value).__name__} for {out.topic.name}"
        if out.topic is not DEAD_LETTERS:  # the runtime's own; every other output is the actor's
            try:
                check_output(self.stage, out.topic)
            except UndeclaredOutput as err:
                raise OutputRefused(str(err)) from None
        try:
            value = encode(out.value)
        except EncodeError as err:
            raise OutputRefused(f"{what} cannot be encoded: {err}") from None
        key = out.key.encode() if out.key is not None else None
        size, limit = len(value) + len(key or b"") + RECORD_OVERHEAD_BYTES, self.cfg.broker.max_message_bytes
        if size > limit:
            raise OutputRefused(f"{what} is {size} bytes, over broker.max_message_bytes={limit}; raise that limit "
                                "(and the broker's, see docs/security/operations.md) or bound the episode "
                                "(fewer turns, shorter outputs)")
        return topic_name(out.topic, self.cfg.topics), key, value

    def encode_all(self, outputs: list[Output]) -> list[tuple[str, bytes | None, bytes]]:
        """Every output encoded, or OutputRefused for the first that cannot be a message (the in-process
        driver checks its outputs with it too)."""
        encoded = []
        for out in outputs:
            try:
                encoded.append(self.encode(out))
            except OutputRefused as err:
                self.refused(err, out)
                raise
        return encoded

    def refused(self, err: OutputRefused, out: Output) -> None:
        """`err` given the refused output and the room a message has here, for the actor's `on_error`."""
        err.output, err.room = out, self.cfg.broker.max_message_bytes - RECORD_OVERHEAD_BYTES

    async def send(self, outputs: list[Output]) -> None:
        encoded = self.encode_all(outputs)  # all first: an unencodable output produces none
        for out, (topic, key, value) in zip(outputs, encoded, strict=True):
            try:
                await self._produce(topic, key, value)
            except OutputRefused as err:
                self.refused(err, out)
                raise
            self.stats["produced"] += 1
            metrics.PRODUCED.labels(self.stage).inc()

    async def _produce(self, topic: str, key: bytes | None, value: bytes) -> None:
        delay = 0.2
        while True:
            try:
                await self.produce(topic, key, value)
                return
            except REFUSED_BY_BROKER as err:
                raise OutputRefused(f"the broker refused a {len(value)}-byte message for {topic}: "
                                    f"{type(err).__name__}: {err}") from None
            except KafkaError as err:
                log.warning("produce failed, retrying", stage=self.stage, error=str(err), retry_in_s=delay)
                await asyncio.sleep(delay)
                if self.on_backoff is not None:
                    await self.on_backoff(delay)
                delay = min(delay * 2, 5.0)
            except Exception as err:  # noqa: BLE001 - the client rejected this message itself
                raise OutputRefused(f"the producer rejected a {len(value)}-byte message for {topic}: "
                                    f"{type(err).__name__}: {err}") from None

    async def send_each(self, outputs: list[Output], what: str) -> None:
        """Produce outputs that belong to no input (a tick's): one that can never be produced is
        logged and dropped, the others still go out."""
        for out in outputs:
            try:
                await self.send([out])
            except OutputRefused as err:
                log.error(f"a {what} output can never be produced; dropped", stage=self.stage, reason=str(err)[:500])


async def deliver(sender: OutputSender, actor: Actor, outputs: list[Output], msg: Any,
                  dead_letter_for: Callable[[str], Output]) -> None:
    """Produce one input's outputs. When one can never be produced, dead-letter the input with the
    reason and produce the actor's failure outputs instead (so the scheduler learns of the failed
    episode now, not at its deadline). Never raises OutputRefused: the input is always finished."""
    try:
        await sender.send(outputs)
        return
    except OutputRefused as err:
        refused = err
    log.error("an output can never be produced; its input is dead-lettered", stage=actor.name,
              reason=str(refused)[:500])
    await send_dead_letter(sender, dead_letter_for(f"output: {refused}"))
    await sender.send_each(failure_outputs(actor, msg, refused), "failure")


async def send_dead_letter(sender: OutputSender, letter: Output) -> None:
    """Produce a dead letter; one too large with the input's bytes goes out without them."""
    try:
        await sender.send([letter])
        return
    except OutputRefused:
        pass
    value: DeadLetter = letter.value
    size = len(value.value or b"")
    slim = msgspec.structs.replace(value, value=None, reason=f"{value.reason} (the input's {size} bytes are left "
                                   "out: with them this dead letter is over broker.max_message_bytes)")
    await sender.send_each([Output(letter.topic, letter.key, slim)], "dead-letter")


def dead_letter(stage: str, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                reason: str) -> Output:
    """The dead-letters message for one input: original bytes, reason and source."""
    reason = redact(reason)  # an error quoting a secret must not reach the broker's log
    log.warning("dead letter", stage=stage, topic=topic, partition=partition, offset=offset, reason=reason[:500])
    return Output(DEAD_LETTERS, None, DeadLetter(source_topic=topic, partition=partition, offset=offset, key=key,
                                                 value=value, reason=reason[:MAX_REASON_CHARS], stage=stage,
                                                 at=time.time()))


class OffsetTracker:
    """Per partition: offsets handed out and not yet finished. The committable offset is the lowest
    unfinished one (or one past the highest fetched), so a crash never skips an unfinished message."""

    def __init__(self) -> None:
        self.pending: dict[TopicPartition, set[int]] = defaultdict(set)
        self.fetched: dict[TopicPartition, int] = {}
        self.committed: dict[TopicPartition, int] = {}

    def start(self, tp: TopicPartition, offset: int) -> None:
        self.pending[tp].add(offset)
        self.fetched[tp] = max(self.fetched.get(tp, -1), offset)

    def finish(self, tp: TopicPartition, offset: int) -> None:
        self.pending[tp].discard(offset)

    def to_commit(self, held: set[tuple[str, int, int]] = frozenset()) -> dict[TopicPartition, int]:
        out = {}
        for tp, high in self.fetched.items():
            blocked = self.pending[tp] | {o for t, p, o in held if t == tp.topic and p == tp.partition}
            pos = min(blocked) if blocked else high + 1
            if self.committed.get(tp) != pos:
                out[tp] = pos
        return out

    def forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self.pending.pop(tp, None)
            self.fetched.pop(tp, None)
            self.committed.pop(tp, None)


class StageWorker:
    """One worker process of one stage (a member of the stage's consumer group)."""

    def __init__(self, actor: Actor, cfg: StreamConfig, bootstrap: str, concurrency: int, group_id: str,
                 prefetch: int = 0, telemetry_path: Path | None = None, status_path: Path | None = None,
                 sole_worker: bool = False):
        self.actor, self.cfg, self.bootstrap = actor, cfg, bootstrap
        self.sole_worker = sole_worker
        """The only worker its stage will ever have (a one-process job, runners/local_stages.py): it takes
        every partition of its inputs itself instead of joining the group (no join wait), committing
        under the same group id, so a restart, `consumer_lag` and a resumed run read the same offsets."""
        self.concurrency = concurrency
        self.prefetch = prefetch
        """Messages fetched beyond `concurrency` into `backlog`, started by `actor.priority`."""
        self.backlog = Backlog()
        self.telemetry = TelemetryLog(telemetry_path, actor.name, fetch_times=cfg.run.trace)
        """One line per handled message (runtime/telemetry.py); nothing without a path."""
        self.group_id = group_id
        self.specs: dict[str, TopicSpec] = {topic_name(t, cfg.topics): t for t in actor.inputs}
        self.offsets = OffsetTracker()
        self.tasks: dict[asyncio.Task, TopicPartition] = {}
        self.sending: set[asyncio.Task] = set()
        """Tasks past `handle`, producing their outputs: a revocation lets them finish."""
        self.fatal: BaseException | None = None
        self.key_locks = KeyLocks()
        self.stats = {"handled": 0, "dead_lettered": 0, "produced": 0}
        self.producer = self.consumer = None
        self.sender = OutputSender(actor.name, cfg, self._produce, self.stats, self._backoff)
        self.status_path = status_path
        """Small JSON file with this worker's counts, rewritten at most every STATUS_INTERVAL_S (for
        `rollway up`'s progress display)."""
        self._status_written = 0.0
        self.metrics = metrics.WorkerMetrics(actor.name, concurrency)
        self._committed_before: dict[TopicPartition, int] = {}
        """The group's committed offset of owned partitions this worker has not committed itself yet."""

    async def observe_lag(self) -> None:
        """Per owned partition: log end offset minus the group's committed offset (Kafka's consumer lag).
        The end is the larger of ListOffsets' answer and the last fetch's high watermark (a broker may
        answer ListOffsets one short, runtime/kafka.py: log_end_offsets)."""
        tps = sorted(self.consumer.assignment())
        try:
            ends = await asyncio.wait_for(self._lag_inputs(tps), LAG_TIMEOUT_S) if tps else {}
        except Exception as err:  # noqa: BLE001 - a metric never stops the stage (a broker away, a rebalance)
            log.debug("consumer lag not measured this round", stage=self.actor.name, error=repr(err))
            return
        lags = {}
        for tp in tps:
            end = max(ends.get(tp, 0), self.consumer.highwater(tp) or 0)
            committed = self.offsets.committed.get(tp, self._committed_before.get(tp, 0))
            lags[(tp.topic, tp.partition)] = max(0, end - committed)
        self.metrics.lag(lags)

    async def _lag_inputs(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The partitions' end offsets; and, once per partition, the group's committed offset (its beginning
        when none) for partitions this worker has not committed yet."""
        ends = await self.consumer.end_offsets(tps)
        for tp in tps:
            if tp not in self.offsets.committed and tp not in self._committed_before:
                committed = await self.consumer.committed(tp)
                if committed is None:
                    committed = (await self.consumer.beginning_offsets([tp]))[tp]
                self._committed_before[tp] = committed
        return ends

    def write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.status_path is None or (not force and now - self._status_written < STATUS_INTERVAL_S):
            return
        self._status_written = now
        status = {"stage": self.actor.name, "pid": os.getpid(), "in_flight": len(self.tasks),
                  "backlog": len(self.backlog), **self.stats, "updated_at": time.time(),
                  "partitions": len(self.consumer.assignment()) if self.consumer is not None else 0}
        self.status_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.status_path, status)

    async def run(self, stop: asyncio.Event) -> None:
        self.producer = await make_producer(self.cfg.broker, self.bootstrap)
        try:
            self.consumer = await make_consumer(self.cfg.broker, self.bootstrap, group_id=self.group_id,
                                                max_poll_interval_ms=self.cfg.broker.max_poll_interval_ms)
            if self.sole_worker:
                await self._assign_all()
            else:
                self.consumer.subscribe(list(self.specs), listener=_Rebalance(self))
            await self.actor.setup()
            gc.freeze()  # see runtime.faust: full collections skip what imports and setup made
            log.info("stage worker started", stage=self.actor.name, group=self.group_id,
                     topics=list(self.specs), concurrency=self.concurrency)
            await self._loop(stop)
            await self._drain()
            await self.observe_lag()  # the final figures a last scrape reads
            self.metrics.loop(len(self.tasks), len(self.backlog), False, len(self.consumer.assignment()))
        finally:
            await self.actor.close()
            if self.consumer is not None:
                await self.consumer.stop()
            await self.producer.stop()
            self.telemetry.close()
            self.write_status(force=True)
            log.info("stage worker stopped", stage=self.actor.name, **self.stats)

    async def _loop(self, stop: asyncio.Event) -> None:
        last_commit = last_tick = last_lag = 0.0
        last_topic_check = time.monotonic()
        finish: tuple[float, dict[TopicPartition, int]] | None = None
        while not stop.is_set():
            if self.actor.done:
                finish = finish or (time.monotonic() + LATE_READ_S, await self._input_ends())
                if await self._read_up_to(*finish):
                    break
            if self.fatal is not None:
                raise self.fatal
            free = self.concurrency + self.prefetch - len(self.tasks) - len(self.backlog)
            if free > 0:
                self._pause(False)
                polled_at = time.time()
                batches = await self.consumer.getmany(timeout_ms=100, max_records=free)
                for tp, records in batches.items():
                    for record in records:
                        self._admit(tp, record, polled_at)
            else:
                # Keep polling with every partition paused: polls keep the group membership alive
                # (max_poll_interval_ms) however long the handlers take, and fetch nothing.
                self._pause(True)
                self.metrics.paused.set(1)
                await self.consumer.getmany(timeout_ms=0)
                if self.tasks:  # a rebalance inside that poll may have released every handler
                    await asyncio.wait(list(self.tasks), timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
            now = time.monotonic()
            if now - last_topic_check >= TOPIC_CHECK_INTERVAL_S and not self.consumer.assignment():
                await self._recreate_topics()  # a restarted in-memory broker comes back empty
                last_topic_check = now
            if now - last_tick >= TICK_INTERVAL_S:
                await self.sender.send_each(await self.actor.tick(), "tick")
                last_tick = now
            # Every COMMIT_INTERVAL_S while busy; at once when idle, so a finished job's last offsets are
            # committed in one poll, not half a second later (commit() sends nothing when nothing moved).
            if now - last_commit >= COMMIT_INTERVAL_S or not self.tasks:
                await self.commit()
                last_commit = now
            if now - last_lag >= LAG_INTERVAL_S:
                await self.observe_lag()
                last_lag = now
            self.metrics.loop(len(self.tasks), len(self.backlog), free <= 0, len(self.consumer.assignment()))
            self.write_status()

    async def _input_ends(self) -> dict[TopicPartition, int]:
        tps = sorted(self.consumer.assignment())
        try:
            return await asyncio.wait_for(self.consumer.end_offsets(tps), LAG_TIMEOUT_S) if tps else {}
        except Exception:  # noqa: BLE001 - a broker away: nothing more is read
            return {}

    async def _read_up_to(self, until: float, ends: dict[TopicPartition, int]) -> bool:
        """Whether a done stage has handled its inputs up to `ends` (or `until` has passed). The messages it
        reads after its work is done are late ones about that work (reward requests of episodes already
        graded, for the scheduler): handled as any, they change nothing, and once committed the stage's
        inputs show no lag at the run's end, and a restart is handed none of them again."""
        if time.monotonic() > until:
            return True
        if self.tasks or self.backlog:
            return False
        for tp, end in ends.items():
            try:
                if tp in self.consumer.assignment() and await self.consumer.position(tp) < end:
                    return False
            except Exception:  # noqa: BLE001 - a partition given away meanwhile: its new owner reads it
                continue
        return True

    async def _assign_all(self) -> None:
        """Own every partition of the inputs (the topics exist: `ensure_topics` ran before)."""
        tps = await topic_partitions(self.consumer, self.specs)
        missing = [name for name in self.specs if not any(tp.topic == name for tp in tps)]
        if missing:
            raise RuntimeError(f"input topics without partitions on the broker: {', '.join(missing)}")
        self.consumer.assign(tps)
        log.info("partitions assigned", stage=self.actor.name, sole_worker=True,
                 partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in tps))
        self.write_status(force=True)

    def _pause(self, paused: bool) -> None:
        assigned = self.consumer.assignment()
        if paused:
            self.consumer.pause(*assigned)
        elif self.consumer.paused():
            self.consumer.resume(*self.consumer.paused())

    def _admit(self, tp: TopicPartition, record: Any, polled_at: float) -> None:
        """Start a fetched message now or, with prefetch, queue it by priority (its offset stays
        uncommitted meanwhile, so a crash or a rebalance cannot skip it)."""
        self.telemetry.fetched(tp.topic, tp.partition, record.offset, polled_at, time.time())
        if not self.prefetch:
            self._spawn(tp, record)
            return
        self.offsets.start(tp, record.offset)
        epoch = self.actor.priority_epoch
        self.backlog.push(self._priority(tp, record), tp, record)
        if self.actor.priority_epoch != epoch:
            self.backlog.rerank(self._priority)
        self._start_backlog()

    def _priority(self, tp: TopicPartition, record: Any) -> float:
        try:
            return self.actor.priority(decode(record.value, self.specs[tp.topic].value))
        except DecodeError:
            return float("inf")  # dead-letter it right away

    def _start_backlog(self, _done: Any = None) -> None:
        while self.backlog and len(self.tasks) < self.concurrency:
            self._spawn(*self.backlog.pop())

    def _spawn(self, tp: TopicPartition, record: Any) -> None:
        self.offsets.start(tp, record.offset)
        task = asyncio.create_task(self._process(tp, record))
        self.tasks[task] = tp
        task.add_done_callback(self.tasks.pop)
        task.add_done_callback(self.sending.discard)
        if self.prefetch:
            task.add_done_callback(self._start_backlog)  # a freed slot takes the best queued message

    async def _process(self, tp: TopicPartition, record: Any) -> None:
        try:
            await self._handle_and_send(tp, record)
        except FatalActorError as err:
            log.error("actor failed fatally; the worker stops and its restart resumes from the committed "
                      "offsets", stage=self.actor.name, error=str(err))
            self.fatal = err
        except Exception as err:  # noqa: BLE001 - a runtime fault: raised by the loop, never lost
            log.exception("stage runtime failed on a message; the worker stops", stage=self.actor.name,
                          topic=tp.topic, partition=tp.partition, offset=record.offset)
            self.fatal = err

    async def _handle_and_send(self, tp: TopicPartition, record: Any) -> None:
        spec = self.specs[tp.topic]
        meta = MessageMeta(tp.topic, tp.partition, record.offset, record.timestamp)
        msg = None
        try:
            msg = decode(record.value, spec.value)
        except DecodeError as err:
            now = time.time()
            outputs = [self._dead_letter(record, tp, f"decode: {err}")]
            self.telemetry.record(tp.topic, tp.partition, record.offset, record.timestamp, record.value, None,
                                  now, now, outcome="undecodable")
            self.metrics.handled(tp.topic, "undecodable", record.timestamp / 1000, now, now)
        else:
            async with self.key_locks.hold(record.key):
                # Every log line written while handling carries the episode id.
                with structlog.contextvars.bound_contextvars(episode_id=getattr(msg, "episode_id", None)):
                    started = time.time()
                    outputs = await handle_or_dead_letter(self.actor, msg, meta,
                                                          lambda r: self._dead_letter(record, tp, r))
                    self.stats["handled"] += 1
                    ended = time.time()
                    self.telemetry.record(tp.topic, tp.partition, record.offset, record.timestamp, record.value,
                                          msg, started, ended)
                    self.metrics.handled(tp.topic, "handled", record.timestamp / 1000, started, ended)
        self.sending.add(asyncio.current_task())
        await deliver(self.sender, self.actor, outputs, msg, lambda r: self._dead_letter(record, tp, r))
        self.offsets.finish(tp, record.offset)

    def _dead_letter(self, record: Any, tp: TopicPartition, reason: str) -> Output:
        self.stats["dead_lettered"] += 1
        self.metrics.dead_letter(reason)
        return dead_letter(self.actor.name, tp.topic, tp.partition, record.offset, record.key, record.value, reason)

    async def _produce(self, topic: str, key: bytes | None, value: bytes) -> None:
        await self.producer.send_and_wait(topic, value, key=key)

    async def _backoff(self, delay: float) -> None:
        if delay >= 1.6:
            await self._recreate_topics()  # a restarted in-memory broker comes back without topics

    async def _recreate_topics(self) -> None:
        try:
            await ensure_topics(self.cfg.broker, self.cfg.topics, self.bootstrap)
        except Exception as err:  # noqa: BLE001 - the broker may still be down; the caller retries
            log.warning("could not (re)create topics", stage=self.actor.name, error=str(err))

    async def commit(self, tps: set[TopicPartition] | None = None) -> None:
        held = self.actor.held_offsets()
        offsets = {tp: o for tp, o in self.offsets.to_commit(held).items() if tps is None or tp in tps}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self.offsets.committed.update(offsets)
        except KafkaError as err:
            log.warning("commit failed; will retry", stage=self.actor.name, error=str(err))

    async def release(self, tps: set[TopicPartition], timeout_s: float, grace_s: float = 0.0) -> None:
        """Before `tps` move to another worker: give their running handlers `grace_s` to finish (a turn
        cancelled after its tool calls started is one the new owner must refuse to run again, and its
        attempt is lost), then cancel those still running (the new owner runs those messages again, so
        these must not produce afterwards) and let the ones already producing finish (bounded by
        `timeout_s`)."""
        tasks = [t for t, tp in self.tasks.items() if tp in tps]
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        for task in tasks:
            if task not in self.sending and not task.done():
                task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for task in tasks:
            if not task.done():  # a produce stuck past the timeout: stop it too
                task.cancel()

    async def _drain(self, timeout_s: float = 30.0) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        await self.commit()


REVOKE_GRACE_S = 4.0
"""How long a worker giving partitions away lets their running handlers finish before cancelling them."""


class _Rebalance(ConsumerRebalanceListener):
    """Before giving partitions away, cancel their running handlers, let their produces finish and
    commit what finished, so the next owner neither skips work nor races a handler of this worker."""

    def __init__(self, worker: StageWorker):
        self.worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.worker.backlog.drop(set(revoked))
        # The grace stays under the group's rebalance timeout (aiokafka's default: the session timeout).
        grace = min(REVOKE_GRACE_S, self.worker.cfg.broker.session_timeout_ms / 1000 * 0.6)
        await self.worker.release(set(revoked), timeout_s=10.0, grace_s=grace)
        fault_point("rebalance.revoked")
        await self.worker.commit(set(revoked))
        self.worker.offsets.forget(set(revoked))
        for tp in revoked:
            self.worker._committed_before.pop(tp, None)
        self.worker.metrics.forget({(tp.topic, tp.partition) for tp in revoked})

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("partitions assigned", stage=self.worker.actor.name,
                 partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))
        self.worker.write_status(force=True)  # `rollway up` starts the scheduler once every worker has some


class LogReader:
    """Reads one episode's agent-steps back from the log (for a worker that lacks it in memory)."""

    def __init__(self, cfg: StreamConfig, bootstrap: str):
        self.cfg, self.bootstrap = cfg, bootstrap
        self.consumer = None
        self.lock = asyncio.Lock()

    async def __call__(self, topic: str, partition: int, from_offset: int, episode_id: str) -> list[tuple[int, AgentStep]]:
        async with self.lock:
            if self.consumer is None:
                self.consumer = await make_consumer(self.cfg.broker, self.bootstrap, group_id=None)
            tp = TopicPartition(topic, partition)
            self.consumer.assign([tp])
            end = (await self.consumer.end_offsets([tp]))[tp]
            out: list[tuple[int, AgentStep]] = []
            key = episode_id.encode()
            async for _, record in read_to_end(self.consumer, {tp: from_offset}, {tp: end}):
                if record.key == key:
                    try:
                        out.append((record.offset, decode(record.value, AgentStep)))
                    except DecodeError:
                        continue
            return out

    async def close(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
