"""`rollway up`: the whole job on one machine: broker, one process per stage, run to the end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from rollway.base.blame import graded_failures
from rollway.base.logging import redact_data, register_secrets
from rollway.base.process import Child
from rollway.base.run_dir import RunDir, read_trajectories, worker_name
from rollway.config.run import RunConfig, dump_config, secret_values, write_resolved_config
from rollway.envs.reach_check import suspected_hacks
from rollway.topics.topology import STAGE_NAMES as STAGES
from rollway.topics.topology import drain_stages, get_stage, issuing_stage, start_order

if TYPE_CHECKING:
    from rollway.policies.launch import LaunchedEngine
    from rollway.runners.local_stages import StageLoop

log = structlog.get_logger()

# Start order: consumers of the later topics first, the scheduler (which issues work) last.
START_ORDER = start_order()
ISSUER = issuing_stage().name
"""The stage that issues the work: it waits for the start gate, and its clean exit ends the run."""
DRAINS = tuple(s.name for s in drain_stages())
"""The stages the run waits for after its last outcome (the learner, the sink)."""
STAGE_TIME_KEYS = ("init_queue", "init", "agent_queue", "agent", "agent_gen", "agent_tool", "reward_queue", "reward")
"""`stage_seconds_total` in summary.json: STAGE (handling) and STAGE_queue (production to handling) from the
runtimes' telemetry, agent_gen and agent_tool (inside the agent's handling) from the turns."""


@dataclass
class StageProcess:
    stage: str
    index: int
    argv: list[str]
    log_path: Path
    proc: Child | None = None
    restarts: int = 0

    env: dict[str, str] | None = None
    secrets: dict[str, str] | None = None
    """Handed over a pipe at each start (`Child.secrets`), never in the worker's environment."""

    def start(self) -> None:
        # Output through the redactor: a traceback or a library's line that quotes a secret is masked.
        self.proc = Child(self.argv, self.log_path, self.env, name=f"stage {self.stage} worker {self.index}",
                          term_leader_only=True, secrets=self.secrets).start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive


