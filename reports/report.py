"""The run report: reward curves, episode timeline, inference utilisation, tools and stop reasons as
PNG files in `plots/` and one self-contained `report.html` (images inlined as base64)."""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollway.base.blame import graded_failures
from rollway.base.redaction import redact
from rollway.base.run_dir import RunDir, iter_jsonl
from rollway.envs.reach_check import suspected_hacks
from rollway.reports.episodes import load_run_dir
from rollway.runtime.telemetry import EpisodeStages, episode_stages, read_telemetry

Stages = dict[tuple[str, int], EpisodeStages]
"""Stage times per (episode id, attempt), from the run's telemetry."""

MAX_TIMELINE_EPISODES = 200
"""Beyond this the timeline shows the first episodes issued (the chart stays legible)."""
MAX_TOOL_BAR_EPISODES = 100
SPAN_COLORS = {"queue": "#d9d9d9", "init": "#4c78a8", "gen": "#f58518", "tool": "#54a24b", "reward": "#b279a2"}


@dataclass
class Span:
    """One bar of the timeline: `kind` of work on one episode from `start` to `end` (unix seconds)."""

    kind: str
    start: float
    end: float


@dataclass
class ReportData:
    run_dir: Path
    trajs: list[dict[str, Any]]
    """In completion order."""
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """One record per learner step (metrics.jsonl), possibly empty."""
    stages: Stages = field(default_factory=dict)
    """Stage times of each episode (empty for a run folder without telemetry)."""


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def load_report_data(run_dir: Path) -> ReportData:
    run_dir = Path(run_dir)
    metrics = list(iter_jsonl(RunDir(run_dir).metrics))
    return ReportData(run_dir, load_run_dir(run_dir), _read_json(RunDir(run_dir).summary), metrics,
                      episode_stages(read_telemetry(run_dir)))


# -- derived series ---------------------------------------------------------------------------------
def running_mean(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values, 1):
        total += v
        out.append(total / i)
    return out


def stages_of(traj: dict[str, Any], stages: Stages) -> EpisodeStages:
    """The stage times of the attempt that made `traj` (all 0.0 when the telemetry lacks them)."""
    key = traj["episode"]
    return stages.get((key["episode_id"], key.get("attempt", 0))) or EpisodeStages()


def episode_spans(traj: dict[str, Any], stages: Stages) -> list[Span]:
    """Timeline bars of one episode: stage times from the telemetry, generation and tool times from
    its turns; empty for episodes recorded without them."""
    st = stages_of(traj, stages)
    spans = []
    if st.issued and st.init_start:
        spans.append(Span("queue", st.issued, st.init_start))
    if st.init_start:
        spans.append(Span("init", st.init_start, st.init_end))
    for turn in traj.get("turns", []):
        if turn.get("gen_started_at"):
            spans.append(Span("gen", turn["gen_started_at"], turn["gen_ended_at"]))
            spans.append(Span("tool", turn["gen_ended_at"], turn["tool_ended_at"]))
    if st.reward_start:
        spans.append(Span("reward", st.reward_start, st.reward_end))
    return spans


