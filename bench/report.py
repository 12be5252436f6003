"""Figures of a benchmark run: broker hops and overhead, bytes per episode, utilisation plot, text table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollway.base.figures import fmt, percentile, put, ratio, scaled
from rollway.runtime.telemetry import Handled, handled

CHAIN_TOPICS = ("init-requests", "agent-steps", "reward-requests")
"""Hops inside an episode's lifetime (issue -> graded)."""


def hop_stats(telemetry: list[Handled], issued_at: dict[str, float], created_at: dict[str, float]) -> dict:
    """From the stage runtimes' telemetry (runtime/telemetry.py, with `run.trace` for fetch times):
    hop latency = handling start - production (the record's timestamp; it includes waiting for a free
    slot). Broker transit = fetch time - max(production, start of the poll that fetched it): the time
    the message spent in produce, log and fetch while the consumer was waiting for work, i.e. the
    delay the broker itself adds; waiting for a busy stage is queueing, not broker overhead.

    broker_overhead_fraction = sum of transit over every hop inside episode lifetimes / sum of
    episode lifetimes (issued -> graded). The makespan is a chain of episode lifetimes (each slot
    runs one episode after another), so this is the broker's share of it. The last-finishing
    episode's own share is reported beside it."""
    hops = [h for h in handled(telemetry) if h.topic.split(".")[-1] in CHAIN_TOPICS and h.episode_id in created_at]
    latency = [h.started_at - h.produced_at for h in hops]
    transits = [max(0.0, (h.fetched_at or h.started_at) - max(h.produced_at, h.polled_at or 0.0)) for h in hops]
    transit: dict[str, float] = {}
    for h, t in zip(hops, transits, strict=True):
        transit[h.episode_id] = transit.get(h.episode_id, 0.0) + t
    lifetimes = {e: created_at[e] - issued_at[e] for e in created_at if e in issued_at}
    last = max(created_at, key=created_at.get)
    figures: dict[str, Any] = {"hops": len(hops)}
    no_hop = "no hop of an episode's chain in the telemetry (is run.trace on?)"
    put(figures, "hop_latency_p50_ms", scaled(1000, percentile(latency, 50)), no_hop)
    put(figures, "hop_latency_p99_ms", scaled(1000, percentile(latency, 99)), no_hop)
    put(figures, "broker_transit_p50_ms", scaled(1000, percentile(transits, 50)), no_hop)
    put(figures, "broker_overhead_fraction", ratio(sum(transit.values()), sum(lifetimes.values())),
        "no episode's lifetime (issued -> graded) is known")
    put(figures, "broker_overhead_last_episode_fraction", ratio(transit.get(last, 0.0), lifetimes.get(last)),
        "the last-graded episode's lifetime is not known")
    return figures


def inference_latency(request_log: list[list[float]], trajectories: list[dict[str, Any]]) -> dict[str, float]:
    """Where a turn's generation time goes, per request (ms, means): waiting for a step boundary and a
    free sequence slot at the server (`admission`), the server's steps (`engine`), the answer leaving
    after its last step (`answer_lag`), and everything the agent saw beyond the server's own
    arrival-to-answer time (`client`: HTTP, JSON, the agent's event loop). `client` compares means: the
    agent's generation time per turn over the trajectories' turns against the server's time per request
    over the window's requests (with carry-over the window also serves turns of episodes graded after
    it, so the two sets differ and totals would not compare)."""
    n = len(request_log)
    gens = [u.get("gen_seconds", 0.0) for t in trajectories for u in t.get("turns", [])]
    if not n or not gens:
        return {}
    served = sum(answered - arrived for arrived, _, _, answered, *_ in request_log) / n
    return {
        "inference_requests": n,
        "inference_admission_ms": 1000 * sum(a - r for r, a, _, _, *_ in request_log) / n,
        "inference_engine_ms": 1000 * sum(f - a for _, a, f, _, *_ in request_log) / n,
        "inference_answer_lag_ms": 1000 * sum(ans - f for _, _, f, ans, *_ in request_log) / n,
        "inference_client_ms": 1000 * (sum(gens) / len(gens) - served),
    }


