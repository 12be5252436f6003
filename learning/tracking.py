"""Experiment trackers (`tracking.trackers`: console, tensorboard, wandb, mlflow, or a `python:MODULE:CLASS`
plugin): the learner logs each policy update's figures, what the episodes it received show (pass rate per
task source, graded failures by kind, suspected reward hacks), a table of sample trajectories every
`tracking.samples_every` updates, and the run's configuration to them; `rollway eval` logs pass@k.

A tracker never stops or slows training: the learner only puts records on a bounded queue; one background
thread hands them to the trackers. A tracker that fails (server down, disk full) is warned about and retried
with back-off; what it could not take is kept (bounded) and sent when it recovers, and what is still unsent
when the run ends is written to the run folder (`tracking-unsent/NAME.jsonl`)."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog
from pydantic import Field, field_validator, model_validator

from rollway.base.config import StrictModel
from rollway.base.plugins import is_plugin, load_plugin

if TYPE_CHECKING:
    from rollway.schemas.messages import Trajectory

log = structlog.get_logger()

Rows = list[dict[str, Any]]
Record = tuple[int, dict[str, float], tuple[str, Rows] | None]
"""(step, figures, table): a table record (name, rows) has no figures."""

PENDING_LIMIT = 10_000
"""Records kept per failing tracker; older ones go to the run folder's unsent file first."""
BACKOFF_S = (1.0, 60.0)
"""First and longest wait before a failed tracker is tried again (doubling in between)."""


class TrackerRun(StrictModel):
    """What a tracker is started with."""

    run_dir: str
    name: str
    """The run's name (run.name) and id: the tracker run's display name."""
    run_id: str | None = None
    tracker_id: str
    """A stable id for the tracker run, kept in the run folder (`tracking.json`): a resumed run continues the
    same tracker run."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The run's resolved configuration, secrets masked."""
    project: str
    wandb_mode: Literal["offline", "online"] = "offline"
    mlflow_uri: str | None = None


class Tracker(ABC):
    """One experiment tracker. Its methods run on the tracking thread, never on the learner's; an exception
    is reported and the call is retried later with the same record."""

    requires: str | None = None
    """The PyPI package the tracker needs; `rollway up` refuses to start without it, naming it."""

    @abstractmethod
    def start(self, run: TrackerRun) -> None:
        """Open (or resume) the tracker run and record `run.config`."""

    @abstractmethod
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One policy update's figures at learner step `step`."""

    def table(self, step: int, name: str, rows: Rows) -> None:
        """A table at step `step` (rows with the same keys: sample trajectories). Default: not kept."""

    def close(self) -> None:
        """Flush and finish the tracker run (the learner is stopping)."""


