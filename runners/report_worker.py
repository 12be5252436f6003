"""The process that draws `rollway up`'s report. Started with the job, it loads the plotting library on
another core while the stages run; told to draw once the run's files are final, it draws while the
supervisor stops the broker. A job that fails, or a supervisor that dies, closes its stdin first: it
exits without drawing. `python -m rollway.runners.report_worker RUN_DIR` (stdin: `draw`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import structlog

from rollway.base.process import Child
from rollway.base.run_dir import RunDir

DRAW = "draw"
WAIT_S = 120.0
"""Longest the supervisor waits for a drawing (a run with thousands of episodes draws in seconds)."""


class ReportWorker:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.child = Child([sys.executable, "-m", "rollway.runners.report_worker", str(self.run_dir)],
                           RunDir(self.run_dir).report_log, name="the report drawer", stdin_pipe=True)
        self.drawing = False

    def start(self) -> ReportWorker:
        self.child.start()
        return self

    def draw(self) -> None:
        """Ask for the report (the run's files are final); `finish` waits for it."""
        self.child.send(DRAW)
        self.drawing = True

    def finish(self) -> None:
        """Wait for a requested report and log where it is (or why not; the run's results stand either
        way: `rollway report DIR` draws it again); without a request, stop the process."""
        log = structlog.get_logger()
        if not self.drawing:
            self.child.stop(grace_s=2)
            return
        try:
            code = self.child.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.child.stop(grace_s=2)
            code = None
        path = RunDir(self.run_dir).report_html
        if code == 0:
            log.info("report written", path=str(path))
            return
        from rollway.runners.up import log_tail

        log.warning("report not written; retry with `rollway report DIR`", run_dir=str(self.run_dir),
                    error=f"exit {code}: {log_tail(self.child.log_path, 3)}" if code is not None
                    else f"not drawn within {WAIT_S:.0f}s")


def main(argv: list[str]) -> int:
    from rollway.reports.report import warm_up, write_report

    warm_up()
    if sys.stdin.readline().strip() != DRAW:  # closed: the job failed, or its supervisor died
        return 0
    try:
        write_report(Path(argv[0]), processes=2)
    except Exception as err:  # noqa: BLE001 - reported by the supervisor, which reads this line
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips the interpreter's teardown of the plotting library (a quarter second here)