def busy_fraction(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Share of [start, end] covered by at least one interval (overlaps counted once)."""
    if end <= start:
        return 0.0
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / (end - start)


def in_flight_steps(intervals: list[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """Step function of how many intervals are open: (times, counts)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    times, counts, level = [], [], 0
    for t, d in events:
        level += d
        times.append(t)
        counts.append(level)
    return times, counts


def gen_intervals(trajs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return [(t["gen_started_at"], t["gen_ended_at"]) for tr in trajs for t in tr.get("turns", [])
            if t.get("gen_started_at")]


def run_window(trajs: list[dict[str, Any]], stages: Stages) -> tuple[float, float] | None:
    """(first stage event, last stage event) over every episode, or None without any."""
    points = [s for tr in trajs for sp in episode_spans(tr, stages) for s in (sp.start, sp.end)]
    return (min(points), max(points)) if points else None


def inference_utilisation(trajs: list[dict[str, Any]], stages: Stages) -> float | None:
    """Fraction of the run's wall time with at least one generation in flight."""
    window = run_window(trajs, stages)
    return busy_fraction(gen_intervals(trajs), *window) if window else None


def tool_counts(traj: dict[str, Any]) -> Counter:
    return Counter(o.get("tool") or "(no valid call)" for t in traj.get("turns", []) for o in t.get("observations", []))


# -- plots ------------------------------------------------------------------------------------------
def _figure(width: float = 10, height: float = 4, *, left: float = 0.85, bottom: float = 0.55, top: float = 0.4,
            right: float = 0.2, hspace: float = 0.35):
    """A figure whose margins are given in inches (room for tick labels, axis labels and the title). Fixed
    margins, not a layout engine: "tight" draws every figure twice to measure its text, and the report is
    part of every `rollway up` (0.2 against 0.1 s a figure here; "constrained" was slower still)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    fig = Figure(figsize=(width, height), dpi=100)
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                        hspace=hspace)
    return fig


def _label_inches(labels: list[str], fontsize: float = 10) -> float:
    """Room for the longest of `labels` as y tick labels, with the axis' tick marks."""
    return 0.25 + 0.6 * fontsize / 72 * max((len(x) for x in labels), default=4)


def plot_reward_curve(trajs: list[dict[str, Any]]):
    fig = _figure()
    ax = fig.add_subplot()
    x = list(range(1, len(trajs) + 1))
    rewards = [float(t["reward"]) for t in trajs]
    ax.scatter(x, rewards, s=12, alpha=0.5, color="#4c78a8", label="reward (episode)")
    # With 0/1 rewards the two running means coincide: the reward line is drawn wide underneath and the
    # pass rate thin and dashed on top, so both stay visible where they overlap.
    ax.plot(x, running_mean(rewards), color="#4c78a8", linewidth=4, zorder=2, label="reward (running mean)")
    ax.plot(x, running_mean([float(bool(t["resolved"])) for t in trajs]), color="#e45756", linewidth=1.5,
            linestyle=(0, (4, 3)), zorder=3, label="pass rate (running)")
    ax.set_xlabel("episodes completed (time order)")
    ax.set_ylabel("reward / pass rate")
    ax.set_ylim(min(-0.05, min(rewards) - 0.05), max(1.05, max(rewards) + 0.05))  # a flat 1.0 stays readable
    ax.set_title("Reward and pass rate over completed episodes")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    return fig


def plot_learner_curves(metrics: list[dict[str, Any]]):
    keys = [k for k in ("reward_mean", "pass_rate", "loss") if any(k in m for m in metrics)]
    fig = _figure(10, 2.6 * max(len(keys), 1))
    steps = [m.get("step", i + 1) for i, m in enumerate(metrics)]
    for i, key in enumerate(keys, 1):
        ax = fig.add_subplot(len(keys), 1, i)
        pts = [(s, m[key]) for s, m in zip(steps, metrics, strict=True) if key in m]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    fig.axes[0].set_title("Learner metrics per step (metrics.jsonl)")
    fig.axes[-1].set_xlabel("learner step")
    return fig


def plot_timeline(trajs: list[dict[str, Any]], stages: Stages, t0: float):
    from matplotlib.patches import Patch

    rows = sorted(trajs, key=lambda t: stages_of(t, stages).issued)[:MAX_TIMELINE_EPISODES]
    labels = ["-".join(t["episode"]["episode_id"].split("-")[-2:]) for t in rows]
    fig = _figure(12, min(2.0 + 0.28 * len(rows), 40), left=_label_inches(labels, 7))
    ax = fig.add_subplot()
    for y, traj in enumerate(rows):
        for kind in SPAN_COLORS:
            bars = [(s.start - t0, max(s.end - s.start, 1e-3)) for s in episode_spans(traj, stages) if s.kind == kind]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=SPAN_COLORS[kind], edgecolor="white", linewidth=0.3)
    # Episode ids are RUN-GROUP-SAMPLE; the run part is the same on every row.
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first episode was issued")
    ax.set_title("Episode timeline: queue wait, init, generation and tools per turn, reward")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in SPAN_COLORS.items()], loc="upper right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig


def plot_inference(trajs: list[dict[str, Any]], stages: Stages, t0: float, utilisation: float):
    fig = _figure(10, 3.5)
    ax = fig.add_subplot()
    episodes = [(sp[0].start, sp[-1].end) for tr in trajs if (sp := episode_spans(tr, stages))]
    for intervals, label, color in ((episodes, "episodes in flight", "#bab0ac"),
                                    (gen_intervals(trajs), "generations in flight", "#f58518")):
        times, counts = in_flight_steps(intervals)
        ax.step([t - t0 for t in times], counts, where="post", label=label, color=color)
    ax.set_xlabel("seconds since the first episode was issued")
    ax.set_ylabel("in flight")
    ax.set_title(f"Inference utilisation: {utilisation:.1%} of wall time with a generation in flight")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    return fig


