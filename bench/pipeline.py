"""The pipelined mode: the real `rollway up` job (scheduler, init, agent, reward, learner, sink processes)
on a broker, with the simulated workload; plus the run config both modes share and the log read-back."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiokafka import TopicPartition

from rollway.base.run_dir import RunDir
from rollway.bench.workload import WorkloadConfig
from rollway.config.run import RunConfig, load_config
from rollway.runtime.kafka import make_consumer, partitions_for, read_to_end, topic_name
from rollway.schemas.codec import decode
from rollway.schemas.messages import InitRequest, Trajectory
from rollway.topics import AGENT_STEPS, INIT_REQUESTS, REWARD_REQUESTS, TRAJECTORIES

EPISODE_TOPICS = (INIT_REQUESTS, AGENT_STEPS, REWARD_REQUESTS, TRAJECTORIES)


def run_config(wl: WorkloadConfig, plans_path: Path, sandbox_root: Path, server_url: str, name: str,
               agent_workers: int = 1) -> dict[str, Any]:
    """The job config of one mode (the baseline reads its scheduler's order and actor settings from it
    too). The pipeline's total agent concurrency (model calls at once) equals the baseline's slots and
    the server's cap (plus `model_call_slack`, which the server queues); it and `tool_overlap` are split
    evenly over the agent workers. With carry_over there is no final wave: the batch's end is not the
    end of the stream, and ranking every episode earliest turn first there would put the next step's
    first turns ahead of the batch's last ones."""
    per_worker = -(-(wl.slots + wl.model_call_slack) // agent_workers)
    overlap = -(-wl.tool_overlap // agent_workers)
    return {
        "run": {"name": name, "id": name, "seed": wl.seed, "timeout_s": 1800, "trace": True},
        "topics": {"prefix": f"{name}.", "default_partitions": 8},
        "broker": {"fetch_max_wait_ms": wl.fetch_max_wait_ms},
        "tasks": {"type": "sim", "path": str(plans_path)},
        "sandbox": {"type": "sim", "root": str(sandbox_root)},
        "policy": {"type": "openai", "base_url": server_url, "model": "sim"},
        "scheduler": {"group_size": 1, "max_inflight_episodes": wl.sandbox_bound,
                      "init_lookahead": wl.init_lookahead, "agent_slots": (per_worker + overlap) * agent_workers,
                      "episode_deadline_s": wl.episode_deadline_s, "max_attempts": 2, "order": wl.order,
                      "final_wave": wl.final_wave and not wl.carry_over},
        "init": {"concurrency": wl.init_concurrency},
        "agent": {"concurrency": per_worker, "tool_overlap": overlap,
                  "prefetch": wl.agent_prefetch, "max_turns": wl.turns_max + 1,
                  "max_tokens_per_turn": 8192, "max_total_tokens": 1_000_000},
        "reward": {"concurrency": wl.grade_concurrency},
    }


def load_run_config(data: dict[str, Any], path: Path) -> RunConfig:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_config(path)


@dataclass
class PipelineRun:
    summary: dict[str, Any]
    issued_at: dict[str, float]
    created_at: dict[str, float]
    turns: dict[str, int]
    bytes_per_episode: dict[str, int]
    messages: int
    run_dir: Path
    workers: int
    task_ids: dict[str, str] = field(default_factory=dict)
    """Episode id -> task id (the sim task `sim-NNNNN` names its plan)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def started(self) -> float:
        return min(self.issued_at.values())

    @property
    def ended(self) -> float:
        return max(self.created_at.values())

    @property
    def makespan(self) -> float:
        """First InitRequest issued -> last trajectory created (process start-up excluded)."""
        return self.ended - self.started


def run_pipeline(data: dict[str, Any], run_dir: Path, bootstrap: str, agent_workers: int) -> PipelineRun:
    from rollway.runners.up import parse_workers, run_job

    config_path = RunDir(run_dir).run_config_yaml
    cfg = load_run_config(data, config_path)
    summary = run_job(cfg, str(config_path), [], bootstrap, run_dir,
                      parse_workers([f"agent={agent_workers}"]), quiet=True)
    log = asyncio.run(read_episode_log(cfg, bootstrap))
    return PipelineRun(summary, run_dir=run_dir, workers=agent_workers, **log)


async def read_episode_log(cfg: RunConfig, bootstrap: str) -> dict[str, Any]:
    """Everything the run wrote to the per-episode topics: bytes and messages per episode, issue and
    finish times (read back from the broker, so it counts exactly what crossed it)."""
    consumer = await make_consumer(cfg.broker, bootstrap, group_id=None)
    out: dict[str, Any] = {"issued_at": {}, "created_at": {}, "turns": {}, "messages": 0, "task_ids": {},
                           "bytes_per_episode": defaultdict(int)}
    try:
        for spec in EPISODE_TOPICS:
            name, count = topic_name(spec, cfg.topics), partitions_for(spec, cfg.topics)
            for record in await _read_topic(consumer, name, count):
                episode = record.key.decode()
                out["messages"] += 1
                out["bytes_per_episode"][episode] += len(record.key) + len(record.value)
                if spec is INIT_REQUESTS:
                    msg = decode(record.value, InitRequest)
                    out["issued_at"][episode] = min(msg.issued_at, out["issued_at"].get(episode, msg.issued_at))
                elif spec is TRAJECTORIES:
                    msg = decode(record.value, Trajectory)
                    out["created_at"][episode], out["turns"][episode] = msg.created_at, msg.num_turns
                    out["task_ids"][episode] = msg.task_id
    finally:
        await consumer.stop()
    out["bytes_per_episode"] = dict(out["bytes_per_episode"])
    return out


async def _read_topic(consumer: Any, topic: str, partitions: int) -> list[Any]:
    """Every record of `topic` (the one log scanner: it reads past a short ListOffsets answer)."""
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    ends = await consumer.end_offsets(tps)
    records = [r async for _, r in read_to_end(consumer, dict.fromkeys(tps), ends, timeout_s=120)]
    if len(records) < sum(ends.values()):
        raise RuntimeError(f"reading {topic} back from the broker did not finish within 120 s")
    return records
