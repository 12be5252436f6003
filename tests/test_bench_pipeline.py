"""The benchmark end to end: the in-process baseline against the simulated server, and a tiny
`rollway bench pipeline --json` run of both modes (real broker, real stage processes)."""

from __future__ import annotations

import json
import sys

import pytest
from aiohttp import web
from conftest import ROOT, run
from jobs import run_with_progress

from rollway.bench.baseline import BatchDispatcher
from rollway.bench.pipeline import load_run_config, run_config
from rollway.bench.report import format_text, model_slot_intervals
from rollway.bench.sim_server import SimEngine, build_app
from rollway.bench.workload import WorkloadConfig, ideal_makespan, plan_workload, read_plans, write_plans
from rollway.runtime.broker import free_port
from rollway.runtime.telemetry import episode_stages, read_telemetry
from rollway.sandboxes.sim import live_sandbox_stats

TINY = ["episodes=6", "slots=2", "init_lookahead=1", "init_concurrency=2", "grade_concurrency=2",
        "init_s_median=0.3", "grade_s_median=0.3", "turns_median=3", "tool_s_median=0.05",
        "thought_tokens_median=10", "step_base_s=0.002", "tool_overlap=1", "model_call_slack=0"]
FULL_DRAIN = ["carry_over=false"]
"""Run exactly `episodes` and wait for all of them (the makespan includes the drain)."""


def test_baseline_never_exceeds_its_slots_and_takes_at_least_the_ideal_makespan(tmp_path):
    wl = WorkloadConfig(episodes=7, slots=3, init_s_median=0.2, grade_s_median=0.2, turns_median=3,
                        tool_s_median=0.03, thought_tokens_median=10, step_base_s=0.002)
    plans = plan_workload(wl)
    write_plans(plans, tmp_path / "plans.jsonl")
    port = free_port()
    data = run_config(wl, tmp_path / "plans.jsonl", tmp_path / "sandboxes", f"http://127.0.0.1:{port}/v1", "b")
    cfg = load_run_config(data, tmp_path / "config.yaml")

    async def go():
        engine = SimEngine({p.index: p for p in plans}, wl.step_base_s, wl.step_per_seq_s,
                           wl.prefill_per_token_s, wl.slots)
        runner = web.AppRunner(build_app(engine))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await BatchDispatcher(cfg, tmp_path / "run", wl.slots).run(), engine
        finally:
            await runner.cleanup()

    result, engine = run(go())
    assert len(result.trajectories) == 7 and all(t.stop_reason == "finish" for t in result.trajectories)
    assert result.peak_busy_slots == 3 and max(n for _, n in result.busy_slots_log) <= 3
    assert max(n for _, _, n in engine.steps) <= 3, "the server never sees more sequences than slots"
    assert result.makespan >= ideal_makespan(plans, wl)["ideal_makespan"]
    assert sorted(t.num_turns for t in result.trajectories) == sorted(p.num_turns for p in plans)
    sandboxes = live_sandbox_stats(tmp_path / "sandboxes")
    assert sandboxes["peak_live_sandboxes"] <= 3 and sandboxes["leaked"] == 0
    # The in-process baseline records the runtimes' telemetry too: one line per handled message, in order.
    telemetry = read_telemetry(tmp_path / "run")
    assert sorted(r.stage for r in telemetry) == sorted(
        ["init"] * 7 + ["reward"] * 7 + ["agent"] * sum(t.num_turns for t in result.trajectories))
    assert all(r.produced_at - 0.001 <= r.started_at <= r.ended_at for r in telemetry)