def plot_tools(trajs: list[dict[str, Any]]):
    shown = trajs[:MAX_TOOL_BAR_EPISODES]
    counts = [tool_counts(t) for t in shown]
    tools = sorted({k for c in counts for k in c})
    fig = _figure(10, 3.8)
    ax = fig.add_subplot()
    bottom = [0] * len(shown)
    for tool in tools:
        heights = [c.get(tool, 0) for c in counts]
        ax.bar(range(len(shown)), heights, bottom=bottom, label=tool)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xlabel("episode (completion order)")
    ax.set_ylabel("tool calls")
    ax.set_title("Tool calls per episode")
    if tools:
        ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_stop_reasons(trajs: list[dict[str, Any]]):
    counts = Counter(t["stop_reason"] for t in trajs).most_common()
    fig = _figure(8, 1.0 + 0.45 * max(len(counts), 2), left=_label_inches([k for k, _ in counts]))
    ax = fig.add_subplot()
    ax.barh([k for k, _ in counts], [v for _, v in counts], color="#72b7b2")
    ax.invert_yaxis()
    ax.set_xlabel("episodes")
    ax.set_title("Stop reasons")
    return fig


def warm_up() -> None:
    """Draw and encode one small figure: imports matplotlib's renderer and loads its font cache, so a
    later report in this process starts warm. Never raises (the report itself would say what failed)."""
    try:
        fig = _figure(2, 1)
        ax = fig.add_subplot()
        ax.plot([0, 1], [0, 1], label="warm")
        ax.set_title("warm")
        ax.legend()
        fig.savefig(io.BytesIO(), format="png")
    except Exception:  # noqa: BLE001 - a warm-up only; write_report reports real failures
        pass


def plot_names(data: ReportData) -> list[str]:
    """The figures this run has data for, in the report's order."""
    window = run_window(data.trajs, data.stages)
    present = {"reward": bool(data.trajs), "learner": bool(data.metrics), "timeline": bool(window),
               "inference": bool(window), "tools": bool(data.trajs), "stop_reasons": bool(data.trajs)}
    return [name for name, _, _ in SECTIONS if present[name]]


def build_plots(data: ReportData, only: list[str] | None = None) -> dict[str, Any]:
    """Figures by name (the PNG file stem): those of `only`, else every one the run has data for."""
    trajs, names = data.trajs, plot_names(data) if only is None else only
    window = run_window(trajs, data.stages)
    draw = {"reward": lambda: plot_reward_curve(trajs),
            "learner": lambda: plot_learner_curves(data.metrics),
            "timeline": lambda: plot_timeline(trajs, data.stages, window[0]),
            "inference": lambda: plot_inference(trajs, data.stages, window[0],
                                                inference_utilisation(trajs, data.stages) or 0.0),
            "tools": lambda: plot_tools(trajs),
            "stop_reasons": lambda: plot_stop_reasons(trajs)}
    return {name: draw[name]() for name in names}


