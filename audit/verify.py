"""`rollway tasks verify CONFIG`: check any task set with two policies, in this process, in real
sandboxes: the `gold` policy (the task set's `reference_solution`) must resolve every task, and a policy
that does nothing must resolve none. Tasks built by changing a snapshot (buglocal, SWE rows) are also
probed for answer leaks (`envs/leak_probe.py`): no channel may single out the changed file."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import yaml

from rollway.actors.services import Services
from rollway.base.run_dir import RunDir
from rollway.config.run import RunConfig, load_config
from rollway.envs.leak_probe import probe_task
from rollway.runtime.inprocess import InProcessDriver
from rollway.schemas.messages import EpisodeKey, Trajectory

DO_NOTHING_SCRIPT = "[{when: '', turns: ['I will not do anything.']}]"
"""The do-nothing policy: one reply without a tool call, every turn."""


async def play_episode(cfg: RunConfig, run_dir: Path, task_id: str, services: Any = None,
                       prefix: str = "verify") -> Trajectory:
    """One episode of `task_id` through the rollout stages, in this process (no broker); its id `PREFIX-HEX`."""
    async with InProcessDriver(services or Services(cfg, run_dir)) as driver:
        return await driver.play(verify_key(task_id, prefix))


def verify_key(task_id: str, prefix: str = "verify") -> EpisodeKey:
    episode_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
    return EpisodeKey(episode_id=episode_id, group_id=episode_id, task_id=task_id)


def with_policy(config: str | None, overrides: list[str], **policy: Any) -> RunConfig:
    """The config with its `policy` section replaced by `policy` (the config file's policy may be of
    another type, whose keys the new one lacks); the chat-format settings every policy has are kept."""
    current = load_config(config, overrides).policy
    kept = {k: getattr(current, k) for k in ("chat_format", "model", "tokenizer") if k in current.model_fields_set}
    return load_config(config, [*overrides, "policy=" + json.dumps({**kept, **policy})])


async def verify_taskset(config: str | None, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Every task played by the gold policy and by the do-nothing policy; the rows and the totals."""
    gold = Services(with_policy(config, overrides, type="gold"), RunDir(run_dir).sub("gold").path)
    nothing = Services(with_policy(config, overrides, type="scripted", script=yaml.safe_load(DO_NOTHING_SCRIPT)),
                       RunDir(run_dir).sub("nothing").path)
    rows = []
    async with InProcessDriver(gold) as gold_driver, InProcessDriver(nothing) as nothing_driver:
        for task in gold.taskset.tasks():
            g, n = [await driver.play(verify_key(task.task_id)) for driver in (gold_driver, nothing_driver)]
            for services, traj in ((gold, g), (nothing, n)):
                keep_trajectory(services.run_dir, traj)
            row = {"task_id": task.task_id, "gold_resolved": g.resolved, "gold_reward": g.reward,
                   "gold_stop_reason": g.stop_reason, "gold_turns": g.num_turns,
                   "nothing_resolved": n.resolved, "nothing_reward": n.reward}
            if not g.resolved:
                row["gold_why"] = why_unresolved(g, gold.cfg)
            probed = await probe_task(gold.taskset, task, gold.sandboxes, f"verify-leak-{uuid.uuid4().hex[:8]}")
            if probed is not None:
                row["leaks"] = {c: probed["report"]["channels"][c] for c in probed["leaks"]}
            rows.append(row)
    return {"total": len(rows), "gold_resolved": sum(r["gold_resolved"] for r in rows),
            "nothing_resolved": sum(r["nothing_resolved"] for r in rows),
            "leaking": sum(bool(r.get("leaks")) for r in rows), "tasks": rows,
            "trajectories": {"gold": str(RunDir(gold.run_dir).trajectories),
                             "nothing": str(RunDir(nothing.run_dir).trajectories)}}


def keep_trajectory(run_dir: Path, traj: Trajectory) -> None:
    """Append the episode to `run_dir/trajectories.jsonl`, as the sink writes it (`rollway show DIR`)."""
    from rollway.actors.sink import append_line
    from rollway.schemas.codec import to_builtins

    run_dir.mkdir(parents=True, exist_ok=True)
    append_line(RunDir(run_dir).trajectories, json.dumps(to_builtins(traj)))


def why_unresolved(traj: Trajectory, cfg: RunConfig) -> str:
    """What a person checks first when the reference solution did not resolve its task: a turn the
    token limits cut, the turn limit, a tool error, else the grade's own outcome."""
    cut = [t.turn for t in traj.turns if t.finish_reason == "length"]
    if cut:
        return (f"turn(s) {cut} of the reference solution were cut at agent.max_tokens_per_turn="
                f"{cfg.agent.max_tokens_per_turn}: raise it")
    if traj.stop_reason in ("max_turns", "max_tokens", "prompt_too_long"):
        limit = {"max_turns": f"agent.max_turns={cfg.agent.max_turns}",
                 "max_tokens": f"agent.max_total_tokens={cfg.agent.max_total_tokens}",
                 "prompt_too_long": f"agent.max_total_tokens={cfg.agent.max_total_tokens}"}[traj.stop_reason]
        return f"the episode stopped at {limit} ({traj.stop_reason}) before the solution ended: raise it"
    errors = [f"turn {t.turn}: {o.content[:200]}" for t in traj.turns for o in t.observations if o.is_error]
    if errors:
        return "a tool call of the reference solution failed: " + errors[0]
    return f"graded {traj.reward} ({traj.grade.get('outcome') or traj.stop_reason})"