def model_slot_intervals(telemetry: list[Handled], trajectories: list[dict[str, Any]],
                         tool_overlap: int) -> list[tuple[float, float]]:
    """When the agent held its model-call slots: a whole turn's handling (telemetry) when tool calls
    hold the slot too (tool_overlap 0), else each turn's generation (trajectories)."""
    if not tool_overlap:
        return [(h.started_at, h.ended_at) for h in handled(telemetry) if h.stage == "agent"]
    return [(u["gen_started_at"], u["gen_ended_at"]) for t in trajectories for u in t.get("turns", [])
            if u.get("gen_started_at") and u.get("gen_ended_at")]


def agent_slot_phases(intervals: list[tuple[float, float]], started: float, ended: float,
                      slots: int) -> dict[str, float]:
    """From when the agent's model-call slots were held: `ramp_up_s` (start -> every slot busy for the
    first time), `drain_s` (the last moment every slot was busy -> end), `slots_busy_fraction`
    (slot-seconds used, at most `slots` at a time, / slots x makespan) and `peak_busy_slots` (most held at
    once: up to `slots + model_call_slack`, since the agent may keep that many calls outstanding and the
    server queues the extra ones). Start-up and drain are where a finite batch cannot keep the bottleneck
    full; the ideal makespan credits them only the shortest init and grading."""
    if not intervals:
        return {}
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    busy, peak, first_full, last_full = 0, 0, None, None
    used, previous = 0.0, started
    for t, delta in events:
        used += min(busy, slots) * max(0.0, t - previous)
        previous = t
        was_full = busy >= slots
        busy += delta
        peak = max(peak, busy)
        if busy >= slots and first_full is None:
            first_full = t
        if was_full and busy < slots:
            last_full = t  # a full period ends here
    return {
        "ramp_up_s": (first_full if first_full is not None else ended) - started,
        "drain_s": ended - (last_full if last_full is not None else started),
        "slots_busy_fraction": used / max(1e-9, slots * (ended - started)),
        "peak_busy_slots": peak,
    }


def linear_fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares y = intercept + slope x, with r^2."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return {"bytes_per_turn": slope, "bytes_fixed": intercept, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def bytes_vs_turns(bytes_per_episode: dict[str, int], turns: dict[str, int]) -> dict[str, Any]:
    episodes = [e for e in turns if e in bytes_per_episode]
    xs, ys = [turns[e] for e in episodes], [bytes_per_episode[e] for e in episodes]
    by_turns: dict[int, list[int]] = {}
    for x, y in zip(xs, ys, strict=True):
        by_turns.setdefault(x, []).append(y)
    return {"bytes_per_episode_mean": sum(ys) / len(ys), "fit": linear_fit(xs, ys),
            "mean_bytes_by_turns": {k: round(sum(v) / len(v)) for k, v in sorted(by_turns.items())}}


def utilisation_series(steps: list[list[float]], t0: float, t1: float, bin_s: float) -> list[dict[str, float]]:
    """Busy fraction and mean running sequences per time bin (relative to t0)."""
    bins = max(1, int((t1 - t0) / bin_s + 0.999))
    busy, active = [0.0] * bins, [0.0] * bins
    for s, e, n in steps:
        s, e = max(s, t0), min(e, t1)
        while s < e:
            i = min(bins - 1, int((s - t0) / bin_s))
            cut = min(e, t0 + (i + 1) * bin_s)
            busy[i] += cut - s
            active[i] += (cut - s) * n
            s = cut if cut > s else e
    return [{"t": i * bin_s, "busy": busy[i] / bin_s, "active": active[i] / bin_s} for i in range(bins)]


