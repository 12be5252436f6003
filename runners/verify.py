"""`rollway tasks verify CONFIG`: check any task set with two policies, in this process, in real
sandboxes: the `gold` policy (the task set's `reference_solution`) must resolve every task, and a policy
that does nothing must resolve none."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from rollway.core.config import RunConfig, load_config
from rollway.schemas.messages import Trajectory

DO_NOTHING_SCRIPT = "[{when: '', turns: ['I will not do anything.']}]"
"""The do-nothing policy: one reply without a tool call, every turn."""


async def play_episode(cfg: RunConfig, run_dir: Path, task_id: str, services: Any = None) -> Trajectory:
    """One episode through the init, agent and reward actors, chained in this process (no broker)."""
    from rollway.actors.agent import AgentActor
    from rollway.actors.base import MessageMeta
    from rollway.actors.init import InitActor
    from rollway.actors.reward import RewardActor
    from rollway.actors.services import Services
    from rollway.schemas.messages import EpisodeKey, InitRequest
    from rollway.topics import AGENT_STEPS, TRAJECTORIES

    s = services or Services(cfg, run_dir)
    init, agent, reward = InitActor(s), AgentActor(s), RewardActor(s)
    for actor in (init, agent, reward):
        await actor.setup()
    episode_id = f"verify-{uuid.uuid4().hex[:8]}"
    request = InitRequest(episode=EpisodeKey(episode_id=episode_id, group_id=episode_id, task_id=task_id),
                          issued_at=time.time(),
                          deadline=time.time() + cfg.scheduler.episode_deadline_s)
    [out] = await init.handle(request, MessageMeta("init-requests", 0, 0))
    offset = 0
    while out.topic is AGENT_STEPS:
        [out] = await agent.handle(out.value, MessageMeta("agent-steps", 0, offset))
        offset += 1
    [out] = await reward.handle(out.value, MessageMeta("reward-requests", 0, 0))
    if out.topic is not TRAJECTORIES:
        raise RuntimeError(f"task {task_id}: the episode failed: {out.value}")
    return out.value


def with_policy(config: str | None, overrides: list[str], **policy: Any) -> RunConfig:
    """The config with its `policy` section replaced by `policy` (the config file's policy may be of
    another type, whose keys the new one lacks); the chat-format settings every policy has are kept."""
    current = load_config(config, overrides).policy
    kept = {k: getattr(current, k) for k in ("chat_format", "model", "tokenizer") if k in current.model_fields_set}
    return load_config(config, [*overrides, "policy=" + json.dumps({**kept, **policy})])


async def verify_taskset(config: str | None, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Every task played by the gold policy and by the do-nothing policy; the rows and the totals."""
    from rollway.actors.services import Services

    gold = Services(with_policy(config, overrides, type="gold"), run_dir / "gold")
    nothing = Services(with_policy(config, overrides, type="scripted", script=yaml.safe_load(DO_NOTHING_SCRIPT)),
                       run_dir / "nothing")
    rows = []
    for task in gold.taskset.tasks():
        g = await play_episode(gold.cfg, gold.run_dir, task.task_id, gold)
        n = await play_episode(nothing.cfg, nothing.run_dir, task.task_id, nothing)
        rows.append({"task_id": task.task_id, "gold_resolved": g.resolved, "gold_reward": g.reward,
                     "gold_stop_reason": g.stop_reason, "gold_turns": g.num_turns,
                     "nothing_resolved": n.resolved, "nothing_reward": n.reward})
    return {"total": len(rows), "gold_resolved": sum(r["gold_resolved"] for r in rows),
            "nothing_resolved": sum(r["nothing_resolved"] for r in rows), "tasks": rows}