@dataclass
class Job:
    """The processes of one `up` run."""

    cfg: RunConfig
    """The validated config; every stage process gets it as `stage_config_path` (no override strings)."""
    config_path: str
    """The config file the job was started from (for the record)."""
    overrides: list[str]
    """The overrides it was started with (for the record; already part of `cfg`)."""
    bootstrap: str
    run_dir: Path
    workers: dict[str, int]
    procs: list[StageProcess] = field(default_factory=list)
    max_restarts: int = 3
    engine: LaunchedEngine | None = None
    """The inference servers the job launched (policy.launch), restarted like workers when they die."""
    env: dict[str, str] | None = None
    """Extra environment of the stage processes (chaos runs arm fault points with it)."""
    secrets_env: dict[str, str] = field(default_factory=dict)
    """The config's secrets for the stage processes (`SECRETS_ENV`), set by `start`: handed over a pipe,
    never in argv, a file or a worker's environment block."""
    one_process: bool = False
    """Every stage as a task of this process (runners/local_stages.py) instead of a process per worker."""
    stage_loop: StageLoop | None = None

    @property
    def stage_config_path(self) -> Path:
        """The resolved config every stage process loads (written by `start`; it holds no secret)."""
        return RunDir(self.run_dir).stage_config

    def stage_argv(self, stage: str) -> list[str]:
        # learner=N: one learner process, rank 0 of N sharded ranks (it starts the others, learning/distributed.py)
        setting = get_stage(stage).ranks_setting
        ranks = [f"{setting}={self.workers[stage]}"] if setting and self.workers.get(stage, 1) > 1 else []
        return [sys.executable, "-m", "rollway.runners", "stage", stage, str(self.stage_config_path), *ranks,
                "--bootstrap", self.bootstrap, "--run-dir", str(self.run_dir)]

    def start(self) -> None:
        """Start every stage process at once. The scheduler plans, scans the log and joins its group
        meanwhile, but issues nothing until `open_start_gate` sees every other worker own partitions."""
        RunDir(self.run_dir).logs.mkdir(parents=True, exist_ok=True)
        self.secrets_env = write_resolved_config(self.cfg, self.stage_config_path)
        self._started_at = time.monotonic()
        if self.one_process:  # sole workers own their partitions at once: no start gate to wait for
            from rollway.runners.local_stages import LocalStage, StageLoop

            self.stage_loop = StageLoop()
            for stage in START_ORDER:
                p = LocalStage(stage, self.cfg, self.bootstrap, self.run_dir, self.stage_loop,
                               RunDir(self.run_dir).stage_log(stage, 0))
                p.start()
                self.procs.append(p)  # type: ignore[arg-type]
            return
        gate = RunDir(self.run_dir).start_gate
        gate.unlink(missing_ok=True)
        for stage in START_ORDER:
            gate_env = {"ROLLWAY_START_GATE": str(gate)} if stage == ISSUER else {}
            env = {**(self.env or {}), **gate_env} or None
            for i in range(1 if get_stage(stage).ranks_setting else self.workers.get(stage, 1)):
                p = StageProcess(stage, i, self.stage_argv(stage), RunDir(self.run_dir).stage_log(stage, i), env=env,
                                 secrets=self.secrets_env or None)
                p.start()
                self.procs.append(p)

    def open_start_gate(self, timeout_s: float = 30.0) -> bool:
        """Let the scheduler issue once every other worker owns partitions (its group has settled), so
        the first episodes neither wait for nor get moved by consumer-group joins; after timeout_s it
        opens anyway (the job still runs, only its start is slower). True once open."""
        gate = RunDir(self.run_dir).start_gate
        if self.one_process or gate.exists():
            return True
        status = [RunDir(self.run_dir).worker_status(p.stage, worker_name(p.proc.pid)) for p in self.procs if p.stage != ISSUER]
        if all(s.get("partitions", 0) > 0 for s in status) or time.monotonic() - self._started_at > timeout_s:
            gate.parent.mkdir(parents=True, exist_ok=True)
            gate.touch()
            return True
        return False

    _started_at: float = field(default=0.0, init=False)

    def scheduler_exit_code(self) -> int | None:
        """The scheduler's exit code once it ended for good: 0, or an error with no restart left."""
        sched = [p for p in self.procs if p.stage == ISSUER]
        if not sched:
            return None
        code = sched[0].proc.poll()
        return code if code == 0 or (code is not None and sched[0].restarts >= self.max_restarts) else None

    def wait_for_scheduler(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, returning early when a one-process job's scheduler ends (a process's
        end is seen at the next poll)."""
        sched = [p for p in self.procs if p.stage == ISSUER and p.alive]
        if self.one_process and sched:
            try:
                sched[0].wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
            return
        time.sleep(timeout_s)

    def restart_dead_workers(self) -> list[str]:
        """Restart crashed workers (the log keeps their work), up to max_restarts each. The scheduler
        counts as crashed only when it exited with an error: it exits 0 when the job is done."""
        notes = []
        for p in self.procs:
            crashed = not p.alive and (p.stage != ISSUER or p.proc.returncode != 0)
            if crashed and p.restarts < self.max_restarts:
                code = p.proc.returncode if p.proc else None
                if not self.one_process:  # its /metrics target reads as down until now; the restart announces its own
                    RunDir(self.run_dir).metrics_target(worker_name(p.proc.pid)).unlink(missing_ok=True)
                p.restarts += 1
                p.start()
                notes.append(f"{p.stage}-{p.index} exited (code {code}); restarted ({p.restarts}/{self.max_restarts})")
        if self.engine is not None:
            checkpoint = latest_weights(self.run_dir)
            notes += self.engine.restart_dead(checkpoint, checkpoint_version(checkpoint))
        return notes

    def given_up(self) -> str | None:
        """A message naming a stage none of whose workers is left (each crashed max_restarts times):
        the job can never finish, so it fails now instead of waiting for run.timeout_s."""
        for stage in {p.stage for p in self.procs}:
            procs = [p for p in self.procs if p.stage == stage]
            if any(p.alive or p.restarts < self.max_restarts or (p.stage == ISSUER and p.proc.returncode == 0)
                   for p in procs):
                continue
            last = procs[-1]
            return (f"stage {stage!r} cannot run: its worker exited {last.restarts + 1} times (code "
                    f"{last.proc.returncode}), the last time with:\n{log_tail(last.log_path)}\n"
                    f"(full log: {last.log_path})")
        return None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every worker at once (they stop in parallel), then each gets what is left of
        `timeout_s` before its process group is killed."""
        started = [p.proc for p in self.procs if p.proc is not None]
        for proc in started:
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in started:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.stage_loop is not None:
            self.stage_loop.close()


