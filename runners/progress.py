"""Console progress for long commands: a rich bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, every_s: float = 3.0, enabled: bool = True):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.every_s = every_s
        self.last = 0.0
        self.started = time.monotonic()
        self.bar = None
        self.task = None

    def _line(self, sched: dict, sink: dict) -> str:
        return (f"episodes {sched.get('episodes_completed', 0)}/{sched.get('episodes_planned', '?')} done, "
                f"{sched.get('episodes_inflight', 0)} in flight, {sched.get('episodes_failed', 0)} failed, "
                f"{sink.get('episodes_written', 0)} written, {time.monotonic() - self.started:.0f}s")

    def update(self, sched: dict, sink: dict) -> None:
        if not sched or not self.enabled:
            return
        if self.tty:
            self._update_bar(sched, sink)
        elif time.monotonic() - self.last >= self.every_s:
            print(f"rollway: {self._line(sched, sink)}", file=sys.stderr, flush=True)
            self.last = time.monotonic()

    def _update_bar(self, sched: dict, sink: dict) -> None:
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        if self.bar is None:
            self.bar = RichProgress(TextColumn("[bold]episodes"), BarColumn(), TextColumn("{task.description}"),
                                    TimeElapsedColumn(), transient=False)
            self.bar.start()
            self.task = self.bar.add_task("", total=sched.get("episodes_planned") or None)
        done = sched.get("episodes_completed", 0) + sched.get("episodes_failed", 0)
        self.bar.update(self.task, completed=done, description=self._line(sched, sink))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
