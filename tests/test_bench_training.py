"""The training benchmark's logic on tiny workloads: the synchronous mode waits for each update, the
asynchronous modes never exceed their lag, the staleness histogram counts every trained episode, and
the simulated server's weight-sync pause holds decode steps. The learner is simulated by design (the
benchmark's cost model); the engine is the benchmark's simulated server, the actors are the real ones."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from aiohttp import web
from conftest import ROOT, run
from jobs import run_with_progress

from rollway.bench.pipeline import load_run_config, run_config
from rollway.bench.sim_server import SimEngine, build_app
from rollway.bench.training import (
    EpisodeRecord,
    TrainingConfig,
    TrainingLoop,
    mode_figures,
    select_batch,
    training_workload,
)
from rollway.bench.workload import TOOL_CALL, TurnPlan, WorkloadConfig, plan_workload, write_plans
from rollway.runtime.broker import free_port

TINY_WL = dict(slots=2, tool_overlap=1, init_lookahead=1, init_concurrency=2, grade_concurrency=2,
               init_s_median=0.15, grade_s_median=0.15, turns_median=3, tool_s_median=0.03,
               thought_tokens_median=10, step_base_s=0.002)


SLOW_EPISODE, SLOW_TOOL_S = 1, 4.0


def run_modes(tmp_path, lags, batch=3, steps=3, straggler=False, **training):
    """Every lag in `lags` on one tiny workload and one in-process simulated server. `straggler`:
    episode SLOW_EPISODE's first tool call takes SLOW_TOOL_S, longer than several learner steps."""
    tc = TrainingConfig(batch_episodes=batch, steps=steps, lags=lags, learner_fixed_s=0.3,
                        learner_s_per_ktoken=0.0, weight_sync_s=0.1, **training)
    wl = training_workload(WorkloadConfig(**TINY_WL), tc)
    plans = plan_workload(wl)
    if straggler:
        slow = plans[SLOW_EPISODE]
        assert slow.num_turns >= 2, "its first turn must call a tool"
        first = slow.turns[0]
        text = first.text[:first.text.index("<tool_call>")] + TOOL_CALL.format(seconds=SLOW_TOOL_S, out_bytes=10)
        slow.turns[0] = TurnPlan(len(text.encode()) + 1, SLOW_TOOL_S, 10, text)
    write_plans(plans, tmp_path / "plans.jsonl")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def go():
        engine = SimEngine({p.index: p for p in plans}, wl.step_base_s, wl.step_per_seq_s,
                           wl.prefill_per_token_s, wl.slots)
        runner = web.AppRunner(build_app(engine))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        results = {}
        try:
            for lag in lags:
                engine.reset_cache()
                data = run_config(wl, tmp_path / "plans.jsonl", tmp_path / f"l{lag}" / "sandboxes", f"{url}/v1",
                                  f"l{lag}")
                cfg = load_run_config(data, tmp_path / f"l{lag}" / "config.yaml")
                results[lag] = await TrainingLoop(cfg, tmp_path / f"l{lag}", wl, tc, lag, f"{url}/sim/pause").run()
            return results, engine, tc
        finally:
            await runner.cleanup()

    return run(go())


def running_while_training(r) -> list:
    """Episodes generating (admitted, not yet graded) during some learner step or weight sync."""
    return [e for e in r.episodes for s in r.steps
            if e.version is not None and e.admitted_at < s.sync_end
            and (e.trajectory is None or e.done_at > s.train_start)]


