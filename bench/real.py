"""`rollway bench pipeline --real`: the pipeline against bounded async batching on real parts: one vLLM
engine (the CPU build from .venv-vllm) serving the bundled SmolLM2, SWE tasks built from a source archive,
real sandboxes (bubblewrap, `sandbox.type: local`), grading by the tasks' real tests. Both modes run the
same episodes (same tasks, same per-episode sampling seeds) against the same engine, one after the other;
a sampler thread records the engine's running and waiting requests (its Prometheus /metrics) and the CPU
of the engine, of rollway's processes (the bench and its children: broker, stages, sandboxes, tests) and
of the whole machine, so the report can say who held the cores."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Literal

import msgspec
from pydantic import Field, field_validator, model_validator

from rollway.base.config import StrictModel
from rollway.base.figures import NO_SAMPLE, dumps, finite, fmt, mean, put, ratio
from rollway.base.http import http_get, http_post
from rollway.base.run_dir import RunDir
from rollway.bench.bench_dir import BenchDir
from rollway.policies.launch import ServerProcess
from rollway.policies.vllm import parse_metrics

ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
ENGINE_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total",
                   "vllm:prefix_cache_queries_total")


class RealBenchConfig(StrictModel):
    """The real pipeline benchmark: task set, episodes, the resources both modes get, the engine.
    Defaults finish in about 10-15 minutes on a 2-core machine (vLLM start-up included)."""


    seed: int = 0
    """Run seed: the scheduler's task order and every episode's sampling seeds (same in both modes)."""
    sdist: list[str] = ["toolz==1.2.0"]
    """Source archives the SWE tasks are built from (`rollway tasks build swe --sdist`), when `tasks_path`
    is not given: one or several, `sdist=toolz==1.2.0,six==1.16.0` (or a YAML list). `num_tasks` is split
    across them in turn (an archive that yields fewer leaves the rest to the others). Each archive's tasks
    are built once per (archive, count, task_seed) and cached under ~/.cache/rollway/bench."""
    tasks_path: str | None = None
    """An instances file written by `rollway tasks build swe --format instances` (the swe task set converts it
    to SWE-bench rows over git on load); overrides `sdist`."""
    task_seed: int = 0
    """Seed of the task builder (which mutations become tasks)."""
    num_tasks: int = Field(4, ge=1)
    """Tasks used (built, or the first ones of `tasks_path` after the scheduler's shuffle); at least one
    per archive in `sdist`."""
    group_size: int = Field(4, ge=1)
    """Episodes per task and epoch (a GRPO group)."""
    epochs: int = Field(2, ge=1)
    """Passes over the tasks: episodes per mode = num_tasks x group_size x epochs."""
    slots: int = Field(8, ge=1)
    """Model calls at once: the baseline's slots, the pipeline's agent.concurrency, and the engine's
    --max-num-seqs (so both modes get the same engine)."""
    tool_overlap: int = Field(8, ge=0)
    """Pipeline: turns the agent runs beyond `slots` (agent.tool_overlap): a tool call or test run frees
    its model-call slot for another episode's turn."""
    init_lookahead: int = Field(4, ge=0)
    """Pipeline: sandboxes started ahead of agent capacity (scheduler.init_lookahead)."""
    init_concurrency: int = Field(2, ge=1)
    """Pipeline: sandboxes started at once (init.concurrency)."""
    grade_concurrency: int = Field(2, ge=1)
    """Pipeline: gradings (test runs) at once (reward.concurrency)."""
    fetch_max_wait_ms: int = Field(100, ge=1)
    """Pipeline: broker.fetch_max_wait_ms of every stage's consumers. The embedded broker answers a waiting
    fetch only when this expires, so an idle consumer polls 1000/this times a second: at 10 (the simulated
    bench's value, where a turn takes milliseconds) the six stage processes took a third of a core from
    the engine on 2 cores; here a turn takes seconds and 100 adds at most 0.1 s per hop."""
    max_turns: int = Field(4, ge=1)
    """Agent turns per episode at most."""
    max_tokens_per_turn: int = Field(96, ge=1)
    """Completion tokens per turn at most."""
    max_total_tokens: int = Field(3500, ge=64)
    """Prompt + completions + observations per episode at most (below `max_model_len`)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of the agent."""
    test_timeout_s: float = Field(180.0, gt=0)
    """A grading test run longer than this fails (tasks.test_timeout_s). With 60, 9 of 32 baseline
    gradings timed out on a 2-core machine loaded by other jobs (8 test runs at once)."""
    model: str = "smollm2"
    """Model the engine serves (`smollm2`: the bundled SmolLM2-135M-Instruct, converted once)."""
    engine_url: str | None = None
    """An already running vLLM server (`http://HOST:PORT/v1`, started with `rollway serve --engine vllm`
    or as policies.vllm.vllm_serve_command builds it) instead of starting one; its /metrics must answer."""
    kv_cache_gib: float = Field(2.0, gt=0)
    """vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE) when the bench starts the engine."""
    max_model_len: int = Field(4096, ge=256)
    """Context length of the engine the bench starts."""
    engine_start_timeout_s: float = Field(900.0, gt=0)
    """How long the engine may take to answer /health after start."""
    sample_interval_s: float = Field(0.25, gt=0)
    """Period of the sampler thread (engine gauges, CPU of the process trees and the machine)."""
    modes: list[Literal["baseline", "pipeline"]] = ["baseline", "pipeline"]
    """Modes to run, in this order."""

    @field_validator("sdist", mode="before")
    @classmethod
    def _split_archives(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            from rollway.envs.sdist import SdistError, parse_requirement

            for item in value:
                try:
                    parse_requirement(str(item))
                except SdistError:
                    raise ValueError(f"sdist: {item!r} pins no version; name each archive as NAME==VERSION, "
                                     "e.g. sdist=toolz==1.2.0,six==1.16.0") from None
            if len(set(value)) < len(value):
                raise ValueError(f"sdist names an archive twice: {value}")
        return value

    @model_validator(mode="after")
    def _a_task_per_archive(self) -> RealBenchConfig:
        if not self.sdist and self.tasks_path is None:
            raise ValueError("sdist: name at least one archive (sdist=toolz==1.2.0) or give tasks_path")
        if self.tasks_path is None and self.num_tasks < len(self.sdist):
            raise ValueError(f"num_tasks={self.num_tasks} is fewer than the {len(self.sdist)} archives in sdist: "
                             f"raise num_tasks to {len(self.sdist)} or name fewer archives")
        return self

    @property
    def episodes(self) -> int:
        return self.num_tasks * self.group_size * self.epochs


# ------------------------------------------------------------------ tasks and run configs


def ensure_tasks(rc: RealBenchConfig, out: Path, say=print) -> Path:
    """The instances file both modes run: `tasks_path`, or tasks built from the `sdist` archives (cached)."""
    from rollway.bench.real_tasks import ensure_tasks as ensure

    return ensure(rc.sdist, rc.tasks_path, rc.num_tasks, rc.task_seed, out, say)


def real_run_config(rc: RealBenchConfig, tasks_path: Path, run_dir: Path, url: str, tokenizer: str,
                    name: str) -> dict[str, Any]:
    """The job config of one mode; the baseline reads its actors' settings and episode order from it too.
    The run id is the same in both modes, so episode ids, and with them sampling seeds, are the same."""
    lookahead = rc.init_lookahead
    return {
        "run": {"name": name, "id": "real", "seed": rc.seed, "timeout_s": 3600, "trace": True},
        "topics": {"prefix": f"{name}.", "default_partitions": 4},
        "broker": {"fetch_max_wait_ms": rc.fetch_max_wait_ms},
        "tasks": {"type": "swe", "path": str(tasks_path), "test_timeout_s": rc.test_timeout_s},
        "sandbox": {"type": "local", "root": str(RunDir(run_dir).sandboxes)},
        "policy": {"type": "openai", "engine": "vllm", "base_url": url, "chat_format": "hf", "tokenizer": tokenizer,
                   "max_model_len": rc.max_model_len},
        "scheduler": {"group_size": rc.group_size, "num_tasks": rc.num_tasks, "epochs": rc.epochs,
                      "max_inflight_episodes": rc.slots + rc.tool_overlap + lookahead + rc.grade_concurrency,
                      "init_lookahead": lookahead, "episode_deadline_s": 1800, "max_attempts": 1},
        "init": {"concurrency": rc.init_concurrency},
        "agent": {"concurrency": rc.slots, "tool_overlap": rc.tool_overlap, "max_turns": rc.max_turns,
                  "max_tokens_per_turn": rc.max_tokens_per_turn, "max_total_tokens": rc.max_total_tokens,
                  "temperature": rc.temperature},
        "reward": {"concurrency": rc.grade_concurrency},
    }


# ------------------------------------------------------------------ sampling the engine and the CPU


def proc_table() -> dict[int, tuple[int, float, int]]:
    """pid -> (parent pid, CPU seconds the process itself used, its start time in clock ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, int(fields[19]))
    return table


def descendants(table: dict[int, tuple[int, float, int]], root: int, exclude: int | None = None) -> list[int]:
    """`root` and its live descendants, without the subtree of `exclude`."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        if pid == exclude or pid not in table:
            continue
        found.append(pid)
        stack += children.get(pid, [])
    return found


class CpuMeter:
    """CPU seconds used so far by a process tree, counting processes that have exited at their last
    sampled value (so a process's last sampling interval is missed). Sampling, because a parent's
    reaped-children time misses sandboxed commands: a command run in bubblewrap's user and pid
    namespaces (the local sandbox) never shows up in its parent's cutime (measured: 1 s of CPU in
    the sandbox, +0.02 s on the tree)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], float] = {}
        """(pid, start time) -> CPU seconds at its last sample (the start time tells reused pids apart)."""

    def sample(self, table: dict[int, tuple[int, float, int]], root: int, exclude: int | None = None) -> float:
        for pid in descendants(table, root, exclude):
            _, cpu, start = table[pid]
            self.seen[(pid, start)] = cpu
        return sum(self.seen.values())


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (all cores; /proc/stat, idle and iowait out)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class Sampler(threading.Thread):
    """Every `interval_s`: the engine's running and waiting requests, and the CPU seconds so far of the
    engine's process tree, of rollway's (this process and its children, the engine excluded) and of
    the machine. `engine_pid` None (an engine started elsewhere): its CPU is not measured."""

    def __init__(self, metrics_url: str, engine_pid: int | None, interval_s: float):
        super().__init__(daemon=True)
        self.metrics_url, self.engine_pid, self.interval_s = metrics_url, engine_pid, interval_s
        self.samples: list[tuple[float, float | None, float | None, float | None, float, float]] = []
        """(time, running, waiting, engine CPU s, rollway CPU s, machine busy CPU s); running and waiting are
        None when the scrape failed, engine CPU when the engine is not a child of this process."""
        self.loads: list[tuple[float, float]] = []
        """(time, the machine's 1-minute load average): how many other jobs shared the cores."""
        self.engine_cpu, self.rollway_cpu = CpuMeter(), CpuMeter()
        self._halt = threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self._halt.is_set():
            try:
                text = http_get(self.metrics_url, timeout_s=2).text
                gauges: dict[str, float | None] = dict(parse_metrics(text, ENGINE_GAUGES))
            except OSError:  # the engine did not answer in time (a busy machine): no gauge in this sample
                gauges = dict.fromkeys(ENGINE_GAUGES)
            table = proc_table()
            engine = self.engine_cpu.sample(table, self.engine_pid) if self.engine_pid else None
            ours = self.rollway_cpu.sample(table, me, exclude=self.engine_pid)
            self.samples.append((time.time(), *gauges.values(), engine, ours, machine_busy_s()))
            self.loads.append((time.time(), os.getloadavg()[0]))
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Engine busy fraction (share of answered /metrics scrapes with a running request), mean running and
        waiting requests, and cores used (CPU seconds / wall seconds) by the engine, rollway and everything
        else on the machine (other users' jobs: the machine is shared) over [t0, t1]. A figure with nothing
        to stand on (no scrape answered, fewer than two samples, an engine started elsewhere) is None, with
        its reason under `no_sample`; a scrape that failed is left out of the engine's figures, not
        counted as a number."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        scraped = [s for s in inside if finite(s[1]) and finite(s[2])]  # a gauge reading NaN is no reading either
        figures: dict[str, Any] = {"samples": len(inside), "engine_scrapes_failed": len(inside) - len(scraped)}
        no_scrape = (f"none of the {len(inside)} scrapes of the engine's /metrics in the window answered within 2 s"
                     if inside else f"no sample in the window ({t1 - t0:.2f} s; one every {self.interval_s} s)")
        put(figures, "engine_busy_fraction", ratio(sum(s[1] > 0 for s in scraped), len(scraped)), no_scrape)
        put(figures, "engine_mean_running", mean(s[1] for s in scraped), no_scrape)
        put(figures, "engine_mean_waiting", mean(s[2] for s in scraped), no_scrape)
        span = inside[-1][0] - inside[0][0] if inside else 0.0
        no_span = f"{len(inside)} sample(s) in the window: no time span to spread CPU seconds over"

        def cores(i: int) -> float | None:
            first, last = inside[0][i] if inside else None, inside[-1][i] if inside else None
            return ratio(last - first, span) if first is not None and last is not None else None

        engine, ours, machine = cores(3), cores(4), cores(5)
        put(figures, "cores_engine", engine, no_span if span <= 0 else
            "the engine was started elsewhere (engine_url): its process tree is not on this machine's books")
        put(figures, "cores_rollway", ours, no_span)
        put(figures, "cores_machine", machine, no_span)
        put(figures, "cores_other", None if machine is None or ours is None else machine - ours - (engine or 0.0),
            no_span)
        return self.load_window(t0, t1, figures)

    def load_window(self, t0: float, t1: float, figures: dict[str, Any] | None = None) -> dict[str, Any]:
        """Mean and largest 1-minute load average over [t0, t1] (the machine is shared), added to `figures`."""
        loads = [load for t, load in self.loads if t0 <= t <= t1]
        figures = {} if figures is None else figures
        why = "no sample in the window"
        put(figures, "load_average_mean", mean(loads), why)
        put(figures, "load_average_max", max(loads) if loads else None, why)
        return figures


# ------------------------------------------------------------------ the engine


class Engine:
    """The vLLM server both modes share: started here (`engine_url` None) or one already running."""

    def __init__(self, rc: RealBenchConfig, out: Path):
        self.rc, self.out = rc, out
        self.server = None
        self.started_in_s = 0.0

    def __enter__(self) -> Engine:
        if self.rc.engine_url:
            self.url = self.rc.engine_url.rstrip("/")
            return self
        from rollway.base.process import free_port
        from rollway.policies.config import PolicyConfig
        from rollway.policies.launch import vllm_server

        cfg = PolicyConfig(type="openai", launch=True, engine="vllm", model=self.rc.model,
                           max_model_len=self.rc.max_model_len, kv_cache_gib=self.rc.kv_cache_gib,
                           vllm_args=["--max-num-seqs", str(self.rc.slots),
                                      "--disable-uvicorn-access-log"])  # the sampler polls /metrics 4x a second
        t0 = time.monotonic()
        base = vllm_server(cfg, free_port(), BenchDir(self.out).engine_log)  # the argv and environment rollway uses
        self.server = ServerProcess(base.argv, base.env, base.port, base.log_path).start()
        try:
            self.server.wait_ready(self.rc.engine_start_timeout_s)
        except BaseException:
            self.server.stop()
            raise
        self.started_in_s = time.monotonic() - t0
        self.url = self.server.base_url
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.server is not None:
            self.server.stop()

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server is not None and self.server.proc else None

    def counters(self) -> dict[str, float]:
        text = http_get(f"{self.root}/metrics", timeout_s=10).text
        return parse_metrics(text, ENGINE_COUNTERS)

    def reset_prefix_cache(self) -> None:
        """Both modes replay the same prompts: a warm cache would spare the second one prefill."""
        for _ in range(50):
            key = os.environ.get("OPENAI_API_KEY")  # a guarded server wants its key on this dev route
            body = http_post(f"{self.root}/reset_prefix_cache", timeout_s=30,
                             headers={"Authorization": f"Bearer {key}"} if key else None).body
            if not body.strip() or json.loads(body).get("success", True):
                return
            time.sleep(0.1)


# ------------------------------------------------------------------ the modes


def episode_figures(trajectories: list[dict[str, Any]], run_dir: Path) -> dict[str, Any]:
    """Work the mode did (sampling makes the two modes' episodes similar, not identical); init and
    grading seconds from the run's telemetry, generation and tool seconds from the turns."""
    from rollway.runtime.telemetry import read_telemetry, stage_seconds

    turns = sum(t["num_turns"] for t in trajectories)
    generated = sum(e - s for t in trajectories for s, e in t["turn_spans"])
    stages = stage_seconds(read_telemetry(run_dir), {t["episode"]["episode_id"] for t in trajectories})
    timing = {"init": stages.get("init", 0.0), "reward": stages.get("reward", 0.0),
              "agent_gen": sum(u.get("gen_seconds", 0.0) for t in trajectories for u in t.get("turns", [])),
              "agent_tool": sum(u.get("tool_seconds", 0.0) for t in trajectories for u in t.get("turns", []))}
    stops: dict[str, int] = {}
    for t in trajectories:
        stops[t["stop_reason"]] = stops.get(t["stop_reason"], 0) + 1
    return {"episodes": len(trajectories), "turns": turns, "generated_tokens": generated,
            "resolved": sum(bool(t["resolved"]) for t in trajectories), "stop_reasons": stops,
            "tool_calls": sum(len(u.get("observations", [])) for t in trajectories for u in t.get("turns", [])),
            "seconds_per_episode": {k: v / max(1, len(trajectories)) for k, v in timing.items()}}


def run_baseline_mode(data: dict[str, Any], run_dir: Path, slots: int) -> tuple[float, float, list[dict]]:
    from rollway.bench.baseline import run_baseline
    from rollway.bench.pipeline import load_run_config

    cfg = load_run_config(data, RunDir(run_dir).run_config_yaml)
    result = asyncio.run(run_baseline(cfg, run_dir, slots))
    return result.started, result.ended, [msgspec.to_builtins(t) for t in result.trajectories]


def run_pipeline_mode(data: dict[str, Any], run_dir: Path, bootstrap: str) -> tuple[float, float, list[dict]]:
    from rollway.bench.pipeline import run_pipeline

    run = run_pipeline(data, run_dir, bootstrap, 1)
    from rollway.base.run_dir import read_trajectories

    return run.started, run.ended, read_trajectories(run_dir)


def run_real_bench(rc: RealBenchConfig, out: Path, say=print) -> dict[str, Any]:
    """Each mode in `rc.modes` on the same tasks and engine; figures per mode, ratio, and CPU shares."""
    from rollway.policies.model_loading import resolve_model_folder
    from rollway.runtime.broker import EmbeddedBroker

    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    def note(message: str) -> None:
        say(f"[{time.monotonic() - t_start:5.0f}s] {message}")

    tasks_path = ensure_tasks(rc, out, note)
    tokenizer = str(resolve_model_folder(rc.model))
    modes: dict[str, dict[str, Any]] = {}
    note("bench real: starting the engine" if not rc.engine_url else f"bench real: engine at {rc.engine_url}")
    with Engine(rc, out) as engine, EmbeddedBroker(log_path=BenchDir(out).bench_broker_log) as broker:
        sampler = Sampler(f"{engine.root}/metrics", engine.pid, rc.sample_interval_s)
        sampler.start()
        try:
            for mode in rc.modes:
                note(f"bench real: {mode}, {rc.episodes} episodes, {rc.slots} model-call slots")
                engine.reset_prefix_cache()
                run_dir = RunDir(out).sub(mode).path
                data = real_run_config(rc, tasks_path, run_dir, engine.url, tokenizer, mode)
                before = engine.counters()
                if mode == "baseline":
                    t0, t1, trajectories = run_baseline_mode(data, run_dir, rc.slots)
                else:
                    t0, t1, trajectories = run_pipeline_mode(data, run_dir, broker.bootstrap)
                after = engine.counters()
                time.sleep(2 * rc.sample_interval_s)  # a sample past the end
                modes[mode] = {"makespan_s": t1 - t0, **episode_figures(trajectories, run_dir), **sampler.window(t0, t1),
                               **{k.removeprefix("vllm:"): after[k] - before[k] for k in ENGINE_COUNTERS}}
                put(modes[mode], "generated_tokens_per_s", ratio(modes[mode]["generated_tokens"], t1 - t0),
                    "the mode's makespan was 0 s")
                BenchDir(out).mode_result(mode).write_text(dumps(modes[mode], indent=1))  # kept if a later mode fails
        finally:
            sampler.stop()
    from rollway.bench.real_tasks import per_archive, read_rows

    archives = per_archive(read_rows(tasks_path))
    result: dict[str, Any] = {"config": rc.model_dump(), "episodes": rc.episodes, "tasks_path": str(tasks_path),
                              "tasks_per_archive": archives,
                              "engine_start_s": engine.started_in_s, **modes, "out_dir": str(out)}
    if "baseline" in modes and "pipeline" in modes:
        b, p = modes["baseline"], modes["pipeline"]
        put(result, "ratio", ratio(b["makespan_s"], p["makespan_s"]), "the pipeline's makespan was 0 s")
        put(result, "ratio_tokens_per_s", ratio(p["generated_tokens_per_s"], b["generated_tokens_per_s"]),
            "the baseline generated no tokens (or a mode's makespan was 0 s)")
    return result


def format_real_text(r: dict[str, Any]) -> str:
    rc = r["config"]
    lines = [f"real pipeline bench: {r['episodes']} episodes per mode ({rc['num_tasks']} tasks x {rc['group_size']} "
             f"x {rc['epochs']}), {rc['slots']} model-call slots, tasks {r['tasks_path']}",
             f"engine start {r['engine_start_s']:.0f} s; tasks per archive "
             f"{', '.join(f'{k}: {v}' for k, v in r.get('tasks_per_archive', {}).items())}"]
    for mode in ("baseline", "pipeline"):
        m = r.get(mode)
        if not m:
            continue
        lines.append(
            f"{mode:9s} makespan {m['makespan_s']:7.1f} s  turns {m['turns']:4d}  generated {m['generated_tokens']:6d} "
            f"tok ({fmt(m.get('generated_tokens_per_s'), '.0f')}/s)  resolved {m['resolved']}/{m['episodes']}  engine "
            f"busy {fmt(m.get('engine_busy_fraction'))}, running {fmt(m.get('engine_mean_running'), '.1f')}, waiting "
            f"{fmt(m.get('engine_mean_waiting'), '.1f')}  cores: engine {fmt(m.get('cores_engine'))} rollway "
            f"{fmt(m.get('cores_rollway'))} other {fmt(m.get('cores_other'))}")
        per = m["seconds_per_episode"]
        lines.append(
            f"{'':9s} s per episode: init {per['init']:.1f}, generation {per['agent_gen']:.1f}, tools "
            f"{per['agent_tool']:.1f}, grading {per['reward']:.1f}  stop reasons "
            f"{', '.join(f'{k} {v}' for k, v in sorted(m['stop_reasons'].items()))}  load average "
            f"{fmt(m.get('load_average_mean'), '.1f')} (max {fmt(m.get('load_average_max'), '.1f')})")
        lines += [f"{'':9s} {key}: n/a, {why}" for key, why in sorted(m.get(NO_SAMPLE, {}).items())]
    if "ratio" in r:
        lines.append(f"ratio (baseline / pipeline makespan) {fmt(r['ratio'])}; generated tokens/s pipeline / baseline "
                     f"{fmt(r['ratio_tokens_per_s'])}")
    lines.append(f"results: {r['out_dir']}/result.json")
    return "\n".join(lines)