def log_tail(path: Path, lines: int = 12) -> str:
    """The last lines of a worker's log (its traceback, when it crashed)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def read_json(path: Path) -> dict:
    """A status file of a run folder ({} while absent); see RunDir."""
    return RunDir(path.parent).read(path.name)


def parse_workers(specs: list[str]) -> dict[str, int]:
    """`agent=2` -> {"agent": 2}; every stage defaults to one worker."""
    workers = {s: 1 for s in STAGES}
    for spec in specs:
        name, _, count = spec.partition("=")
        if name not in STAGES or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--workers {spec!r}: expected STAGE=N with STAGE in {', '.join(STAGES)} and N >= 1")
        if get_stage(name).single and not get_stage(name).ranks_setting and int(count) != 1:
            raise ValueError(f"--workers: the {name} runs as exactly one process")
        workers[name] = int(count)
    return workers


def summarize(run_dir: Path, cfg: RunConfig, wall_s: float, job: Job) -> dict:
    sched = RunDir(run_dir).scheduler()
    trajs = read_trajectories(run_dir)
    stage_totals = {k: round(v, 4) for k, v in stage_time_totals(run_dir, trajs).items()}
    rewards = [t["reward"] for t in trajs]
    stop_reasons: dict[str, int] = {}
    for t in trajs:
        stop_reasons[t["stop_reason"]] = stop_reasons.get(t["stop_reason"], 0) + 1
    return {
        "run_id": cfg.run.id, "run_dir": str(run_dir),
        "episodes_planned": sched.get("episodes_planned", 0),
        "episodes_scheduled": sched.get("episodes_scheduled", 0),
        "episodes_completed": sched.get("episodes_completed", 0),
        "episodes_failed": sched.get("episodes_failed", 0),
        "episodes_retried": sched.get("retries", 0),
        "trajectories_written": len(trajs),
        "reward_mean": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "pass_rate": round(sum(t["resolved"] for t in trajs) / len(trajs), 4) if trajs else None,
        "turns_mean": round(sum(t["num_turns"] for t in trajs) / len(trajs), 3) if trajs else None,
        "stop_reasons": stop_reasons,
        "graded_failures": graded_failures(trajs),
        "suspected_reward_hacks": suspected_hacks(trajs),
        "stage_seconds_total": stage_totals,
        "wall_seconds": round(wall_s, 3),
        "episodes_per_second": round(len(trajs) / wall_s, 4) if wall_s > 0 else None,
        "worker_restarts": {f"{p.stage}-{p.index}": p.restarts for p in job.procs if p.restarts},
        "failed": sched.get("failed", []),
        "failure_reasons": _count_reasons(sched.get("failed", [])),
    }


def _count_reasons(failed: list[dict]) -> dict[str, int]:
    """Episodes given up, by reason: a program that cannot work here shows as one line, not one per episode."""
    counts: dict[str, int] = {}
    for ticket in failed:
        counts[ticket.get("reason", "")] = counts.get(ticket.get("reason", ""), 0) + 1
    return counts


def stage_time_totals(run_dir: Path, trajs: list[dict]) -> dict[str, float]:
    """Seconds per STAGE_TIME_KEYS over the run's written episodes."""
    from rollway.runtime.telemetry import read_telemetry, stage_seconds

    stages = stage_seconds(read_telemetry(run_dir), {t["episode"]["episode_id"] for t in trajs})
    turns = [u for t in trajs for u in t.get("turns", [])]
    totals = {**stages, "agent_gen": sum(u.get("gen_seconds", 0.0) for u in turns),
              "agent_tool": sum(u.get("tool_seconds", 0.0) for u in turns)}
    return {k: totals.get(k, 0.0) for k in STAGE_TIME_KEYS}


def write_run_files(run_dir: Path, cfg: RunConfig) -> None:
    RunDir(run_dir).logs.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).config.write_text(json.dumps(dump_config(cfg), indent=1))
    if cfg.metrics.enabled:
        from rollway.runtime.metrics import write_scrape_config

        write_scrape_config(run_dir, cfg.metrics.scrape_interval_s)