def test_sync_mode_starts_no_episode_before_the_update_and_trains_on_policy(tmp_path):
    results, engine, tc = run_modes(tmp_path, [0])
    r = results[0]
    assert len(r.steps) == 3 and len(r.trained) == 9
    for step in r.steps[:-1]:
        later = [e for e in r.episodes if e.trained_step == step.step + 1]
        assert later and min(e.admitted_at for e in later) >= step.sync_end, "the next batch waited for the update"
        assert all(e.version == step.step + 1 for e in later)
    assert all(s == 0 for step in r.steps for s in step.staleness)
    assert len(r.episodes) == 9, "sync starts exactly the episodes it trains"
    assert not running_while_training(r), "nothing generates while the learner trains"
    figures = mode_figures(r, tc)
    assert all(t.policy_version == e.version for e in r.trained for t in e.trajectory.turns), \
        "the engine labels every turn with the version the episode was admitted under"
    assert figures["staleness_histogram"] == {"0": 9} and figures["turns_after_an_inflight_update_fraction"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("stragglers", ["drop", "wait"])
def test_async_modes_overlap_generation_with_training_and_never_exceed_their_lag(tmp_path, stragglers):
    results, engine, tc = run_modes(tmp_path, [1, 2], steps=4, straggler=True, stragglers=stragglers)
    for lag, r in results.items():
        figures = mode_figures(r, tc)
        assert figures["staleness_max"] <= lag
        for e in r.trained:  # labels from the engine: never older than admission, never decreasing
            versions = [t.policy_version for t in e.trajectory.turns]
            assert versions == sorted(versions) and versions[0] >= e.version
        dropped = [e for e in r.episodes if e.dropped_step is not None]
        assert sum(figures["staleness_histogram"].values()) == figures["trained_episodes"] == 12 - len(dropped)
        assert figures["episodes_dropped_stale"] == len(dropped) == sum(s.dropped for s in r.steps)
        consumed = sorted(e.trained_step if e.trained_step is not None else e.dropped_step
                          for e in r.episodes if e.trained_step is not None or e.dropped_step is not None)
        assert consumed == [k for k in range(4) for _ in range(3)], "every step consumes one batch"
        assert all(e.dropped_step - e.version > lag for e in dropped), "only episodes over the lag are dropped"
        slow = r.episodes[SLOW_EPISODE]
        if stragglers == "wait":
            assert not dropped
            assert slow.trained_step <= slow.version + lag, "trained in time"
            assert r.steps[slow.trained_step].batch_ready_at >= slow.done_at, "its step waited for it"
        elif lag == 1:
            assert slow.dropped_step is not None, "the straggler finished more than 1 version behind: dropped"
        assert running_while_training(r), f"lag {lag}: generation went on while the learner trained"
        for e in r.episodes:  # the admission rule: episode n generates only while n < (v + 1 + lag) x B
            assert e.version is None or e.index < (e.version + 1 + lag) * 3
        if stragglers == "drop":  # and never beside an episode already more than lag versions behind
            for e in r.episodes:
                behind = [o for o in r.episodes if o.version is not None and o.version < (e.version or 0) - lag
                          and o.admitted_at < e.admitted_at and (o.trajectory is None or o.done_at > e.admitted_at)]
                assert e.version is None or not behind, (e.index, [o.index for o in behind])
    assert results[2].steps and max(results[2].steps[-1].staleness) >= 1
    assert [p[2] for p in engine.pauses] == [1, 2, 3, 4], "one weight-sync pause per update of the last mode"


FINISHED = object()
"""Stands in for a finished episode's trajectory: batch selection only asks whether there is one."""


def _record(index: int, version: int, done_at: float | None) -> EpisodeRecord:
    rec = EpisodeRecord(index, issued_at=float(index), version=version)
    if done_at is not None:
        rec.done_at = done_at
        rec.trajectory = FINISHED
    return rec


def test_select_batch_waits_for_episodes_at_the_lag_limit_and_takes_the_oldest_finished():
    # step 2, lag 1: episodes of version <= 1 must be in the batch
    pending = [_record(0, 0, None), _record(1, 1, 5.0), _record(2, 2, 1.0), _record(3, 2, 2.0), _record(4, 2, 0.5)]
    assert select_batch(pending, step=2, lag=1, size=3) is None, "episode 0 (version 0) is not finished"
    pending[0] = _record(0, 0, 9.0)
    assert [e.index for e in select_batch(pending, step=2, lag=1, size=3)] == [0, 1, 4]
    assert [e.index for e in select_batch(pending, step=2, lag=2, size=3)] == [0, 1, 4]
    # in issue order only: a finished prefix
    pending = [_record(0, 0, 3.0), _record(1, 0, None), _record(2, 0, 1.0)]
    assert select_batch(pending, step=0, lag=2, size=2, out_of_order=False) is None
    assert [e.index for e in select_batch(pending, step=0, lag=2, size=2)] == [2, 0]


def test_select_batch_drop_takes_the_oldest_finished_and_never_waits_for_a_straggler():
    """rollway's learner (`stale_policy: drop`): finished episodes, oldest start version first, then
    by finish time; episode 0 (version 0) still runs and is not waited for; the loop drops those
    over the lag."""
    pending = [_record(0, 0, None), _record(1, 1, 5.0), _record(2, 2, 1.0), _record(3, 2, 2.0), _record(4, 2, 0.5)]
    assert [e.index for e in select_batch(pending, step=2, lag=1, size=3, stragglers="drop")] == [1, 4, 2]
    assert select_batch(pending, step=2, lag=1, size=5, stragglers="drop") is None, "only four finished"


def test_sim_engine_starts_no_step_inside_a_weight_sync_pause():
    wl = WorkloadConfig(episodes=2, **TINY_WL)
    plans = plan_workload(wl)

    async def go():
        engine = SimEngine({p.index: p for p in plans}, 0.004, 0.0, 0.0, 2)
        task = asyncio.create_task(engine.run())
        prompt = list(plans[0].prompt.encode())
        gen = asyncio.create_task(engine.generate(prompt, 10_000))
        await asyncio.sleep(0.05)
        start, end, version = engine.pause(0.3)
        assert version == 1 and engine.version_at(start) == 0 and engine.version_at(end) == 1
        await gen
        _, _, served = await engine.generate(list(plans[1].prompt.encode()), 10_000)
        task.cancel()
        return engine, start, end, served

    engine, start, end, served = run(go())
    assert served == 1, "a request admitted after the pause reports the new version"
    inside = [s for s in engine.steps if start + 0.01 < s[0] < end - 0.001]
    assert not inside, f"steps started inside the pause: {inside[:3]}"
    assert any(s[0] >= end - 1e-6 for s in engine.steps), "generation resumed after the pause"
    assert engine.steps[-1][1] - engine.steps[0][0] >= 0.3


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_training_json_reports_ratio_histogram_and_plot(tmp_path):
    out = tmp_path / "bench"
    args = [f"{k}={v}" for k, v in TINY_WL.items()]
    t0 = time.monotonic()
    proc = run_with_progress(
        [sys.executable, "-m", "rollway.runners", "bench", "training", "--json", "--seed", "2", "--out", str(out),
         "batch_episodes=3", "steps=2", "lags=[0,1]", "learner_fixed_s=0.2", *args],
        cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    sync, lag1 = result["modes"]
    assert sync["mode"] == "sync" and sync["ratio_to_sync"] == 1.0
    assert lag1["ratio_to_sync"] == pytest.approx(lag1["trained_episodes_per_s"] / sync["trained_episodes_per_s"])
    for m in (sync, lag1):
        assert m["trained_episodes"] == 6 and 0 < m["busy_fraction"] <= 1
        assert sum(m["staleness_histogram"].values()) == 6
    assert (out / "training.png").stat().st_size > 10_000
    assert time.monotonic() - t0 < 180


def test_steady_rate_starts_after_the_lags_start_up_cohort():
    """Lag L: steps 0..L wait for the (1 + L) x B episodes that all started under version 0, so the
    steady rate is measured from the end of step L; a run too short for that has none."""
    from rollway.bench.training import StepRecord, _window

    def rate(steps, warm_up):
        w = _window(steps, warm_up)
        return w.trained / w.seconds if w else None

    ends = [10.0, 12.0, 20.0, 25.0, 30.0]  # step 2 waited for the start-up cohort's slowest episode
    steps = [StepRecord(k, 0.0, 0.0, 0.0, end, 0, [0] * 32) for k, end in enumerate(ends)]
    assert rate(steps, 0) == pytest.approx(4 * 32 / 20.0)
    assert rate(steps, 2) == pytest.approx(2 * 32 / 10.0)
    assert _window(steps, 2).seconds / _window(steps, 2).steps == pytest.approx(5.0), "steady step time"
    assert rate(steps, 4) is None
    steps[4].staleness, steps[4].dropped = [0] * 30, 2  # dropped episodes are not trained ones
    assert rate(steps, 2) == pytest.approx((32 + 30) / 10.0)
