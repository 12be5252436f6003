"""The run folder's layout in one place: the status files the stages write and `rollway up`, the
progress display and the benchmarks read, per-worker status files, logs and outputs."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from rollway.base.files import write_json_atomic

log = structlog.get_logger()

TRAJECTORIES_FILE = "trajectories.jsonl"
"""One JSON line per episode, appended by the sink (actors/sink.py)."""
FAILURES_FILE = "failures.jsonl"
"""One JSON line per distinct episode failure, appended by the sink."""


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSON-lines file the stages append to, read one line at a time. A line that
    does not parse (a writer killed half way through it) is skipped with a warning naming it, never
    a crash: one torn line must not make the whole run unreadable. Nothing when the file is absent."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                log.warning("torn line skipped (a writer was killed while writing it)", file=str(path),
                            line=number, length=len(line))
                continue
            if isinstance(row, dict):
                yield row
            else:
                log.warning("line skipped: not a JSON object", file=str(path), line=number)


def read_trajectories(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of `run_dir/trajectories.jsonl` as written (torn lines skipped), in file order: the one
    reader of run folders' trajectories. A row of another schema version is refused (DecodeError with
    what to do), never read as if it were this version."""
    return read_records(RunDir(run_dir).trajectories)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The message rows of a JSON-lines file (trajectories, eval outputs), schema version checked."""
    from rollway.schemas.codec import check_version

    return [check_version(row, f"{path} row {i}") for i, row in enumerate(iter_jsonl(path), 1)]


def fresh_run_folder(prefix: str, root: str | Path = "runs") -> Path:
    """A new folder `root/prefix-<date>-<time>`, created here: two commands started in the same
    second get `-2`, `-3`... instead of sharing one (they wrote over each other's plans)."""
    stem = Path(root) / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder name under {stem}")


def worker_name(pid: int | None = None) -> str:
    """A process's name in the run folder's per-process files: its host's name and its id (this process's
    when `pid` is None). The id alone is not enough: stage processes on several hosts, or in containers
    (compose: every stage is pid 1), share one run folder."""
    return f"{socket.gethostname()}.{os.getpid() if pid is None else pid}"


class RunDir:
    """One run folder. Status is plain JSON written atomically (a reader never sees half a file) by
    the one worker that owns it: the scheduler, the sink, the learner, and each worker its own."""

    SCHEDULER_STATUS = "scheduler.json"
    """Episodes planned, scheduled, completed, failed; `done` once the scheduler has finished."""
    SINK_STATUS = "sink-status.json"
    """Episodes the sink has written."""
    LEARNER_STATUS = "learner-status.json"
    """The learner's version, steps and whether an update is running (`training`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self, name: str) -> dict[str, Any]:
        """A status file's content; {} when it does not exist yet (or is being replaced)."""
        try:
            return json.loads((self.path / name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def write(self, name: str, data: dict[str, Any], indent: int | None = None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / name, data, indent=indent)

    def scheduler(self) -> dict[str, Any]:
        return self.read(self.SCHEDULER_STATUS)

    def sink(self) -> dict[str, Any]:
        return self.read(self.SINK_STATUS)

    def learner(self) -> dict[str, Any]:
        return self.read(self.LEARNER_STATUS)

    @property
    def worker_status_dir(self) -> Path:
        return self.path / "status"

    def worker_status_path(self, stage: str, worker: str) -> Path:
        """Where one worker process (`worker_name`) writes its own status (partitions, messages handled)."""
        return self.worker_status_dir / f"{stage}-{worker}.json"

    def worker_statuses(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        """Every worker's status file and what it holds (each worker rewrites its own every few seconds and
        when it stops); one replaced between listing and reading, or not a status, is left out."""
        for path in sorted(self.worker_status_dir.glob("*.json")) if self.worker_status_dir.is_dir() else []:
            try:
                status = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(status, dict):
                yield path, status

    def dead_letters(self) -> int:
        """Messages dead-lettered so far by the stage workers of this run folder (their status files)."""
        return sum(int(status.get("dead_lettered", 0)) for _, status in self.worker_statuses())

    def worker_status(self, stage: str, worker: str) -> dict[str, Any]:
        return self.read(str(self.worker_status_path(stage, worker).relative_to(self.path)))

    @property
    def start_gate(self) -> Path:
        """Created by `rollway up` once every worker it started owns partitions; a scheduler started with
        ROLLWAY_START_GATE naming it issues no episode before it exists (it plans and scans meanwhile)."""
        return self.worker_status_dir / "start-gate"

    @property
    def telemetry_dir(self) -> Path:
        return self.path / "telemetry"

    def telemetry_path(self, stage: str, worker: str) -> Path:
        """Where one worker process (`worker_name`) records every message it handled (runtime/telemetry.py)."""
        return self.telemetry_dir / f"{stage}-{worker}.jsonl"

    @property
    def prometheus_dir(self) -> Path:
        """Prometheus' view of the run: `prometheus.yml`, the alert rules it loads, the targets it scrapes."""
        return self.path / "prometheus"

    @property
    def prometheus_config(self) -> Path:
        """The scrape configuration `rollway up` writes (runtime/metrics.py: write_scrape_config)."""
        return self.prometheus_dir / "prometheus.yml"

    @property
    def metrics_targets(self) -> Path:
        """One file per process serving /metrics (Prometheus file service discovery format)."""
        return self.prometheus_dir / "targets"

    def metrics_target(self, name: str) -> Path:
        """Where a process (`worker_name`) or a launched engine (`engine-N`) announces its /metrics address;
        removed when it stops cleanly."""
        return self.metrics_targets / f"{name}.json"

    def sub(self, name: str) -> RunDir:
        """A run folder inside this one: verify's `gold` and `nothing` runs, bench learn's
        `before`, `train` and `after`, a benchmark's per-mode runs."""
        return RunDir(self.path / name)

    # -- what the stages write
    @property
    def trajectories(self) -> Path:
        """One JSON line per finished episode: appended by the sink (actors/sink.py) and verify; read
        through `read_trajectories` (show, eval, report, benchmarks) and by the progress display."""
        return self.path / TRAJECTORIES_FILE

    @property
    def failures(self) -> Path:
        """One JSON line per distinct episode failure: appended by the sink; read by `rollway eval`."""
        return self.path / FAILURES_FILE

    @property
    def metrics(self) -> Path:
        """One JSON line per learner step: appended by learning/metrics.py; read by `rollway report`."""
        return self.path / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files, written by learning/metrics.py when TensorBoard is installed."""
        return self.path / "tb"

    @property
    def checkpoints(self) -> Path:
        """The learner's checkpoints (learning/checkpoint.py writes them); `rollway up` resumes from the
        newest and bench learn evaluates it."""
        return self.path / "checkpoints"

    # -- what `rollway up` and the other commands write
    @property
    def config(self) -> Path:
        """The resolved run config, secrets masked: written by `rollway up` before any stage starts;
        read by `rollway replay --run-dir` to find the topics."""
        return self.path / "config.json"

    @property
    def stage_config(self) -> Path:
        """The config `rollway up` hands every stage process (`rollway stage --config`)."""
        return self.path / "stage-config.json"

    @property
    def summary(self) -> Path:
        """The run's figures, written by `rollway up` at the end; read by `rollway report`, bench learn,
        and by `rollway up`, which refuses to start over a finished run."""
        return self.path / "summary.json"

    @property
    def job_failed(self) -> Path:
        """Why the job did not run to completion (run.timeout_s, a stage that cannot run): written by
        `rollway up` when it ends that way, instead of a summary."""
        return self.path / "job-failed.json"

    @property
    def eval_result(self) -> Path:
        """`rollway eval`'s pass rates; read by bench learn."""
        return self.path / "eval.json"

    @property
    def chaos_result(self) -> Path:
        """`rollway chaos`'s kills and what survived them."""
        return self.path / "chaos.json"

    @property
    def faults_state(self) -> Path:
        """`rollway chaos`: where fault points marked `once` record that they fired (base/faults.py),
        so a restarted worker does not fail at the same point again."""
        return self.path / "faults"

    @property
    def predictions(self) -> Path:
        """SWE-bench predictions (one JSON line per instance), written by reports/eval_outputs.py."""
        return self.path / "predictions.jsonl"

    @property
    def swebench_report(self) -> Path:
        """The SWE-bench-style report, written by reports/eval_outputs.py."""
        return self.path / "swebench_report.json"

    @property
    def atif(self) -> Path:
        """One ATIF trajectory file per episode, written by reports/eval_outputs.py."""
        return self.path / "atif"

    @property
    def report_html(self) -> Path:
        """`rollway report`'s page; its images go to `plots`."""
        return self.path / "report.html"

    @property
    def plots(self) -> Path:
        return self.path / "plots"

    @property
    def sandboxes(self) -> Path:
        """Where the benchmarks' local sandboxes live (their config's sandbox root)."""
        return self.path / "sandboxes"

    @property
    def run_config_yaml(self) -> Path:
        """The run config a benchmark writes and loads for one of its runs."""
        return self.path / "config.yaml"

    # -- logs
    @property
    def logs(self) -> Path:
        """Every process's log: stage workers, the broker, engines, structlog's JSON lines."""
        return self.path / "logs"

    def stage_log(self, stage: str, index: int) -> Path:
        """A stage worker's stdout and stderr (redacted), written by the launcher for `rollway up`."""
        return self.logs / f"{stage}-{index}.out"

    @property
    def broker_log(self) -> Path:
        """The embedded broker's output, when a command started one for this run."""
        return self.logs / "broker.out"

    @property
    def report_log(self) -> Path:
        """The output of the process that draws `rollway up`'s report (runners/report_worker.py)."""
        return self.logs / "report.out"

    def json_log(self, stage: str) -> Path:
        """structlog's JSON lines of one process (base/logging.py)."""
        return self.logs / f"{stage}.jsonl"