def save_plots(figs: dict[str, Any], plots_dir: Path) -> dict[str, bytes]:
    """Write `plots/<name>.png` and return the PNG bytes by name."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for name, fig in figs.items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})  # a fifth faster than the default 6
        pngs[name] = buf.getvalue()
        (plots_dir / f"{name}.png").write_bytes(pngs[name])
    return pngs


# -- HTML -------------------------------------------------------------------------------------------
SECTIONS = (
    ("reward", "Reward and pass rate", "Per episode in the order episodes completed, with running means."),
    ("learner", "Learner steps", "One point per learner update, from metrics.jsonl."),
    ("timeline", "Episode timeline", "One row per episode: waiting for init (grey), sandbox init, then per "
     "turn generation and tool calls, then grading. Gaps are queue waits between stages."),
    ("inference", "Inference utilisation", "Generations and episodes in flight over time."),
    ("tools", "Tool usage", "Tool calls per episode, stacked by tool."),
    ("stop_reasons", "Stop reasons", "Why episodes ended."),
)
CSS = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1250px}"
       "table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;"
       "text-align:left}th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}"
       "section{margin:28px 0}.muted{color:#777}")


def _table(rows: list[list[Any]], header: list[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _summary_html(data: ReportData) -> str:
    s = data.summary
    keys = ("run_id", "episodes_completed", "episodes_failed", "reward_mean", "pass_rate", "turns_mean",
            "wall_seconds", "episodes_per_second")
    rows = [[k, s[k]] for k in keys if k in s]
    rows.append(["suspected_reward_hacks", suspected_hacks(data.trajs)])
    util = inference_utilisation(data.trajs, data.stages)
    if util is not None:
        rows.append(["inference_utilisation", f"{util:.1%}"])
    totals = Counter()
    for t in data.trajs:
        totals.update(tool_counts(t))
    rows.append(["tool_calls", ", ".join(f"{k}: {v}" for k, v in totals.most_common()) or "-"])
    failed = graded_failures(data.trajs)
    rows.append(["graded_0_by_failure", ", ".join(f"{k} x{v}" for k, v in failed.items()) or "-"])
    return _table(rows, ["metric", "value"])


def _episodes_html(trajs: list[dict[str, Any]], stages: Stages) -> str:
    def lifetime(t: dict[str, Any]) -> str:
        st = stages_of(t, stages)
        return f"{st.reward_end - st.issued:.2f}s" if st.issued and st.reward_end else "-"

    rows = [[t["episode"]["episode_id"], t["episode"]["task_id"], t["reward"], t["num_turns"],
             len(t.get("segment_starts") or []) + 1, t["stop_reason"], lifetime(t)] for t in trajs]
    return _table(rows, ["episode", "task", "reward", "turns", "segments", "stop reason", "issued to graded"])


HARNESS_EPISODES_SHOWN = 20
"""Harness episodes whose calls the report lists (the rest: `rollway show RUN_DIR --episode ID`)."""


def _calls_html(trajs: list[dict[str, Any]]) -> str:
    """Harness episodes call by call: each kept program call, its segment, and which call opened a
    segment and why. Empty when the run has no harness episode."""
    from rollway.reports.show import is_harness, turn_segments

    harness = [t for t in trajs if is_harness(t)]
    if not harness:
        return ""
    rows = []
    for t in harness[:HARNESS_EPISODES_SHOWN]:
        for turn, seg in zip(t["turns"], turn_segments(t), strict=True):
            opened = turn.get("segment_reason") or ""
            rows.append([t["episode"]["episode_id"], turn["call_index"], seg, opened, turn["finish_reason"],
                         len(turn.get("completion_ids") or []),
                         ", ".join(o.get("tool") or "?" for o in turn.get("observations") or []) or "-"])
        rows += [[t["episode"]["episode_id"], c["call_index"], "side (not trained)", c["name"], "-", c["output_tokens"],
                  "-"] for c in t.get("side_calls") or []]
    more = len(harness) - HARNESS_EPISODES_SHOWN
    note = f"<p class='muted'>{more} more harness episodes: <code>rollway show RUN_DIR --episode ID</code></p>" \
        if more > 0 else ""
    return ("<section id='calls'><h2>Agent-program calls</h2><p class='muted'>Harness episodes call by call. A "
            "call that opened a segment (the program rewrote its history) names why; each segment trains as "
            "its own sequence with the episode's advantage.</p>"
            + _table(rows, ["episode", "call", "segment", "opened segment because", "finish", "output tokens",
                            "tool results sent back"]) + note + "</section>")


def render_html(data: ReportData, pngs: dict[str, bytes]) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>rollway report {html.escape(str(data.run_dir))}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>rollway run report</h1><p class='muted'>{html.escape(str(data.run_dir))}</p>",
             "<section id='summary'><h2>Summary</h2>", _summary_html(data), "</section>"]
    for name, title, caption in SECTIONS:
        if name not in pngs:
            continue
        b64 = base64.b64encode(pngs[name]).decode()
        parts.append(f"<section id='{name}'><h2>{title}</h2><p class='muted'>{caption}</p>"
                     f"<img alt='{name}' src='data:image/png;base64,{b64}'></section>")
    parts += ["<section id='episodes'><h2>Episodes</h2>", _episodes_html(data.trajs, data.stages),
              "<p class='muted'>View one turn by turn: <code>rollway show RUN_DIR --episode ID</code></p>",
              "</section>", _calls_html(data.trajs), "</body></html>"]
    return "".join(parts)


def write_report(run_dir: Path, processes: int = 1) -> Path:
    """Write `run_dir/plots/*.png` and `run_dir/report.html`; returns the HTML path. `processes=2` draws
    every other figure in a forked child (call it from a single-threaded process: runners/report_worker.py)."""
    data = load_report_data(Path(run_dir))
    plots = RunDir(data.run_dir).plots
    names = plot_names(data)
    if processes < 2 or len(names) < 2 or not hasattr(os, "fork"):
        pngs = save_plots(build_plots(data, names), plots)
    else:
        theirs, mine = names[::2], names[1::2]
        pid = os.fork()
        if pid == 0:  # the child: its figures to files, then out without running the parent's cleanup
            code = 1
            try:
                save_plots(build_plots(data, theirs), plots)
                code = 0
            finally:
                os._exit(code)
        pngs = save_plots(build_plots(data, mine), plots)
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
            raise RuntimeError(f"the process drawing {', '.join(theirs)} failed")
        pngs |= {name: (plots / f"{name}.png").read_bytes() for name in theirs}
        pngs = {name: pngs[name] for name in names}
    out = RunDir(data.run_dir).report_html
    out.write_text(redact(render_html(data, pngs)))  # episode text may quote a credential
    return out