class JobFailed(RuntimeError):
    """The job did not run to completion (timeout, scheduler crash); the message says where to look."""


def checkpoint_version(checkpoint: str | None) -> int:
    """The policy version a learner checkpoint folder holds (0 for none)."""
    if checkpoint is None:
        return 0
    from rollway.learning.checkpoint import load_state

    return load_state(Path(checkpoint)).version


def latest_weights(run_dir: Path) -> str | None:
    from rollway.learning.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    return str(ckpt) if ckpt is not None else None


def run_job(cfg: RunConfig, config_path: str, overrides: list[str], bootstrap: str, run_dir: Path,
            workers: dict[str, int], on_tick: Callable[[Job], None] | None = None, quiet: bool = False,
            max_restarts: int = 3, env: dict[str, str] | None = None, own_broker: bool = False) -> dict:
    """Start every stage (a process per worker, or all as tasks of this process: `one_process`), wait for
    the scheduler to finish and the sink/learner to catch up, stop the stages, write and return
    `summary.json`. Crashed workers are restarted. `own_broker`: the caller started the broker for this
    job alone (no worker elsewhere can join its groups), which `runtime.processes: auto` needs for one process."""
    from rollway.runtime.kafka import ensure_topics

    register_secrets(secret_values(cfg))
    one = one_process(cfg, workers, env, own_broker)
    if one or (not quiet and not structlog.is_configured()):
        from rollway.base.logging import configure_logging

        # callers other than `rollway up` (chaos) get the same lines; a one-process job's stages their own files
        configure_logging("up", run_dir, console=not quiet, local_stages=STAGES if one else ())
    asyncio.run(ensure_topics(cfg.broker, cfg.topics, bootstrap))
    from rollway.runners.tasks_formats import prebuild_at_start

    prebuild_at_start(cfg, quiet)  # task images (swebench, harbor) before any init slot could wait for one
    engine = None
    if cfg.policy.type == "openai" and cfg.policy.launch and not cfg.policy.base_url:
        from rollway.policies.launch import launch_engine

        try:
            engine = launch_engine(cfg.policy, RunDir(run_dir).logs)
        except (RuntimeError, TimeoutError) as err:
            raise JobFailed(f"the inference engine did not start: {err}") from err
        cfg = cfg.model_copy(update={"policy": cfg.policy.model_copy(update=engine.policy_settings())})
        register_secrets(secret_values(cfg))  # the engine's key, when the launch made one
    announced = []
    try:
        if engine is not None and engine.engine == "vllm" and cfg.metrics.enabled:
            from rollway.runtime.metrics import announce_engine

            announced = announce_engine(run_dir, [s.base_url for s in engine.servers], cfg.run.id)
        check_fleet(cfg)
        reap_sandboxes(cfg, "start")  # a resumed run folder: sandboxes of its killed workers
        if one and "fetch_max_wait_ms" not in cfg.broker.model_fields_set:
            from rollway.base.broker import ONE_PROCESS_FETCH_MAX_WAIT_MS

            broker = cfg.broker.model_copy(update={"fetch_max_wait_ms": ONE_PROCESS_FETCH_MAX_WAIT_MS})
            cfg = cfg.model_copy(update={"broker": broker})
        job = Job(cfg, config_path, overrides, bootstrap, run_dir, workers, max_restarts=max_restarts,
                  engine=engine, env=env, one_process=one)
        return _run_stages(job, on_tick, quiet)
    finally:
        if engine is not None:
            engine.stop()
        for target in announced:
            target.unlink(missing_ok=True)


