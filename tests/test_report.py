"""The run report of a real smoke run, opened in headless Chromium; progress and log lines of `up`."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from jobs import run_with_progress

pytestmark = pytest.mark.e2e
SECTIONS = ("summary", "reward", "timeline", "inference", "tools", "stop_reasons", "episodes")


def chromium_screenshot(html_path, out_png, tmp_path) -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed: run `make setup` (scripts/setup.sh installs it with apt)"
    proc = run_with_progress(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
         "--force-device-scale-factor=1", f"--user-data-dir={tmp_path / 'chromium-profile'}",
         f"--screenshot={out_png}", "--window-size=1400,3000", f"file://{html_path}"])
    assert out_png.exists(), f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"


def find_image(screen, image) -> tuple[int, int] | None:
    """Where `image` (an H x W x 3 array) appears pixel for pixel in `screen`: (top, left), or None. It is
    located by its busiest row, then compared whole, so a partly drawn or different image is not found."""
    import numpy as np

    busiest = int(np.argmax((image != 255).any(axis=2).sum(axis=1)))
    pattern, (height, width) = image[busiest].tobytes(), image.shape[:2]
    for y in range(busiest, screen.shape[0] - (height - busiest) + 1):
        row, start = screen[y].tobytes(), 0
        while (i := row.find(pattern, start)) >= 0:
            top, left = y - busiest, i // 3
            if i % 3 == 0 and np.array_equal(screen[top:top + height, left:left + width], image):
                return top, left
            start = i + 1
    return None


def test_report_html_shows_curves_and_timeline_in_chromium(smoke_run, tmp_path):
    """Chromium draws every inlined plot of the report pixel for pixel (no colour-share threshold: a plot
    is found whole or the test fails naming it)."""
    import numpy as np
    from PIL import Image

    report = smoke_run.run_dir / "report.html"
    html = report.read_text()
    for section in SECTIONS:
        assert f"<section id='{section}'>" in html, section
    assert html.count("data:image/png;base64,") == 5  # no learner metrics in the smoke run
    assert not re.search(r"""(src|href)=['"]?(https?:|//)""", html), "the report must not load external assets"

    shot = tmp_path / "report.png"
    chromium_screenshot(report, shot, tmp_path)
    screen = np.asarray(Image.open(shot).convert("RGB"))
    assert screen.shape == (3000, 1400, 3)
    tops = {}
    for name in ("reward", "timeline", "inference", "tools", "stop_reasons"):
        plot = np.asarray(Image.open(smoke_run.run_dir / "plots" / f"{name}.png").convert("RGB"))
        assert (plot != 255).any(axis=2).mean() > 0.02, f"plots/{name}.png is nearly blank"
        where = find_image(screen, plot)
        assert where, f"the {name} plot is not drawn in the screenshot of report.html"
        tops[name] = where[0]
    assert list(tops) == sorted(tops, key=tops.get), f"plots out of the report's order: {tops}"


def test_reward_curve_stays_visible_under_a_coinciding_pass_rate():
    """With 0/1 rewards the reward's running mean equals the pass rate's: the reward line (blue) must stay
    visible where the pass-rate line (red) is drawn over it. Rendering is deterministic (Agg), so the
    share of the blue line left visible is a fixed number: 0 when the red line hides it."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from rollway.reports.report import plot_reward_curve, running_mean

    trajs = [{"reward": float(r), "resolved": bool(r)} for r in (1, 0, 1, 1, 0, 1, 1, 1)]
    fig = plot_reward_curve(trajs)
    FigureCanvasAgg(fig)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    reward, passed = lines["reward (running mean)"], lines["pass rate (running)"]
    assert list(reward.get_ydata()) == list(passed.get_ydata()) == running_mean([float(r["reward"]) for r in trajs])
    for artist in [*ax.collections, ax.get_legend()]:  # count only the two lines' pixels
        artist.set_visible(False)

    def blue_pixels() -> int:
        fig.canvas.draw()
        rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
        return int((np.abs(rgb - [0x4C, 0x78, 0xA8]).max(axis=2) <= 12).sum())

    with_pass_rate = blue_pixels()
    passed.set_visible(False)
    alone = blue_pixels()
    assert alone > 500 and with_pass_rate / alone > 0.4, (with_pass_rate, alone)


def test_report_command_adds_learner_curves_and_handles_old_trajectories(smoke_run, tmp_path):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    lines = []
    for line in (smoke_run.run_dir / "trajectories.jsonl").read_text().splitlines():
        t = json.loads(line)  # copied without the run's telemetry, and per-turn times taken out
        for turn in t["turns"]:
            for key in ("gen_started_at", "gen_ended_at", "tool_ended_at"):
                turn.pop(key)
        lines.append(json.dumps(t))
    (run_dir / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": s / 4, "pass_rate": s / 5, "loss": 1 / s}) + "\n" for s in range(1, 5)))
    from rollway.runners.cli import main

    assert main(["report", str(run_dir)]) == 0
    html = (run_dir / "report.html").read_text()
    assert "<section id='learner'>" in html and "<section id='reward'>" in html
    assert "<section id='timeline'>" not in html  # no timestamps recorded: no timeline, no error
    assert (run_dir / "plots" / "learner.png").exists()


def test_utilisation_counts_overlapping_generations_once():
    from rollway.reports.report import busy_fraction, in_flight_steps

    assert busy_fraction([(0, 2), (1, 3), (5, 6)], 0, 10) == pytest.approx(0.4)
    assert busy_fraction([], 0, 10) == 0.0
    assert in_flight_steps([(0, 2), (1, 3)]) == ([0, 1, 2, 3], [1, 2, 1, 0])


def test_runtimes_record_each_stage_of_each_episode_once_in_order(smoke_run):
    """The telemetry the stage runtimes wrote: every message of every episode handled exactly once (no
    failures in the smoke run; the scheduler reads its reward request and its trajectory), stages in order,
    each turn's generation inside its agent handling."""
    from rollway.runtime.telemetry import attempt_records, read_telemetry

    telemetry = read_telemetry(smoke_run.run_dir)
    assert telemetry and all(r.produced_at <= r.started_at <= r.ended_at for r in telemetry)
    for line in (smoke_run.run_dir / "trajectories.jsonl").read_text().splitlines():
        t = json.loads(line)
        records = attempt_records(telemetry, t["episode"]["episode_id"], t["episode"]["attempt"])
        by_stage: dict[str, list] = {}
        for r in sorted(records, key=lambda r: r.started_at):
            assert r.outcome == "handled"
            by_stage.setdefault(r.stage, []).append(r)
        assert {s: len(v) for s, v in by_stage.items()} == {"init": 1, "agent": t["num_turns"], "reward": 1,
                                                            "scheduler": 2, "learner": 1, "sink": 1}
        [init], agent, [reward] = by_stage["init"], by_stage["agent"], by_stage["reward"]
        assert [r.turn for r in agent] == list(range(t["num_turns"]))
        assert init.ended_at <= agent[0].produced_at + 0.001 and agent[-1].ended_at <= reward.produced_at + 0.001
        for r, turn in zip(agent, t["turns"], strict=True):
            assert r.started_at <= turn["gen_started_at"] <= turn["gen_ended_at"] <= turn["tool_ended_at"] <= r.ended_at
        graded = [r for r in by_stage["scheduler"] if r.topic.endswith("trajectories")] + by_stage["learner"] + by_stage["sink"]
        assert len(graded) == 3 and reward.ended_at <= min(r.produced_at for r in graded) + 0.001
        [asked] = [r for r in by_stage["scheduler"] if r.topic.endswith("reward-requests")]
        assert (asked.offset, asked.partition) == (reward.offset, reward.partition)  # the same message as the reward stage's


def test_up_shows_progress_per_stage_and_logs_with_stage_and_episode(smoke_run):
    progress = [x for x in smoke_run.stderr.splitlines() if x.startswith("rollway: episodes")]
    assert progress, smoke_run.stderr[-2000:]
    last = progress[-1]
    assert "8/8" in last and "ep/s" in last and "reward 1.000" in last
    for stage in ("init", "agent", "reward"):
        assert re.search(rf"\| {stage}: \d+ handled, \d+ in flight", last), last
    assert "agent: 32 handled" in last
    assert "[up] run finished" in smoke_run.stderr and "report written" in smoke_run.stderr
    up_lines = [json.loads(x) for x in (smoke_run.run_dir / "logs" / "up.jsonl").read_text().splitlines()]
    assert {x["stage"] for x in up_lines} == {"up"}
    graded = [json.loads(x) for x in (smoke_run.run_dir / "logs" / "reward.jsonl").read_text().splitlines()
              if "episode graded" in x]
    assert len(graded) == 8 and all(x["stage"] == "reward" and x["episode_id"] for x in graded)
    assert "[reward r" in (smoke_run.run_dir / "logs" / "reward-0.out").read_text()
    status = {json.loads(p.read_text())["stage"]: json.loads(p.read_text())
              for p in (smoke_run.run_dir / "status").glob("*.json")}
    assert status["agent"]["handled"] == 32 and status["init"]["handled"] == 8


def test_progress_display_prints_plain_lines_when_not_a_terminal(tmp_path):
    import io

    from rollway.runners.progress import Progress

    (tmp_path / "status").mkdir()
    (tmp_path / "status" / "agent-1.json").write_text(json.dumps(
        {"stage": "agent", "handled": 5, "in_flight": 2, "backlog": 0, "dead_lettered": 1, "updated_at": 9e12}))
    (tmp_path / "trajectories.jsonl").write_text(json.dumps({"reward": 1.0, "resolved": True}) + "\n")
    stream = io.StringIO()
    p = Progress(every_s=0, run_dir=tmp_path, stream=stream)
    p.update({"episodes_completed": 1, "episodes_planned": 4, "episodes_inflight": 2}, {"episodes_written": 1})
    p.close()
    line = stream.getvalue().splitlines()[0]
    assert line.startswith("rollway: episodes 1/4") and "reward 1.000, pass 100%" in line
    assert "agent: 5 handled, 2 in flight, 1 dead-lettered" in line


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    """Two benchmarks started in one second once shared `runs/bench-training-<time>` and wrote over
    each other's plans file; each now claims its own folder."""
    from concurrent.futures import ThreadPoolExecutor

    from rollway.base.run_dir import fresh_run_folder

    with ThreadPoolExecutor(8) as pool:
        folders = list(pool.map(lambda _: fresh_run_folder("bench-training", tmp_path), range(8)))
    assert len(set(folders)) == 8 and all(f.is_dir() and f.parent == tmp_path for f in folders)
    assert all(f.name.startswith("bench-training-") for f in folders)
