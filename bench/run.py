"""`rollway bench pipeline`: both modes on one seeded workload, one shared simulated server and broker."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from rollway.base.http import http_get, http_post
from rollway.base.process import Child, free_port
from rollway.base.run_dir import RunDir
from rollway.bench import report
from rollway.bench.baseline import BaselineResult, run_baseline
from rollway.bench.bench_dir import BenchDir
from rollway.bench.pipeline import PipelineRun, load_run_config, run_config, run_pipeline
from rollway.bench.sim_server import busy_stats
from rollway.bench.workload import (
    EpisodePlan,
    WorkloadConfig,
    ideal_makespan,
    plan_workload,
    workload_summary,
    write_plans,
)
from rollway.runtime.broker import EmbeddedBroker
from rollway.runtime.telemetry import EpisodeStages, episode_stages, read_telemetry
from rollway.sandboxes.sim import live_sandbox_stats


class SimServer:
    """The simulated inference server as its own process (shared by every agent worker). It dies with
    the bench process (the launcher's `die_with_parent`), so a bench killed from outside leaves no
    server behind."""

    def __init__(self, plans_path: Path, wl: WorkloadConfig, log_path: Path, instant: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.argv = [sys.executable, "-m", "rollway.bench.sim_server", "--plans", str(plans_path),
                     "--workload", wl.model_dump_json(), "--port", str(self.port)] + ["--instant"] * instant
        self.log_path = log_path
        self.proc: Child | None = None

    def __enter__(self) -> SimServer:
        self.proc = Child(self.argv, self.log_path, name="the sim server", die_with_parent=True).start()
        self.proc.wait_for_http(f"http://127.0.0.1:{self.port}/health", timeout_s=30)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.stop(grace_s=10)

    def reset(self) -> None:
        """Empty the server's prefix cache before a mode: both modes run the same episodes, and a
        warm cache would spare the second one the prefill of each episode's first prompt."""
        http_post(f"http://127.0.0.1:{self.port}/sim/reset", timeout_s=30)

    def steps(self, t0: float, t1: float) -> dict[str, Any]:
        """The server's steps, cap and request log over [t0, t1]."""
        return http_get(f"http://127.0.0.1:{self.port}/sim/steps?t0={t0}&t1={t1}", timeout_s=30).json()


def partial(plans: list[EpisodePlan], carried: list[list[int]]) -> list[EpisodePlan]:
    """Plans cut to the turns each carried episode completed inside its mode's window."""
    return [dataclasses.replace(plans[i], turns=plans[i].turns[:done]) for i, done in carried]


def first_graded(created_at: dict[str, float], count: int) -> list[str]:
    """The `count` episodes graded first: a step's batch when unfinished episodes carry over (all of
    them, in grading order, when there are no more)."""
    return sorted(created_at, key=created_at.get)[:count]


def plan_index(task_id: str) -> int:
    """`sim-00012` -> 12: a sim task names its plan."""
    return int(task_id.rsplit("-", 1)[1])


def init_end(stages: dict[tuple[str, int], EpisodeStages], episode_id: str, attempt: int) -> float:
    """When the init stage finished this attempt (its sandbox started), from the telemetry; 0.0: never."""
    found = stages.get((episode_id, attempt))
    return found.init_end if found is not None else 0.0


def carried_work(episodes: list[tuple[str, str, float, list[float]]], batch: set[str], ended: float) -> list[list[int]]:
    """[plan index, turns completed by `ended`] of every episode outside the batch whose sandbox had
    started by then: the carried work its window did (a turn counts once its tool call has ended).
    `episodes`: (episode id, task id, init end, each turn's tool end)."""
    return [[plan_index(task), sum(1 for t in turn_ends if t and t <= ended)]
            for eid, task, init_end, turn_ends in episodes if eid not in batch and init_end and init_end <= ended]


def mode_figures(label: str, started: float, ended: float, trajectories: list[dict[str, Any]],
                 server: SimServer, sandbox_root: Path, episodes_run: int) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Figures of one mode over [started, ended] (ended: its batch's last grading); `trajectories`
    are the batch's, `episodes_run` counts carried episodes too (sandbox-seconds are per episode run)."""
    data = server.steps(started, ended)
    steps, cap = data["steps"], data["cap"]
    sandboxes = live_sandbox_stats(sandbox_root)
    episodes = len(trajectories)
    figures = {"label": label, "makespan_s": ended - started, "episodes": episodes, "episodes_run": episodes_run,
               **busy_stats(steps, started, ended, cap),
               **report.inference_latency(data["request_log"], trajectories),
               "prefill_tokens": data["prefill_tokens"],
               "peak_live_sandboxes": sandboxes["peak_live_sandboxes"],
               "sandbox_seconds_per_episode": sandboxes["sandbox_seconds"] / max(1, episodes_run),
               "sandboxes_leaked": sandboxes["leaked"]}
    return figures, report.utilisation_series(steps, started, ended, bin_s=max(0.25, (ended - started) / 120))


def baseline_mode(wl: WorkloadConfig, out: Path, server: SimServer) -> tuple[dict, list, BaselineResult]:
    run_dir = RunDir(out).sub("baseline").path
    server.reset()
    data = run_config(wl, BenchDir(out).plans, RunDir(run_dir).sandboxes, server.url, "baseline")
    cfg = load_run_config(data, RunDir(run_dir).run_config_yaml)
    result = asyncio.run(run_baseline(cfg, run_dir, wl.slots))
    batch = sorted(result.trajectories, key=lambda t: t.created_at)[:wl.episodes]
    figures, series = mode_figures(f"baseline ({wl.slots} slots)", result.started, batch[-1].created_at,
                                   [msgspec.to_builtins(t) for t in batch], server, RunDir(run_dir).sandboxes,
                                   len(result.trajectories))
    figures["peak_busy_slots"] = result.peak_busy_slots
    figures["batch"] = sorted(plan_index(t.task_id) for t in batch)
    stages = episode_stages(read_telemetry(run_dir))
    figures["carried"] = carried_work([(t.episode_id, t.task_id, init_end(stages, t.episode_id, t.attempt),
                                        [u.tool_ended_at or 0.0 for u in t.turns]) for t in result.trajectories],
                                      {t.episode_id for t in batch}, batch[-1].created_at)
    return figures, series, result


def pipeline_mode(wl: WorkloadConfig, out: Path, server: SimServer, bootstrap: str,
                  workers: int) -> tuple[dict, list, PipelineRun]:
    name = f"pipeline-a{workers}"
    run_dir = RunDir(out).sub(name).path
    server.reset()
    data = run_config(wl, BenchDir(out).plans, RunDir(run_dir).sandboxes, server.url, name, workers)
    run = run_pipeline(data, run_dir, bootstrap, workers)
    from rollway.base.run_dir import read_trajectories

    trajectories = read_trajectories(run_dir)
    batch = first_graded(run.created_at, wl.episodes)
    ended = run.created_at[batch[-1]]
    in_batch = set(batch)
    figures, series = mode_figures(f"pipeline ({workers} agent worker{'s' * (workers > 1)})", run.started,
                                   ended, [t for t in trajectories if t["episode"]["episode_id"] in in_batch], server,
                                   RunDir(run_dir).sandboxes, len(trajectories))
    telemetry = read_telemetry(run_dir)
    figures.update(report.hop_stats(telemetry, run.issued_at, {e: run.created_at[e] for e in batch}))
    held = [(s, min(e, ended)) for s, e in report.model_slot_intervals(telemetry, trajectories, wl.tool_overlap)
            if s < ended]
    figures.update(report.agent_slot_phases(held, run.started, ended, wl.slots))
    figures["batch"] = sorted(plan_index(run.task_ids[e]) for e in batch)
    stages = episode_stages(telemetry)
    figures["carried"] = carried_work([(t["episode"]["episode_id"], t["episode"]["task_id"],
                                        init_end(stages, t["episode"]["episode_id"], t["episode"]["attempt"]),
                                        [u.get("tool_ended_at") or 0.0 for u in t.get("turns", [])])
                                       for t in trajectories], in_batch, ended)
    figures.update({"agent_workers": workers, "sandbox_bound": wl.sandbox_bound,
                    "messages": run.messages, "messages_per_second": run.messages / run.makespan,
                    "bytes": report.bytes_vs_turns(run.bytes_per_episode, run.turns),
                    "episodes_failed": run.summary.get("episodes_failed"),
                    "episodes_retried": run.summary.get("episodes_retried")})
    return figures, series, run


def run_bench(wl: WorkloadConfig, out: Path, scaling: list[int], say=print, with_baseline: bool = True) -> dict[str, Any]:
    """Baseline once (unless `with_baseline` is False: then no ratio), the pipeline once per
    agent-worker count (the first one is the headline)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print_progress = say

    def say(message: str) -> None:
        print_progress(f"[{time.monotonic() - t0:5.0f}s] {message}")

    plans = plan_workload(wl.model_copy(update={"episodes": wl.episodes + wl.carried}))
    write_plans(plans, BenchDir(out).plans)
    runs: dict[int, dict] = {}
    series: dict[str, list] = {}
    with SimServer(BenchDir(out).plans, wl, BenchDir(out).sim_server_log) as server, \
            EmbeddedBroker(log_path=BenchDir(out).bench_broker_log) as broker:
        baseline = None
        if with_baseline:
            say(f"bench: baseline, {wl.episodes} episodes, {wl.slots} slots")
            baseline, series["baseline"], _ = baseline_mode(wl, out, server)
        for workers in scaling:
            say(f"bench: pipeline, {workers} agent worker(s)")
            runs[workers], s, _ = pipeline_mode(wl, out, server, broker.bootstrap, workers)
            series.setdefault("pipeline", s)
    headline = runs[scaling[0]]
    for r in runs.values():  # each run's bound is taken over the episodes it graded first (all without carry_over)
        carried = r.pop("carried")
        r["episodes_carried"], r["carried_turns"] = len(carried), sum(n for _, n in carried)
        r["ideal"] = ideal_makespan([plans[i] for i in r.pop("batch")], wl, partial(plans, carried))
        r["ratio"] = baseline["makespan_s"] / r["makespan_s"] if baseline else None
        r["efficiency"] = r["ideal"]["ideal_makespan"] / r["makespan_s"]
    if baseline:
        baseline["ideal_makespan"] = ideal_makespan([plans[i] for i in baseline.pop("batch")], wl,
                                                    partial(plans, baseline.pop("carried")))["ideal_makespan"]
    ideal = headline["ideal"]
    plot = BenchDir(out).utilisation_plot
    report.plot_utilisation({**({baseline["label"]: series["baseline"]} if baseline else {}),
                             headline["label"]: series["pipeline"]}, wl.slots, plot)
    return {"workload": wl.model_dump(), "workload_summary": workload_summary(plans[:wl.episodes]), "ideal": ideal,
            "ideal_makespan": ideal["ideal_makespan"], "baseline": baseline, "pipeline": headline,
            "ratio": headline["ratio"], "efficiency": headline["efficiency"],
            "broker_overhead_fraction": headline["broker_overhead_fraction"],
            "scaling": [runs[w] for w in scaling] if len(scaling) > 1 else [],
            "plot": str(plot), "out_dir": str(out),
            "utilisation_series": series}