def one_process(cfg: RunConfig, workers: dict[str, int], env: dict[str, str] | None, own_broker: bool) -> bool:
    """Whether a job runs its stages in this process (`runtime.processes`, see config/run.py). `auto` needs
    the job's own broker: on a shared one a `rollway stage` process started elsewhere could join a stage's
    group while its sole worker here reads every partition."""
    several = sorted(stage for stage, n in workers.items() if n > 1)
    faust = any(cfg.runtime.engine_for(stage) == "faust" for stage in STAGES)
    if cfg.runtime.processes == "one":
        if several:
            raise JobFailed(f"runtime.processes=one runs one worker per stage; --workers asks for more of "
                            f"{', '.join(several)} (use runtime.processes=per-stage or auto)")
        if env:
            raise JobFailed("runtime.processes=one cannot give stages their own environment (fault points); "
                            "use runtime.processes=per-stage")
        return True
    armed = bool(os.environ.get("ROLLWAY_FAULTS"))  # a fault point must kill a worker, not the whole job
    # A training learner holds a model, its gradients and its batches (GBs): in its own process running out
    # of memory ends the learner, which is restarted, not the whole job (a buglocal run was OOM-killed so).
    return (cfg.runtime.processes == "auto" and own_broker and not several and not faust and not env
            and not armed and not cfg.learner.trains)


def _run_stages(job: Job, on_tick, quiet: bool) -> dict:
    from rollway.runners.progress import Progress

    cfg, bootstrap, run_dir, workers = job.cfg, job.bootstrap, job.run_dir, job.workers
    t0 = time.monotonic()
    job.start()
    if not quiet:
        log.info("run started", run_id=cfg.run.id, bootstrap=bootstrap, run_dir=str(run_dir),
                 workers=",".join(f"{k}={v}" for k, v in workers.items()))
    progress = Progress(enabled=not quiet, run_dir=run_dir)
    try:
        while (code := job.scheduler_exit_code()) is None:
            gate_open = job.open_start_gate()
            if time.monotonic() - t0 > cfg.run.timeout_s:
                raise JobFailed(f"timed out after {cfg.run.timeout_s:.0f}s (run.timeout_s); see {RunDir(run_dir).logs}")
            for note in job.restart_dead_workers():
                log.warning("worker restarted", note=note)
            if (reason := job.given_up()) is not None:
                raise JobFailed(reason)
            if on_tick is not None:
                on_tick(job)
            progress.update(RunDir(run_dir).scheduler(), RunDir(run_dir).sink())
            job.wait_for_scheduler(0.25 if gate_open else 0.05)
        sched = RunDir(run_dir).scheduler()
        if code != 0 or not sched.get("done"):
            raise JobFailed(f"the scheduler exited with code {code}; see {RunDir(run_dir).stage_log('scheduler', 0)}")
        wait_for_consumers(run_dir, sched["episodes_completed"], job)
    except JobFailed as err:
        RunDir(run_dir).job_failed.write_text(json.dumps({"reason": str(err), "wall_seconds": round(
            time.monotonic() - t0, 1)}))
        raise
    finally:
        job.stop()  # workers write their final status files as they stop
        reaped = reap_sandboxes(cfg, "end")  # every episode is finished or unknown now
        progress.update(RunDir(run_dir).scheduler(), RunDir(run_dir).sink())
        progress.close()
    summary = summarize(run_dir, cfg, time.monotonic() - t0, job)
    summary["sandboxes_reaped"] = reaped
    RunDir(run_dir).summary.write_text(json.dumps(redact_data(summary), indent=1))
    if not quiet:
        log.info("run finished", **{k: summary[k] for k in ("episodes_completed", "episodes_failed", "reward_mean",
                                                            "pass_rate", "wall_seconds")})
        for reason, count in summary["failure_reasons"].items():
            log.error(f"{count} episode(s) failed: {reason[:500]}")
        for kind, count in summary["graded_failures"].items():  # the agent's (base/blame.py), or a setup's error
            log.warning(f"{count} episode(s) graded 0 for a failure after the agent ran ({kind}): see the stage's log")
    return summary


def check_fleet(cfg: RunConfig) -> None:
    """A fleet of Docker engines (sandbox.engines beyond the local default): say which engines do not
    answer and start with the rest; refuse the run when none does."""
    engines = getattr(cfg.sandbox, "engines", None)
    if cfg.sandbox.type != "docker" or not engines or (len(engines) == 1 and engines[0].endpoint is None):
        return
    from rollway.sandboxes.base import EngineUnreachable
    from rollway.sandboxes.fleet import check_engines

    try:
        down = check_engines(cfg.sandbox)  # type: ignore[arg-type]
    except EngineUnreachable as err:
        raise JobFailed(f"{err}; start the engines (scripts/fleet-up.sh on one host, docs/deployment.md)") from err
    for engine_id, reason in down.items():
        log.warning(f"sandbox engine {engine_id} does not answer; the run starts with the others", reason=reason)


