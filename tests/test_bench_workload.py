"""The benchmark's seeded workload, its ideal makespan, the simulated server and sandbox, and the scheduler knobs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
from conftest import ROOT, run

from rollway.actors.agent import AgentActor
from rollway.actors.scheduler import SchedulerActor, ends_order, johnson_order
from rollway.actors.scheduling import TaskCost
from rollway.actors.services import Services
from rollway.bench.report import (
    agent_slot_phases,
    bytes_vs_turns,
    inference_latency,
    linear_fit,
    model_slot_intervals,
    utilisation_series,
)
from rollway.bench.sim_server import SimEngine, busy_stats
from rollway.bench.workload import (
    WorkloadConfig,
    ideal_makespan,
    joint_bound,
    plan_episode,
    plan_workload,
    write_plans,
)
from rollway.config.run import load_config
from rollway.policies.chat import IM_END, BytesChatML
from rollway.runtime.actor import MessageMeta
from rollway.runtime.queue import Backlog
from rollway.runtime.telemetry import Handled
from rollway.sandboxes.base import SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.sim import SIM_SPEC_FILE, SimSandboxProvider, live_sandbox_stats
from rollway.schemas import AgentStep, EpisodeKey, RewardRequest, Trajectory


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


@pytest.mark.parametrize("overlap", [0, 3, 8])
def test_joint_bound_is_the_minimum_over_step_counts_of_its_three_terms(overlap):
    """joint_bound solves min over S >= K/C of max(server, model slots, turn slots) in closed form;
    a fine grid over S must never find a smaller value, and must come within a hair of it."""
    a, b, prefill_s, k, x, c = 0.003, 0.00005, 2.4, 190_000.0, 170.0, 16
    h = c + overlap

    def worst(s: float) -> float:
        slots = (a * k + b * k * k / s + prefill_s) / c
        return max(a * s + b * k + prefill_s, slots, slots * c / h + x / h)

    grid = [k / c * (1 + i / 2000) for i in range(40_000)]
    best = min(worst(s) for s in grid)
    assert joint_bound(a, b, prefill_s, k, x, c, h) <= best + 1e-9
    assert joint_bound(a, b, prefill_s, k, x, c, h) >= best * (1 - 1e-4)


def test_tool_overlap_lowers_the_bound_only_through_the_turn_slots():
    cfg = WorkloadConfig(episodes=60)
    plans = plan_workload(cfg)
    held = ideal_makespan(plans, cfg.model_copy(update={"tool_overlap": 0}))
    free = ideal_makespan(plans, cfg.model_copy(update={"tool_overlap": 8}))
    assert held["turn_slots"] >= held["model_slots"] and free["turn_slots"] < held["turn_slots"]
    for key in ("critical_path", "inference", "model_slots", "init", "grading"):
        assert free[key] == held[key]
    assert held["inference"] <= free["ideal_makespan"] <= held["ideal_makespan"]


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
    wall1 = generate_all(alone, prompts[:1])
    crowded = SimEngine(plans, a=0.002, b=0.002, p=0.0, cap=8)
    generate_all(crowded, prompts)

    def served(engine: SimEngine) -> float:
        """First admission to last finish on the engine's simulated clock, which a loaded CPU cannot
        stretch (the wall clock can: a test run beside a benchmark once measured 2.17 s for 0.39)."""
        return max(r[2] for r in engine.request_log) - min(r[1] for r in engine.request_log)

    t1, t8 = served(alone), served(crowded)
    assert t1 == pytest.approx(len(alone.steps) * 0.004, rel=1e-4), "one sequence: a + b per step"  # epoch-sized floats
    assert wall1 >= t1 * 0.99, "answers are paced in real time, never ahead of the simulated engine"
    assert t8 > 2.5 * t1, "8 sequences at once must decode each token much slower than one"
    assert max(n for _, _, n in crowded.steps) == 8
    assert len(crowded.steps) <= tokens + 1
    assert len(crowded.request_log) == 8
    for arrived, admitted, finished, answered, _ in crowded.request_log:
        assert arrived <= admitted < finished <= answered
        assert finished - admitted >= (len(plans[0].turns[0].text) // 2) * 0.004, "served step by step"
    capped = SimEngine(plans, a=0.002, b=0.0, p=0.0, cap=2)
    generate_all(capped, prompts[:6])
    assert max(n for _, _, n in capped.steps) == 2, "the cap bounds running sequences"


def test_sim_server_prefills_only_new_tokens_until_its_cache_is_reset():
    plans = {p.index: p for p in plan_workload(WorkloadConfig(episodes=1))}
    prompt = BytesChatML().initial([{"role": "user", "content": plans[0].prompt}], [])
    engine = SimEngine(plans, a=0.001, b=0.0, p=0.0, cap=4)

    async def go() -> list[int]:
        task = asyncio.create_task(engine.run())
        await engine.generate(prompt, 10_000)
        await engine.generate(prompt, 10_000)  # the same prompt again (a second run of the episode)
        dropped = engine.reset_cache()
        await engine.generate(prompt, 10_000)
        task.cancel()
        return dropped

    assert run(go()) == 1
    assert [prefilled for *_, prefilled in engine.request_log] == [len(prompt), 0, len(prompt)], \
        "a cached prefix is not prefilled again; after a reset the run starts cold"


def test_sim_server_shares_the_common_prompt_prefix_across_episodes_in_whole_blocks():
    """Like vLLM's automatic prefix caching: the system prompt and tools every episode starts with are
    prefilled once; each episode still prefills its own task text, which the ideal makespan counts."""
    plans = {p.index: p for p in plan_workload(WorkloadConfig(episodes=40))}
    chat = BytesChatML()
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run a command. " * 40,
                                               "parameters": {"type": "object", "properties": {}}}}]

    def first_prompt(i: int) -> list[int]:
        return chat.initial([{"role": "system", "content": "You are an agent."},
                             {"role": "user", "content": plans[i].prompt}], tools)

    engine = SimEngine(plans, a=0.001, b=0.0, p=0.0, cap=4)
    order = [0, 31, 30, 7, 39]

    async def go() -> list[int]:
        task = asyncio.create_task(engine.run())
        ids, _, _ = await engine.generate(first_prompt(0), 10_000)
        for i in order[1:]:
            await engine.generate(first_prompt(i), 10_000)
        later = first_prompt(0) + ids + chat.continuation([], [{"role": "user", "content": "ok " * 50}], tools)
        await engine.generate(later, 10_000)
        task.cancel()

    run(go())
    prefilled = [r[4] for r in engine.request_log]
    task_at = len(first_prompt(0)) - len(plans[0].prompt.encode()) - len([IM_END, *b"\n", *chat.assistant_header_ids])
    assert prefilled[0] == len(first_prompt(0)), "the first episode finds nothing cached"
    for i, n in zip(order[1:], prefilled[1:5], strict=True):
        shared = len(first_prompt(i)) - n
        assert shared % 16 == 0 and shared > task_at - 16, "system prompt and tools come from the cache"
        assert n >= len(plans[i].prompt.encode()) - 19, "the task text past the marker is prefilled (ideal_makespan's q)"
    assert prefilled[5] == len(chat.continuation([], [{"role": "user", "content": "ok " * 50}], tools)), \
        "a later turn prefills only what follows the episode's previous prompt and completion"


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
    ref = {"episode": issued[0].episode}
    req = RewardRequest(**ref, sandbox={}, prompt_ids=[], messages=[], turns=[], stop_reason="finish")
    run(s.handle(req, MessageMeta("reward-requests", 0, 0)))
    assert len(run(s.tick())) == 1, "an episode that left the agent frees one look-ahead place"
    traj = Trajectory(**ref, token_ids=[], loss_mask=[], logprobs=[], turn_policy_versions=[], turn_spans=[],
                      reward=1.0, resolved=True, stop_reason="finish", num_turns=0, prompt_length=0)
    run(s.handle(traj, MessageMeta("trajectories", 0, 0)))
    assert run(s.tick()) == [], "a graded episode was already past the agent: no new place"


def test_johnson_order_starts_with_fast_sandboxes_and_ends_with_fast_ones():
    costs = {"a": TaskCost(3.0, 5.0), "b": TaskCost(1.0, 4.0), "c": TaskCost(4.0, 1.0), "d": TaskCost(2.0, 0.5),
             "e": TaskCost(5.0, 3.0), "f": None}
    order = johnson_order(list(costs), list(costs.values()))
    # start <= grading, by start ascending; f (no estimate) ranks as the median task (3.0, 3.0).
    assert order[:3] == ["b", "a", "f"]
    # then the rest by start + grading descending: the run ends with the cheapest task.
    assert order[3:] == ["e", "c", "d"]
    assert johnson_order(["x", "y"], [None, None]) == ["x", "y"], "no estimates: the given order"


def test_ends_order_sorts_the_first_burst_and_the_final_wave_only():
    costs = {"a": TaskCost(3.0, 3.0), "b": TaskCost(0.5, 4.0), "c": TaskCost(6.0, 0.2), "d": TaskCost(2.0, 2.0),
             "e": TaskCost(0.2, 9.0), "f": TaskCost(5.0, 5.0), "g": TaskCost(1.0, 0.5), "h": None, "i": TaskCost(0.9, 0.4)}
    order = ends_order(list(costs), list(costs.values()), head=2, tail=3)
    assert order[:2] == ["e", "b"], "the fastest sandbox starts first"
    # the 3 cheapest left in start + grading, dearest first: d (4.0), g (1.5), i (1.3)
    assert order[-3:] == ["d", "g", "i"]
    # the middle keeps the given order; h has no estimate and ranks as the median task
    assert order[2:-3] == ["a", "c", "f", "h"]
    assert ends_order(["x", "y"], [None, None], 1, 1) == ["x", "y"], "no estimates: the given order"
    assert sorted(ends_order(list(costs), list(costs.values()), head=6, tail=6)) == sorted(costs), \
        "ends that overlap still issue every task once"


def test_scheduler_issues_in_johnson_order_from_the_task_estimates(tmp_path):
    cfg = WorkloadConfig(episodes=12, seed=5)
    plans = plan_workload(cfg)
    write_plans(plans, tmp_path / "plans.jsonl")
    base = [
        # the whole section: smoke.yaml's toy `count` is not a field of the sim task set
        "tasks=" + json.dumps({"type": "sim", "path": str(tmp_path / "plans.jsonl")}),
        "sandbox.type=sim",
        f"sandbox.root={tmp_path / 'boxes'}",
        "scheduler.group_size=1",
        "scheduler.max_inflight_episodes=12",
        "run.id=rJ",
    ]
    issued = {}
    for order in ("given", "johnson"):
        s = SchedulerActor(
            Services(
                load_config(ROOT / "examples" / "smoke.yaml", [*base, f"scheduler.order={order}"]),
                tmp_path / order,
            )
        )
        run(s.setup())
        issued[order] = [o.value.task_id for o in run(s.tick())]
    assert sorted(issued["given"]) == sorted(issued["johnson"]) and len(issued["johnson"]) == 12
    by_id = {f"sim-{p.index:05d}": TaskCost(p.init_s_estimate, p.grade_s_estimate) for p in plans}
    assert issued["johnson"] == johnson_order(issued["given"], [by_id[t] for t in issued["given"]])
    assert issued["johnson"] != issued["given"]
    first = [by_id[t] for t in issued["johnson"] if by_id[t][0] <= by_id[t][1]]
    assert first == sorted(first), "fast-starting tasks first, fastest start first"


def test_scheduler_plans_ends_order_around_its_first_burst_and_final_wave(tmp_path):
    plans = plan_workload(WorkloadConfig(episodes=14, seed=4))
    write_plans(plans, tmp_path / "plans.jsonl")
    overrides = ["tasks=" + json.dumps({"type": "sim", "path": str(tmp_path / "plans.jsonl")}),
                 f"sandbox.root={tmp_path / 'boxes'}",
                 "sandbox.type=sim", "scheduler.group_size=1", "run.id=rE", "scheduler.max_inflight_episodes=5",
                 "scheduler.init_lookahead=1", "scheduler.agent_slots=2"]
    planned = {}
    for order in ("given", "ends"):
        cfg = load_config(ROOT / "examples" / "smoke.yaml", [*overrides, f"scheduler.order={order}"])
        s = SchedulerActor(Services(cfg, tmp_path / order))
        run(s.setup())
        planned[order] = [g[0].task_id for g in s.groups]
    by_id = {f"sim-{p.index:05d}": TaskCost(p.init_s_estimate, p.grade_s_estimate) for p in plans}
    # first burst = agent_slots + init_lookahead = 3 (under max_inflight 5); final wave = 5
    assert planned["ends"] == ends_order(planned["given"], [by_id[t] for t in planned["given"]], head=3, tail=5)
    assert planned["ends"] != planned["given"]


def test_estimates_are_noisy_but_do_not_change_the_plan():
    exact = plan_workload(WorkloadConfig(episodes=30, seed=2, estimate_sigma=0.0))
    noisy = plan_workload(WorkloadConfig(episodes=30, seed=2, estimate_sigma=0.3))
    assert [(p.init_s, p.grade_s, p.turns) for p in exact] == [(p.init_s, p.grade_s, p.turns) for p in noisy]
    assert all(p.init_s_estimate == p.init_s and p.grade_s_estimate == p.grade_s for p in exact)
    ratios = [p.init_s_estimate / p.init_s for p in noisy if p.init_s > 0]
    assert any(abs(r - 1) > 0.05 for r in ratios) and all(0.2 < r < 5 for r in ratios)


def test_request_log_splits_generation_time():
    log = [(0.0, 0.002, 0.402, 0.403), (1.0, 1.001, 1.201, 1.203)]
    trajectories = [{"turns": [{"gen_seconds": 0.403}, {"gen_seconds": 0.203 + 0.006}]}]  # 3 ms per request beyond the server
    figures = inference_latency(log, trajectories)
    assert figures["inference_requests"] == 2
    assert figures["inference_admission_ms"] == pytest.approx(1.5)
    assert figures["inference_engine_ms"] == pytest.approx(300.0)
    assert figures["inference_answer_lag_ms"] == pytest.approx(1.5)
    assert figures["inference_client_ms"] == pytest.approx(3.0)
    # With carry-over the window also serves turns of episodes graded after it: their requests are in the
    # log, their turns in no trajectory. The client's share compares means, so it stays 3 ms here (a third
    # request served in the two others' mean time); the totals gave (0.612 - 0.909) / 3 = -99 ms.
    carried = [*log, (2.0, 2.001, 2.301, 2.303)]
    assert inference_latency(carried, trajectories)["inference_client_ms"] == pytest.approx(3.0)


def test_agent_slot_phases_find_ramp_up_and_drain():
    def handled(stage: str, s: float, e: float) -> Handled:
        return Handled(stage=stage, topic="agent-steps", partition=0, offset=0, bytes=1, produced_at=s,
                       started_at=s, ended_at=e)

    trace = [handled("agent", 1.0, 5.0), handled("agent", 2.0, 9.0), handled("agent", 4.0, 6.0),
             handled("init", 0.0, 1.0)]
    trajectories = [{"turns": [{"gen_started_at": 1.0, "gen_ended_at": 3.0}, {"gen_started_at": 4.0, "gen_ended_at": 5.0}]}]
    # Tool calls hold the model-call slot (tool_overlap 0): whole turns count; else only generation.
    assert model_slot_intervals(trace, trajectories, tool_overlap=0) == [(1.0, 5.0), (2.0, 9.0), (4.0, 6.0)]
    assert model_slot_intervals(trace, trajectories, tool_overlap=4) == [(1.0, 3.0), (4.0, 5.0)]
    phases = agent_slot_phases(model_slot_intervals(trace, trajectories, 0), 0.0, 10.0, slots=2)
    assert phases["ramp_up_s"] == pytest.approx(2.0)  # both slots busy first at t=2
    assert phases["drain_s"] == pytest.approx(4.0)  # last time both busy: 6 (third turn ends while 2 remain)
    # slot time counts at most `slots` at once: t=4..5 holds 3 calls (one queued at the server), counted as 2
    assert phases["slots_busy_fraction"] == pytest.approx((1 + 2 * 2 + 2 + 2 + 3) / 20)
    assert phases["peak_busy_slots"] == 3  # all three turns at t=4..5
    # A slot freed and taken again at the same instant is one slot, not two.
    assert agent_slot_phases([(0.0, 1.0), (1.0, 2.0)], 0.0, 2.0, slots=1)["peak_busy_slots"] == 1


def test_final_wave_starts_the_last_sandboxes_within_the_inflight_bound(tmp_path):
    s = scheduler(
        tmp_path,
        "scheduler.max_inflight_episodes=8",
        "scheduler.init_lookahead=1",
        "scheduler.agent_slots=2",
        "scheduler.final_wave=true",
    )
    run(s.setup())
    first = run(s.tick())
    assert len(first) == 3, "10 left do not fit in 8: the look-ahead still binds"
    assert not any(o.value.final_wave for o in first)
    done = 0
    for msg in list(s.tickets.values())[:2]:  # two episodes finish: 7 left to issue, 1 in flight
        ref = {"episode": msg.key}
        traj = Trajectory(
            **ref,
            token_ids=[],
            loss_mask=[],
            logprobs=[],
            turn_policy_versions=[],
            turn_spans=[],
            reward=1.0,
            resolved=True,
            stop_reason="finish",
            num_turns=0,
            prompt_length=0,
        )
        run(s.handle(traj, MessageMeta("trajectories", 0, done)))
        done += 1
    issued = run(s.tick())
    inflight = sum(t.state == "inflight" for t in s.tickets.values())
    assert len(issued) == 7 and inflight == 8, "everything left fits in max_inflight_episodes: issued at once"
    assert all(o.value.final_wave for o in issued)
    assert run(s.tick()) == []


def test_agent_ranks_later_turns_first_until_the_run_drains_then_earliest_first():
    agent = AgentActor.__new__(AgentActor)
    agent.final_wave = False
    step = lambda turn, final: AgentStep(episode=EpisodeKey(episode_id="e", group_id="g", task_id="t"), turn=turn,  # noqa: E731
                                         sandbox={}, final_wave=final)
    queued = [step(5, False), step(0, False), step(3, False)]
    assert [m.turn for m in sorted(queued, key=agent.priority, reverse=True)] == [5, 3, 0]
    epoch = agent.priority_epoch
    agent.priority(step(2, True))  # the first final-wave message: the run drains
    assert agent.final_wave and agent.priority_epoch == epoch + 1, "the runtime is told to re-rank"
    ranked = sorted([*queued, step(2, True), step(1, True)], key=agent.priority, reverse=True)
    assert [(m.turn, m.final_wave) for m in ranked] == [(0, False), (1, True), (2, True), (3, False), (5, False)]


def test_carried_work_raises_the_bound_by_what_the_window_also_did():
    """carry_over: the bound over a batch plus the turns carried episodes completed in the window is
    at least the batch's own, and counts their work in the server's sum (without the final grading)."""
    cfg = WorkloadConfig(episodes=40, seed=3)
    plans = plan_workload(cfg)
    batch, carried = plans[:30], plans[30:]
    alone = ideal_makespan(batch, cfg)
    assert not any(k.endswith("_with_carried") for k in alone)
    cut = [dataclasses.replace(e, turns=e.turns[:2]) for e in carried]
    both = ideal_makespan(batch, cfg, cut)
    assert both["ideal_makespan"] >= alone["ideal_makespan"]
    assert both["critical_path"] == alone["critical_path"] and both["grading"] == alone["grading"]
    whole = ideal_makespan(batch, cfg, carried)
    assert whole["inference_with_carried"] > both["inference_with_carried"] > alone["inference"] - min(
        e.grade_s for e in batch), "every completed turn adds server time"


def test_carried_work_counts_turns_done_by_the_batchs_end_and_skips_the_batch():
    from rollway.bench.run import carried_work, first_graded

    created = {"a": 3.0, "b": 1.0, "c": 9.0, "d": 8.0}
    assert first_graded(created, 2) == ["b", "a"]
    episodes = [("a", "sim-00001", 0.5, [1.0, 2.0]),       # in the batch
                ("c", "sim-00007", 1.0, [2.0, 2.9, 3.5]),   # two turns done by 3.0
                ("d", "sim-00004", 3.2, [4.0]),            # its sandbox started after the batch ended
                ("e", "sim-00002", 2.0, [])]               # started, no turn done yet
    assert carried_work(episodes, {"a", "b"}, 3.0) == [[7, 2], [2, 0]]