def turns_planned(out) -> int:
    return sum(e.num_turns for e in read_plans(out / "plans.jsonl"))


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_pipeline_json_reports_every_figure(tmp_path):
    out = tmp_path / "bench"
    proc = run_with_progress(
        [sys.executable, "-m", "rollway.runners", "bench", "pipeline", "--json", "--seed", "3", "--scaling", "1",
         "--out", str(out), *TINY, *FULL_DRAIN], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("ratio", "ideal_makespan", "efficiency", "broker_overhead_fraction", "baseline", "pipeline", "plot"):
        assert key in result
    b, p = result["baseline"], result["pipeline"]
    for mode in (b, p):
        assert mode["episodes"] == 6 and 0 < mode["busy_fraction"] <= 1
        assert mode["makespan_s"] >= result["ideal_makespan"]
        assert mode["sandboxes_leaked"] == 0 and mode["sandbox_seconds_per_episode"] > 0
    assert b["peak_live_sandboxes"] <= 2
    assert p["peak_live_sandboxes"] <= p["sandbox_bound"] == 2 + 1 + 1 + 2
    lines = (out / "pipeline-a1" / "trajectories.jsonl").read_text().splitlines()
    calls = model_slot_intervals([], [json.loads(line) for line in lines], tool_overlap=1)
    assert len(calls) == turns_planned(out) and p["peak_busy_slots"] <= 2, \
        "3 turns at once (tool_overlap 1), but never more than 2 model calls (slots)"
    for key in ("hop_latency_p50_ms", "hop_latency_p99_ms", "messages_per_second"):
        assert p[key] > 0
    assert p["bytes"]["fit"]["bytes_per_turn"] > 0 and p["episodes_failed"] == 0
    assert isinstance(p["episodes_retried"], int)  # > 0 only if a message got stuck (deadline re-issue)
    turns = turns_planned(out)
    for mode in (b, p):  # every model call went through the server, and the agent saw about its time
        assert mode["inference_requests"] >= 2 * 6 and mode["inference_engine_ms"] > 0
        assert -5 < mode["inference_client_ms"] < 0.5 * mode["inference_engine_ms"]
    assert b["inference_requests"] == p["inference_requests"] == turns
    # Both modes start with a cold prefix cache: the pipeline must not find the baseline's prompts
    # cached (same episodes), so both prefill the same prompt tokens.
    assert b["prefill_tokens"] == p["prefill_tokens"] > 0
    assert 0 < p["ramp_up_s"] < p["makespan_s"] and 0 < p["drain_s"] < p["makespan_s"]
    assert 0 < p["slots_busy_fraction"] <= 1
    assert result["ratio"] == pytest.approx(b["makespan_s"] / p["makespan_s"])
    assert (out / "utilisation.png").stat().st_size > 0
    text = format_text(result)  # what `rollway bench pipeline` prints without --json
    assert f"efficiency {result['efficiency']:.3f}" in text and "ramp-up" in text
    assert text.count("inference per request") == 2


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_pipeline_carry_over_ends_each_mode_at_its_batchs_last_grading(tmp_path):
    """carry_over (the default): both modes get sandbox_bound more episodes, and a mode's makespan
    ends when `episodes` of them are graded; its bound is taken over those episodes."""
    out = tmp_path / "bench"
    proc = run_with_progress(
        [sys.executable, "-m", "rollway.runners", "bench", "pipeline", "--json", "--seed", "5", "--scaling", "1",
         "--out", str(out), *TINY], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    b, p = result["baseline"], result["pipeline"]
    assert len(read_plans(out / "plans.jsonl")) == 6 + 6, "the next step's episodes: sandbox bound 2 + 1 + 1 + 2"
    lines = (out / "pipeline-a1" / "trajectories.jsonl").read_text().splitlines()
    trajectories = [json.loads(line) for line in lines if line]
    assert len(trajectories) == p["episodes_run"] == b["episodes_run"] == 12 and p["episodes"] == b["episodes"] == 6
    graded = sorted(t["created_at"] for t in trajectories)
    issued = min(st.issued for st in episode_stages(read_telemetry(out / "pipeline-a1")).values())
    assert issued + p["makespan_s"] == pytest.approx(graded[5], abs=0.05), "the makespan ends at the sixth grading"
    assert graded[-1] > graded[5], "the carried episodes finished after it"
    assert p["makespan_s"] >= result["ideal_makespan"] and b["makespan_s"] >= b["ideal_makespan"]
    assert result["efficiency"] == pytest.approx(result["ideal_makespan"] / p["makespan_s"])
    assert p["peak_live_sandboxes"] <= p["sandbox_bound"] and p["sandboxes_leaked"] == b["sandboxes_leaked"] == 0