def reap_sandboxes(cfg: RunConfig, when: str) -> int:
    """Remove the sandboxes of this run that no worker is left to destroy (killed workers'); the
    number removed. Called with no worker of the run running: at its start and at its end. A reap
    that fails is logged with the command that retries it; it never fails the run's results."""
    if not cfg.run.id:
        return 0
    from rollway.sandboxes.factory import build_sandbox_provider
    from rollway.sandboxes.reaper import reap_run

    try:
        report = asyncio.run(reap_run(build_sandbox_provider(cfg.sandbox), cfg.run.id))
    except Exception as err:  # noqa: BLE001 - deliberate: see docstring
        log.warning(f"sandboxes of this run not reaped at its {when}; retry with `rollway sandbox reap --run "
                    f"{cfg.run.id}`", error=f"{type(err).__name__}: {err}")
        return 0
    if report.failed:
        log.warning(f"some sandboxes of this run could not be removed; retry with `rollway sandbox reap --run "
                    f"{cfg.run.id}`", failed=report.failed)
    if report.removed:
        log.warning(f"reaped {len(report.removed)} sandboxes left by killed workers at the run's {when}",
                    sandboxes=report.removed[:10])
    return len(report.removed)


def wait_for_consumers(run_dir: Path, completed: int, job: Job, timeout_s: float = 90.0,
                       training_timeout_s: float = 1800.0) -> None:
    """The scheduler has seen every outcome; wait until the sink and the learner have committed
    everything on their input topics (the learner commits only what a checkpoint holds), restarting
    crashed workers meanwhile. An update in progress extends the wait, up to training_timeout_s.
    Committed offsets, not status files: a killed worker's last status file would claim progress its
    restart has not redone."""
    deadline = time.monotonic() + timeout_s
    hard_deadline = time.monotonic() + training_timeout_s
    while time.monotonic() < deadline:
        # The sink's status file first (a file read); the committed offsets (a broker round trip) once it has all.
        sink = RunDir(run_dir).sink().get("episodes_written", 0)
        if sink >= completed and asyncio.run(consumer_lag(job.cfg, job.bootstrap, DRAINS)) == 0:
            return
        if RunDir(run_dir).learner().get("training") and any(p.alive for p in job.procs if p.stage in DRAINS):
            deadline = min(hard_deadline, max(deadline, time.monotonic() + timeout_s))
        job.restart_dead_workers()
        time.sleep(0.1 if sink < completed else 0.25)
    log.warning(f"sink/learner did not catch up within {timeout_s:.0f}s; the summary may be incomplete")


async def consumer_lag(cfg: RunConfig, bootstrap: str, stages: tuple[str, ...]) -> int:
    """Messages on the stages' input topics their consumer groups have not committed yet: one scan of
    the log ends for every input, the groups' committed offsets from one admin client."""
    from aiokafka.admin import AIOKafkaAdminClient

    from rollway.runners.stage import group_id
    from rollway.runtime.kafka import (
        client_kwargs,
        log_end_offsets,
        make_consumer,
        start_with_retry,
        topic_name,
        topic_partitions,
    )
    # Its fetches only probe the high watermark at each end: a broker answers them after fetch_max_wait.
    probe = cfg.broker.model_copy(update={"fetch_max_wait_ms": 10})
    consumer = await make_consumer(probe, bootstrap, group_id=None)
    admin = AIOKafkaAdminClient(**client_kwargs(cfg.broker, bootstrap))
    try:
        await start_with_retry(admin, cfg.broker, "admin")
        names = {stage: {topic_name(t, cfg.topics) for t in get_stage(stage).consumes} for stage in stages}
        every = await topic_partitions(consumer, sorted(set().union(*names.values())))
        inputs = {stage: [tp for tp in every if tp.topic in names[stage]] for stage in stages}
        ends = await log_end_offsets(consumer, every)
        total = 0
        for stage, tps in inputs.items():
            committed = await admin.list_consumer_group_offsets(group_id(stage, cfg), partitions=tps)
            total += sum(max(0, ends[tp] - (committed[tp].offset if tp in committed and committed[tp].offset >= 0
                                            else 0)) for tp in tps)
        return total
    finally:
        await consumer.stop()
        await admin.close()
