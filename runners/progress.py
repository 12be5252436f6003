"""Console progress for long commands: rich bars on a terminal, plain lines otherwise."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rollway.base.run_dir import RunDir
from rollway.topics.topology import STAGE_NAMES

STAGE_ORDER = STAGE_NAMES
STALE_STATUS_S = 10.0
"""A worker whose status file is older than this is gone; its in-flight count no longer counts."""


class ProgressDisplay:
    """A reusable progress view for any command (up, eval, bench, tasks build): one bar with a line
    of text plus optional extra rows. On a terminal it is a live rich display; otherwise a plain
    line at most every `every_s` seconds (and a last one on close), so logs stay readable."""

    def __init__(self, title: str, every_s: float = 3.0, enabled: bool = True, stream: TextIO | None = None):
        self.title = title
        self.every_s = every_s
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last_print = 0.0
        self.last_line = self.printed_line = ""
        self._live = self._bar = self._task = None

    def update(self, done: int, total: int | None, text: str, rows: dict[str, str] | None = None) -> None:
        """Show `done` of `total` (None: unknown) with `text`; `rows` are extra labelled lines."""
        if not self.enabled:
            return
        if self.tty:
            self._update_live(done, total, text, rows or {})
            return
        extra = "".join(f" | {k}: {v}" for k, v in (rows or {}).items())
        self.last_line = f"{self.title} {done}/{total if total is not None else '?'} {text}{extra}"
        if time.monotonic() - self.last_print >= self.every_s:
            self._print_line()

    def _print_line(self) -> None:
        print(f"rollway: {self.last_line}", file=self.stream, flush=True)
        self.last_print = time.monotonic()
        self.printed_line = self.last_line

    def _update_live(self, done: int, total: int | None, text: str, rows: dict[str, str]) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        if self._live is None:
            self._bar = RichProgress(TextColumn(f"[bold]{self.title}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), auto_refresh=False)
            self._task = self._bar.add_task("", total=total)
            self._live = Live(console=Console(file=self.stream), refresh_per_second=4)
            self._live.start()
        self._bar.update(self._task, completed=done, total=total)
        # The text goes on its own line: beside the bar a long text would squeeze the bar away.
        self._live.update(Group(self._bar, _rows_table({"": text, **rows})))

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        elif self.enabled and self.last_line != self.printed_line and not self.tty:
            self._print_line()  # the final state, even if the last periodic line was recent


def _rows_table(rows: dict[str, str]) -> Any:
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    for label, value in rows.items():
        table.add_row(f"  [cyan]{label}", value)
    return table


class RewardTail:
    """Reads `trajectories.jsonl` incrementally (only the new bytes each call): reward so far."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.episodes = 0
        self.reward_sum = 0.0
        self.resolved = 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                t = json.loads(line) if line.strip() else None
            except ValueError:
                continue  # a torn line (its writer was killed): the sink writes the episode again
            if isinstance(t, dict):
                self.episodes += 1
                self.reward_sum += float(t.get("reward", 0.0))
                self.resolved += bool(t.get("resolved"))

    def text(self) -> str:
        if not self.episodes:
            return "reward -"
        return f"reward {self.reward_sum / self.episodes:.3f}, pass {self.resolved / self.episodes:.0%}"


def stage_counts(run_dir: RunDir, now: float | None = None) -> dict[str, dict[str, int]]:
    """Per stage, summed over its workers' status files: handled, in_flight, dead_lettered, workers."""
    now = now or time.time()
    out: dict[str, dict[str, int]] = {}
    for path, st in run_dir.worker_statuses():
        c = out.setdefault(st.get("stage", path.stem.rsplit("-", 1)[0]),
                           {"handled": 0, "in_flight": 0, "dead_lettered": 0, "workers": 0})
        c["handled"] += st.get("handled", 0)
        c["dead_lettered"] += st.get("dead_lettered", 0)
        if now - st.get("updated_at", 0.0) < STALE_STATUS_S:
            c["in_flight"] += st.get("in_flight", 0) + st.get("backlog", 0)
            c["workers"] += 1
    return dict(sorted(out.items(), key=lambda kv: STAGE_ORDER.index(kv[0]) if kv[0] in STAGE_ORDER else 99))


def stage_row(c: dict[str, int]) -> str:
    workers = f", {c['workers']} workers" if c["workers"] > 1 else ""
    dead = f", {c['dead_lettered']} dead-lettered" if c["dead_lettered"] else ""
    return f"{c['handled']} handled, {c['in_flight']} in flight{workers}{dead}"


class Progress:
    """`rollway up`'s progress: episodes done/planned, in flight, throughput, reward so far, and the
    messages each stage has handled (from the workers' `status/*.json` in the run folder)."""

    def __init__(self, every_s: float = 3.0, enabled: bool = True, run_dir: Path | None = None,
                 stream: TextIO | None = None):
        self.display = ProgressDisplay("episodes", every_s=every_s, enabled=enabled, stream=stream)
        self.run_dir = run_dir
        self.rewards = RewardTail(RunDir(run_dir).trajectories) if run_dir is not None else None
        self.started = time.monotonic()

    def line(self, sched: dict, sink: dict) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        done = sched.get("episodes_completed", 0)
        parts = [f"{sched.get('episodes_inflight', 0)} in flight", f"{sched.get('episodes_failed', 0)} failed",
                 f"{sink.get('episodes_written', 0)} written", f"{done / elapsed:.2f} ep/s"]
        if self.rewards is not None:
            self.rewards.poll()
            parts.append(self.rewards.text())
        return ", ".join(parts)

    def update(self, sched: dict, sink: dict) -> None:
        if not sched:
            return
        rows = {}
        if self.run_dir is not None:
            # The scheduler's "handled" counts outcomes it read, not work: the episode counts cover it.
            rows = {stage: stage_row(c) for stage, c in stage_counts(RunDir(self.run_dir)).items()
                    if stage != "scheduler"}
        done = sched.get("episodes_completed", 0) + sched.get("episodes_failed", 0)
        self.display.update(done, sched.get("episodes_planned") or None, self.line(sched, sink), rows)

    def close(self) -> None:
        self.display.close()