def plot_utilisation(series: dict[str, list[dict[str, float]]], cap: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for label, points in series.items():
        ts = [p["t"] for p in points]
        top.plot(ts, [p["busy"] for p in points], label=label, drawstyle="steps-post")
        bottom.plot(ts, [p["active"] / cap for p in points], label=label, drawstyle="steps-post")
    top.set_ylabel("busy fraction\n(>= 1 sequence)")
    bottom.set_ylabel("running sequences / cap")
    bottom.set_xlabel("seconds since the mode's first episode was issued")
    for ax in (top, bottom):
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    top.legend(loc="lower center")
    top.set_title("Simulated inference server utilisation: pipelined vs bounded async batching")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_text(result: dict[str, Any]) -> str:
    b, p = result["baseline"], result["pipeline"]
    modes = [m for m in (b, p) if m]
    ratio = f"{result['ratio']:.3f}" if result["ratio"] is not None else "- (no baseline)"
    lines = [
        f"workload: {result['workload_summary']}",
        f"{'mode':<27}{'makespan_s':>11}{'busy':>7}{'active/cap':>11}{'peak_sbx':>9}{'sbx_s/ep':>9}",
        *(f"{m['label']:<27}{m['makespan_s']:>11.2f}{m['busy_fraction']:>7.2f}"
          f"{m['mean_active_fraction_of_cap']:>11.2f}{m['peak_live_sandboxes']:>9}"
          f"{m['sandbox_seconds_per_episode']:>9.2f}" for m in modes),
        f"ratio (baseline/pipeline) {ratio}   ideal_makespan {result['ideal_makespan']:.2f}s "
        f"({result['ideal']['bottleneck']})   efficiency {result['efficiency']:.3f}",
        (f"carry-over: each mode's makespan ends at its {p['episodes']}th grading; pipeline: "
         f"{p.get('episodes_carried', 0)} episodes carried over, their {p.get('carried_turns', 0)} completed turns "
         f"counted in the bound" if result["workload"].get("carry_over") else "full drain: every episode waited for"),
        f"pipeline sandbox bound {p['sandbox_bound']} (peak {p['peak_live_sandboxes']}, "
        f"within: {p['peak_live_sandboxes'] <= p['sandbox_bound']}), episodes re-issued after their deadline: "
        f"{p.get('episodes_retried', 0)}",
        f"pipeline model-call slots ({result['workload']['slots']}, the baseline's slots; turns at once: "
        f"{result['workload']['slots'] + result['workload']['tool_overlap']}): "
        f"all busy after {p.get('ramp_up_s', 0):.2f}s ramp-up, draining for the last "
        f"{p.get('drain_s', 0):.2f}s, busy {p.get('slots_busy_fraction', 0):.2f} of slot time",
        *(
            f"{m['label']:<27}inference per request: admission {m['inference_admission_ms']:.1f} ms, engine "
            f"{m['inference_engine_ms']:.0f} ms, answer lag {m['inference_answer_lag_ms']:.1f} ms, client "
            f"{m['inference_client_ms']:.1f} ms"
            for m in modes
            if "inference_requests" in m
        ),
        f"broker: hop p50 {fmt(p['hop_latency_p50_ms'], '.1f')} ms, p99 {fmt(p['hop_latency_p99_ms'], '.1f')} ms, "
        f"transit p50 {fmt(p['broker_transit_p50_ms'], '.1f')} ms, {p['messages_per_second']:.1f} msg/s, "
        f"broker_overhead_fraction {fmt(p['broker_overhead_fraction'], '.4f')}",
        f"bytes/episode {p['bytes']['bytes_per_episode_mean']:.0f} = {p['bytes']['fit']['bytes_fixed']:.0f} + "
        f"{p['bytes']['fit']['bytes_per_turn']:.0f} x turns (r2 {p['bytes']['fit']['r2']:.3f})",
        f"plot: {result['plot']}",
    ]
    if result.get("scaling"):
        lines.append(f"{'agent workers':<15}{'makespan_s':>11}{'ratio':>7}{'efficiency':>11}{'busy':>7}"
                     f"{'hop_p50_ms':>11}{'hop_p99_ms':>11}{'peak_sbx':>9}{'overhead':>9}")
        lines += [f"{r['agent_workers']:<15}{r['makespan_s']:>11.2f}{fmt(r['ratio'], '>7.3f'):>7}{r['efficiency']:>11.3f}"
                  f"{r['busy_fraction']:>7.2f}{fmt(r['hop_latency_p50_ms'], '>11.1f'):>11}"
                  f"{fmt(r['hop_latency_p99_ms'], '>11.1f'):>11}"
                  f"{r['peak_live_sandboxes']:>9}{fmt(r['broker_overhead_fraction'], '>9.4f'):>9}"
                  for r in result["scaling"]]
    return "\n".join(lines)
