"""The benchmark's seeded workload, its ideal makespan, the simulated server and sandbox, and the scheduler knobs."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import ROOT, run

from rollway.actors.base import MessageMeta
from rollway.actors.scheduler import SchedulerActor
from rollway.actors.services import Services
from rollway.bench.report import bytes_vs_turns, linear_fit, utilisation_series
from rollway.bench.sim_server import SimEngine, busy_stats
from rollway.bench.workload import WorkloadConfig, ideal_makespan, plan_episode, plan_workload
from rollway.core.config import load_config
from rollway.policies.chat import BytesChatML
from rollway.runners.stage_queue import Backlog
from rollway.sandboxes.base import SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.sim import SIM_SPEC_FILE, SimSandboxProvider, live_sandbox_stats
from rollway.schemas import RewardRequest, Trajectory


def test_workload_is_a_pure_function_of_seed_and_episode_index():
    cfg = WorkloadConfig(episodes=20, seed=7)
    assert plan_workload(cfg) == plan_workload(cfg)
    # Episode k does not depend on how many episodes there are, only on (seed, k).
    assert plan_workload(WorkloadConfig(episodes=5, seed=7)) == plan_workload(cfg)[:5]
    assert plan_episode(cfg, 3) == plan_workload(cfg)[3]
    other = plan_workload(WorkloadConfig(episodes=20, seed=8))
    assert [e.num_turns for e in other] != [e.num_turns for e in plan_workload(cfg)]
    for e in plan_workload(cfg):
        assert 2 <= e.num_turns <= cfg.turns_max
        assert '"finish"' in e.turns[-1].text and all('"bash"' in t.text for t in e.turns[:-1])
        assert all(t.completion_tokens == len(t.text.encode()) + 1 for t in e.turns)


def test_ideal_makespan_takes_the_binding_resource():
    cfg = WorkloadConfig(episodes=12, grade_concurrency=1, grade_s_median=5.0)
    ideal = ideal_makespan(plan_workload(cfg), cfg)
    assert ideal["bottleneck"] == "grading"
    assert ideal["ideal_makespan"] >= sum(e.grade_s for e in plan_workload(cfg))
    fast = ideal_makespan(plan_workload(cfg.model_copy(update={"grade_concurrency": 12})), cfg)
    assert fast["ideal_makespan"] >= fast["critical_path"] and fast["ideal_makespan"] >= fast["joint"]


def generate_all(engine: SimEngine, prompts: list[list[int]]) -> float:
    async def go() -> float:
        task = asyncio.create_task(engine.run())
        t0 = time.time()
        await asyncio.gather(*(engine.generate(p, 10_000) for p in prompts))
        task.cancel()
        return time.time() - t0
    return run(go())


def test_sim_server_step_time_grows_with_concurrent_sequences():
    cfg = WorkloadConfig(episodes=8, thought_tokens_median=10, thought_tokens_sigma=0)
    plans = {p.index: p for p in plan_workload(cfg)}
    chat = BytesChatML()
    prompts = [chat.initial([{"role": "user", "content": plans[i].prompt}], []) for i in range(8)]
    tokens = max(len(plans[i].turns[0].text) + 1 for i in range(8))
    alone = SimEngine(plans, a=0.002, b=0.002, p=0.0, cap=8)
    t1 = generate_all(alone, prompts[:1])
    crowded = SimEngine(plans, a=0.002, b=0.002, p=0.0, cap=8)
    t8 = generate_all(crowded, prompts)
    assert t1 == pytest.approx(len(alone.steps) * 0.004, rel=0.3)
    assert t8 > 2.5 * t1, "8 sequences at once must decode each token much slower than one"
    assert max(n for _, _, n in crowded.steps) == 8
    assert len(crowded.steps) <= tokens + 1
    capped = SimEngine(plans, a=0.002, b=0.0, p=0.0, cap=2)
    generate_all(capped, prompts[:6])
    assert max(n for _, _, n in capped.steps) == 2, "the cap bounds running sequences"


def test_busy_fraction_and_mean_active_sequences():
    steps = [(0.0, 1.0, 2), (1.0, 2.0, 4), (3.0, 4.0, 1)]  # idle from 2 to 3 and after 4
    stats = busy_stats(steps, 0.0, 5.0, cap=4)
    assert stats["busy_fraction"] == pytest.approx(3 / 5)
    assert stats["mean_active_sequences"] == pytest.approx(7 / 5)
    assert busy_stats(steps, 0.5, 1.5, cap=4)["mean_active_sequences"] == pytest.approx(3.0)
    series = utilisation_series(steps, 0.0, 5.0, bin_s=1.0)
    assert [p["busy"] for p in series] == [1, 1, 0, 1, 0] and series[1]["active"] == 4


def test_sim_sandbox_times_and_live_counts(tmp_path):
    provider = SimSandboxProvider(SandboxConfig(type="sim", root=str(tmp_path)))

    async def go():
        t0 = time.time()
        boxes = await asyncio.gather(*(provider.create(SandboxSpec(files={SIM_SPEC_FILE: '{"init_s": 0.2}'}),
                                                       f"e{i}") for i in range(3)))
        assert time.time() - t0 >= 0.2
        again = await provider.attach(boxes[0].handle)
        result = await again.exec("sim-exec 0.05 7")
        assert result.exit_code == 0 and result.output == "o" * 7
        assert (await again.exec("rm -rf /")).exit_code == 127
        for box in boxes:
            await box.destroy()
    run(go())
    stats = live_sandbox_stats(tmp_path)
    assert stats["peak_live_sandboxes"] == 3 and stats["leaked"] == 0
    assert stats["sandbox_seconds"] >= 3 * 0.2


def test_bytes_fit_is_exact_on_linear_data():
    fit = linear_fit([1, 2, 3, 4], [110, 210, 310, 410])
    assert fit["bytes_per_turn"] == pytest.approx(100) and fit["bytes_fixed"] == pytest.approx(10)
    assert fit["r2"] == pytest.approx(1.0)
    assert bytes_vs_turns({"a": 110, "b": 210}, {"a": 1, "b": 2})["mean_bytes_by_turns"] == {1: 110, 2: 210}


def test_backlog_runs_higher_priority_first_and_drops_revoked_partitions():
    from aiokafka import TopicPartition

    tp0, tp1 = TopicPartition("t", 0), TopicPartition("t", 1)
    backlog = Backlog()
    for prio, tp, rec in [(0, tp0, "new-a"), (3, tp1, "turn3"), (0, tp0, "new-b"), (5, tp0, "turn5")]:
        backlog.push(prio, tp, rec)
    assert backlog.pop()[1] == "turn5" and backlog.pop()[1] == "turn3"
    backlog.drop({tp1})
    assert [backlog.pop()[1] for _ in range(len(backlog))] == ["new-a", "new-b"]


def scheduler(tmp_path, *overrides: str) -> SchedulerActor:
    cfg = load_config(ROOT / "examples" / "smoke.yaml", ["tasks.count=10", "scheduler.group_size=1",
                                                         "run.id=rL", *overrides])
    return SchedulerActor(Services(cfg, tmp_path / "run"))


def test_scheduler_init_lookahead_bounds_episodes_before_the_reward_stage(tmp_path):
    s = scheduler(tmp_path, "scheduler.max_inflight_episodes=8", "scheduler.init_lookahead=1",
                  "scheduler.agent_slots=2")
    assert any(t.name == "reward-requests" for t in s.inputs)
    run(s.setup())
    issued = [o.value for o in run(s.tick())]
    assert len(issued) == 3, "agent_slots + init_lookahead episodes before any reaches the reward stage"
    assert run(s.tick()) == []
    ref = {k: getattr(issued[0], k) for k in ("episode_id", "group_id", "task_id", "attempt")}
    req = RewardRequest(**ref, sandbox={}, prompt_ids=[], messages=[], turns=[], stop_reason="finish")
    run(s.handle(req, MessageMeta("reward-requests", 0, 0)))
    assert len(run(s.tick())) == 1, "an episode that left the agent frees one look-ahead place"
    traj = Trajectory(**ref, token_ids=[], loss_mask=[], logprobs=[], turn_policy_versions=[], turn_spans=[],
                      reward=1.0, resolved=True, stop_reason="finish", num_turns=0, prompt_length=0)
    run(s.handle(traj, MessageMeta("trajectories", 0, 0)))
    assert run(s.tick()) == [], "a graded episode was already past the agent: no new place"
    default = scheduler(tmp_path)
    assert all(t.name != "reward-requests" for t in default.inputs), "off by default"