class ConsoleTracker(Tracker):
    """One log line per update with the headline figures."""

    KEYS = ("reward_mean", "pass_rate", "loss", "kl", "entropy", "grad_norm", "tokens_per_second", "policy_version")

    def start(self, run: TrackerRun) -> None:
        log.info("tracking run", name=run.name, tracker_id=run.tracker_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        log.info("update", step=step, **{k: round(metrics[k], 4) for k in self.KEYS if k in metrics})

    def table(self, step: int, name: str, rows: Rows) -> None:
        for row in rows:
            log.info(name, step=step, **{k: str(v)[:200] for k, v in row.items()})


class TensorBoardTracker(Tracker):
    """Scalars under `train/` in the run folder's TensorBoard folder (`tb/tracking`)."""

    requires = "tensorboard"

    def start(self, run: TrackerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run.run_dir) / "tb" / "tracking"))
        self.writer.add_text("config", f"```json\n{json.dumps(run.config, indent=1)}\n```", 0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(f"train/{name}", value, step)
        self.writer.flush()

    def table(self, step: int, name: str, rows: Rows) -> None:
        """A markdown table in TensorBoard's text tab."""
        cols = list(rows[0])
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        self.writer.add_text(name, "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """Weights & Biases: offline files in the run folder (`wandb/`; `wandb sync` uploads them), or online
    (`tracking.wandb_mode: online` and WANDB_API_KEY set)."""

    requires = "wandb"

    def start(self, run: TrackerRun) -> None:
        import wandb

        self.run = wandb.init(project=run.project, name=run.name, id=run.tracker_id, resume="allow",
                              dir=run.run_dir, mode=run.wandb_mode, config=run.config,
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def table(self, step: int, name: str, rows: Rows) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """MLflow through its client (no process-global active run): experiment `tracking.project`, one MLflow run
    per rollway run, the config as parameters (flattened, dotted keys)."""

    requires = "mlflow"

    def start(self, run: TrackerRun) -> None:
        # rollway retries with its own back-off; MLflow's (7 retries, growing waits) would hold the queue minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=run.mlflow_uri)
        experiment = self.client.get_experiment_by_name(run.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(run.project)
        found = self.client.search_runs([experiment_id], f"tags.rollway_tracker_id = '{run.tracker_id}'")
        if found:  # a resumed run: the same MLflow run
            self.run_id = found[0].info.run_id
            return
        self.run_id = self.client.create_run(experiment_id, run_name=run.name,
                                             tags={"rollway_tracker_id": run.tracker_id}).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(run.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def table(self, step: int, name: str, rows: Rows) -> None:
        """An artifact `NAME/step-STEP.json` in MLflow's table format (columns and data; `log_table` would need pandas)."""
        columns = list(rows[0])
        self.client.log_text(self.run_id, json.dumps({"columns": columns, "data": [[r[c] for c in columns] for r in rows]}),
                             f"{name}/step-{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, type[Tracker]] = {"console": ConsoleTracker, "tensorboard": TensorBoardTracker,
                                      "wandb": WandbTracker, "mlflow": MlflowTracker}


def tracker_class(name: str) -> type[Tracker]:
    if is_plugin(name):
        return load_plugin(name, Tracker)
    return TRACKERS[name]


class TrackingConfig(StrictModel):
    """Experiment trackers the learner logs to (learning/tracking.py, docs/observability.md)."""

    trackers: list[str] = Field(default_factory=list)
    """Trackers by name: `console`, `tensorboard`, `wandb`, `mlflow`, or a plugin `python:MODULE:CLASS` (a
    learning.tracking.Tracker subclass). Each needs its package installed (`pip install 'rollway[wandb]'`,
    `'rollway[mlflow]'`); a missing one stops `rollway up` at start-up, naming it."""
    project: str = "rollway"
    """The W&B project and the MLflow experiment."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline` writes W&B's files into the run folder (`wandb sync RUN/wandb/offline-run-*` uploads them);
    `online` sends them as they come (needs WANDB_API_KEY)."""
    mlflow_uri: str | None = None
    """MLflow tracking server, e.g. http://127.0.0.1:5000 (None: MLFLOW_TRACKING_URI, else MLflow's local store
    `sqlite:///mlflow.db` in the working folder, which needs the full `mlflow` package, not only `rollway[mlflow]`'s client)."""
    samples_every: int = Field(10, ge=0)
    """Every this many policy updates, a table of sample trajectories (task, prompt, the model's actions,
    reward) goes to the trackers as `samples`; 0: never."""
    samples: int = Field(4, ge=1)
    """Rows of that table: the episodes the learner received last."""
    queue_size: int = Field(10_000, ge=1)
    """Records waiting for the tracking thread at most; beyond it a record goes to the run folder's unsent file
    instead (the learner never waits)."""

    @field_validator("trackers")
    @classmethod
    def _installed(cls, names: list[str]) -> list[str]:
        for name in names:
            if not is_plugin(name) and name not in TRACKERS:
                raise ValueError(f"unknown tracker {name!r}: choose from {', '.join(TRACKERS)} or python:MODULE:CLASS")
            requires = tracker_class(name).requires
            if requires and importlib.util.find_spec(requires.replace("-", "_")) is None:
                raise ValueError(f"tracker {name!r} needs the `{requires}` package, which is not installed: "
                                 f"pip install {requires} (or pip install 'rollway[{requires}]'), or remove it "
                                 "from tracking.trackers")
        return names

    @model_validator(mode="after")
    def _mlflow_store(self) -> TrackingConfig:
        if ("mlflow" in self.trackers and not (self.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI"))
                and importlib.util.find_spec("sqlalchemy") is None):
            raise ValueError("tracker 'mlflow' without tracking.mlflow_uri writes MLflow's local store (sqlite:///mlflow.db), "
                             "which needs the full MLflow package (pip install mlflow); or set tracking.mlflow_uri to your "
                             "tracking server")
        return self


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class _Sink:
    """One tracker with its own queue and thread (a hanging tracker holds up no other), pending records and
    back-off."""

    def __init__(self, name: str, tracker: Tracker, unsent: Path, run: TrackerRun, queue_size: int):
        self.name, self.tracker, self.unsent, self.run = name, tracker, unsent, run
        self.started = False
        self.pending: deque[Record] = deque()
        self.retry_at, self.backoff, self.failures = 0.0, BACKOFF_S[0], 0
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._work, name=f"rollway-tracking-{name}", daemon=True)
        self.thread.start()

    def put(self, record: Record) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.write_unsent([record])

    def _work(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=1.0)
            except queue.Empty:
                item = ()  # a retry round while records wait
            if item is None:
                self.finish()
                return
            self.offer(item or None)

    def offer(self, record: Record | None) -> None:
        if record is not None:
            self.pending.append(record)
            while len(self.pending) > PENDING_LIMIT:
                self.write_unsent([self.pending.popleft()])
        if time.monotonic() < self.retry_at or (self.started and not self.pending):
            return
        try:
            if not self.started:
                self.tracker.start(self.run)
                self.started = True
            while self.pending:
                step, figures, table = self.pending[0]
                if table:
                    self.tracker.table(step, *table)
                else:
                    self.tracker.log(step, figures)
                self.pending.popleft()
        except Exception as err:  # noqa: BLE001 - a tracker's failure must never reach the learner
            self.failures += 1
            log.warning("experiment tracker failed; training goes on, its records are kept and retried",
                        tracker=self.name, retry_in_s=self.backoff, waiting=len(self.pending),
                        error=f"{type(err).__name__}: {str(err)[:300]}")
            self.retry_at = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, BACKOFF_S[1])
            return
        self.backoff = BACKOFF_S[0]

    def finish(self) -> None:
        """Last try for what is pending and queued; the rest to the run folder; close the tracker."""
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item:
                self.pending.append(item)
        self.retry_at = 0.0
        self.offer(None)
        if self.pending:
            self.write_unsent(list(self.pending))
            log.warning("experiment tracker did not take every record; the rest are in the run folder",
                        tracker=self.name, unsent=len(self.pending), file=str(self.unsent))
            self.pending.clear()
        if self.started:
            try:
                self.tracker.close()
            except Exception as err:  # noqa: BLE001 - see offer
                log.warning("experiment tracker failed to close", tracker=self.name, error=str(err)[:300])

    def write_unsent(self, records: list[Record]) -> None:
        self.unsent.parent.mkdir(parents=True, exist_ok=True)
        with self.unsent.open("a") as f:
            for step, figures, table in records:
                f.write(json.dumps({"step": step, **figures} if table is None else
                                   {"step": step, "table": table[0], "rows": table[1]}) + "\n")


class EpisodeFigures:
    """What the learner's trackers show of the episodes themselves: pass rate per task source over the
    episodes received since the previous update (`pass_rate/SOURCE`), and since this learner started
    graded failures by kind (`failures/STAGE/KIND`, base/blame.py) and suspected reward hacks
    (envs/reach_check.py); the last episodes as sample rows."""

    PROMPT_CHARS, ACTIONS_CHARS = 2000, 4000

    def __init__(self, samples: int) -> None:
        self.window: list[tuple[str, bool]] = []
        self.failures: Counter[str] = Counter()
        self.hacks = 0
        self.samples: deque[dict[str, Any]] = deque(maxlen=samples)

    def add(self, traj: Trajectory) -> None:
        from rollway.base.blame import graded_failures
        from rollway.envs.reach_check import suspected_hacks
        from rollway.learning.passk import task_source

        self.window.append((task_source(traj.task_id), traj.resolved))
        self.failures.update(graded_failures([{"grade": traj.grade}]))
        self.hacks += suspected_hacks([{"grade": traj.grade}])
        prompt = next((m.get("content") for m in reversed(traj.messages) if m.get("role") == "user"), "")
        self.samples.append({
            "task_id": traj.task_id, "prompt": str(prompt)[:self.PROMPT_CHARS],
            "actions": "\n\n".join(t.assistant_text for t in traj.turns)[:self.ACTIONS_CHARS], "reward": traj.reward})

    def figures(self) -> dict[str, float]:
        by_source: dict[str, list[bool]] = {}
        for source, resolved in self.window:
            by_source.setdefault(source, []).append(resolved)
        self.window = []
        return {**{f"pass_rate/{s}": sum(v) / len(v) for s, v in sorted(by_source.items())},
                **{"failures/" + re.sub(r"[^\w.\-/]", "_", kind.replace(": ", "/")): n
                   for kind, n in self.failures.items()},
                "suspected_reward_hacks": self.hacks}


class TrackingHub:
    """The learner's handle on its trackers: `log` returns at once; each tracker's thread does its sending."""

    def __init__(self, cfg: TrackingConfig, run: TrackerRun):
        unsent = Path(run.run_dir) / "tracking-unsent"
        self.cfg, self.updates, self.episodes = cfg, 0, EpisodeFigures(cfg.samples)
        self.sinks = []
        for ref in cfg.trackers:
            name = ref.rpartition(":")[2]
            self.sinks.append(_Sink(name, tracker_class(ref)(), unsent / f"{name}.jsonl", run, cfg.queue_size))

    @classmethod
    def for_run(cls, cfg: TrackingConfig, run_dir: Path, name: str, run_id: str | None,
                config: dict[str, Any]) -> TrackingHub | None:
        """The hub of a run folder (None without trackers); the tracker id is kept in `tracking.json`."""
        if not cfg.trackers:
            return None
        state = Path(run_dir) / "tracking.json"
        try:
            tracker_id = json.loads(state.read_text())["tracker_id"]
        except (FileNotFoundError, ValueError, KeyError):
            tracker_id = (run_id or f"rollway-{int(time.time())}").replace("/", "-")
            state.parent.mkdir(parents=True, exist_ok=True)
            state.write_text(json.dumps({"tracker_id": tracker_id}))
        return cls(cfg, TrackerRun(run_dir=str(run_dir), name=name if not run_id else f"{name}-{run_id}",
                                   run_id=run_id, tracker_id=tracker_id, config=config, project=cfg.project,
                                   wandb_mode=cfg.wandb_mode, mlflow_uri=cfg.mlflow_uri))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Queue one update's numeric figures for every tracker; never blocks (a tracker's full queue sends
        the record to its unsent file)."""
        figures = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        for sink in self.sinks:
            sink.put((step, figures, None))

    def table(self, step: int, name: str, rows: Rows) -> None:
        """Queue a table (see `log`); an empty one is not sent."""
        for sink in self.sinks if rows else ():
            sink.put((step, {}, (name, rows)))

    def episode(self, traj: Trajectory) -> None:
        """A trajectory the learner received: counted into the next update's figures, kept as a sample."""
        self.episodes.add(traj)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One policy update: its figures with the episodes' (`EpisodeFigures`), and every
        `tracking.samples_every` updates the table of sample trajectories."""
        self.log(step, {**metrics, **self.episodes.figures()})
        self.updates += 1
        if self.cfg.samples_every and self.updates % self.cfg.samples_every == 0:
            self.table(step, "samples", list(self.episodes.samples))

    def close(self, timeout_s: float = 30.0) -> None:
        """Let every tracker send what it holds (bounded by `timeout_s` in all), write what is left to the run
        folder, finish the tracker runs. A tracker still hanging after that is left behind (a daemon thread)."""
        deadline = time.monotonic() + timeout_s
        for sink in self.sinks:
            try:
                sink.queue.put(None, timeout=max(0.01, deadline - time.monotonic()))
            except queue.Full:
                pass  # a tracker that hangs with a full queue: warned about below
        for sink in self.sinks:
            sink.thread.join(max(0.0, deadline - time.monotonic()))
            if sink.thread.is_alive():
                log.warning("experiment tracker still busy at shutdown; its remaining records may be lost",
                            tracker=sink.name, waited_s=timeout_s)
