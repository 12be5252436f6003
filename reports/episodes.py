"""Recorded episodes (trajectories as plain dicts) from a run folder or from the trajectories topic, and
any topic read back as decoded JSON (`rollway replay TOPIC`)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
from pathlib import Path
from typing import Any

from rollway.base.run_dir import RunDir, read_trajectories


class EpisodeNotFound(LookupError):
    """No episode with that id in the source; the message lists where we looked."""


def load_run_dir(run_dir: Path) -> list[dict[str, Any]]:
    """Trajectories the sink wrote into `run_dir/trajectories.jsonl`, in completion order."""
    path = RunDir(run_dir).trajectories
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass the folder of a finished `rollway up` run")
    trajs = read_trajectories(run_dir)
    return sorted(trajs, key=lambda t: t.get("created_at", 0.0))


def load_topic(bootstrap: str, topic_prefix: str = "", episode_id: str | None = None,
               timeout_s: float = 15.0) -> list[dict[str, Any]]:
    """Trajectories read back from the `trajectories` topic (one per episode id: the first copy)."""
    records: list[dict[str, Any]] = []
    args = argparse.Namespace(topic="trajectories", bootstrap=bootstrap, episode=episode_id, from_offset=None,
                              partition=None, limit=None, topic_prefix=topic_prefix, timeout=timeout_s)
    code = asyncio.run(read_topic(args, records.append))
    if code != 0:
        raise FileNotFoundError(f"topic {topic_prefix}trajectories not found on {bootstrap}; check --topic-prefix")
    seen: dict[str, dict[str, Any]] = {}
    for rec in records:
        value = rec.get("value")
        if value and value["episode"]["episode_id"] not in seen:  # redelivered copies are identical
            seen[value["episode"]["episode_id"]] = value
    return sorted(seen.values(), key=lambda t: t.get("created_at", 0.0))


def find_episode(trajs: list[dict[str, Any]], episode_id: str, source: str) -> dict[str, Any]:
    for t in trajs:
        if t["episode"]["episode_id"] == episode_id:
            return t
    ids = ", ".join(t["episode"]["episode_id"] for t in trajs[:5])
    raise EpisodeNotFound(f"episode {episode_id!r} is not in {source} ({len(trajs)} episodes, e.g. {ids})")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


async def read_topic(args: argparse.Namespace, emit) -> int:
    import msgspec
    from aiokafka import TopicPartition

    from rollway.base.broker import BrokerConfig
    from rollway.runtime.kafka import make_consumer, read_to_end
    from rollway.schemas.codec import DecodeError, decode
    from rollway.topics import get_topic

    spec = get_topic(args.topic)
    name = args.topic_prefix + spec.name
    consumer = await make_consumer(BrokerConfig(connect_timeout_s=args.timeout), args.bootstrap, group_id=None)
    count = 0
    try:
        parts = consumer.partitions_for_topic(name) or set()
        if not parts:
            await consumer._client.force_metadata_update()
            parts = consumer.partitions_for_topic(name) or set()
        if not parts:
            print(f"rollway replay: topic {name!r} does not exist on {args.bootstrap}", file=sys.stderr)
            return 1
        tps = [TopicPartition(name, p) for p in sorted(parts) if args.partition in (None, p)]
        ends = await consumer.end_offsets(tps)
        begins = await consumer.beginning_offsets(tps)
        key_filter = args.episode.encode() if args.episode else None
        for tp in tps:  # partition by partition, each in offset order
            start = max(begins[tp], args.from_offset) if args.from_offset is not None else begins[tp]
            async for _, rec in read_to_end(consumer, {tp: start}, {tp: ends[tp]}):
                if key_filter is not None and rec.key != key_filter:
                    continue
                try:
                    value = msgspec.to_builtins(decode(rec.value, spec.value))
                    error = None
                except DecodeError as err:
                    value, error = None, str(err)
                if key_filter is None and args.episode and value and value["episode"]["episode_id"] != args.episode:
                    continue
                emit({"topic": name, "partition": tp.partition, "offset": rec.offset,
                      "key": rec.key.decode(errors="replace") if rec.key else None,
                      "timestamp_ms": rec.timestamp, "value": _jsonable(value),
                      **({"decode_error": error} if error else {})})
                count += 1
                if args.limit and count >= args.limit:
                    return 0
    finally:
        await consumer.stop()
    return 0
