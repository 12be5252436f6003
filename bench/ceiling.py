"""`rollway bench ceiling`: the framework's own ceiling. One real agent stage worker (StageWorker +
AgentActor, in this process) on the embedded broker, against a zero-latency engine (the simulated
server answering at once) and sandboxes whose tools take no time: turns per second it sustains, its
CPU per turn, and where a turn's time goes (decode, tokenisation, inference round trip, tool dispatch,
produce, commit), measured by timing wrappers around those calls (they change no behaviour)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rollway.base.figures import fmt, put, ratio, scaled
from rollway.base.loop import run_async
from rollway.base.run_dir import RunDir
from rollway.bench.bench_dir import BenchDir
from rollway.bench.workload import WorkloadConfig, plan_workload, write_plans

ZERO_TIME = {"tool_s_median": 0.0, "init_s_median": 0.0, "grade_s_median": 0.0}
"""The workload's sandbox times are zeroed: only the framework's own work is left."""


class CallTimers:
    """Wall time and calls per category, by wrapping functions in place (undone by `restore`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, category: str) -> None:
        original = getattr(owner, name)
        timers = self
        if asyncio.iscoroutinefunction(original):
            @functools.wraps(original)
            async def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    timers.seconds[category] += time.perf_counter() - t0
                    timers.calls[category] += 1
        else:
            @functools.wraps(original)
            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    timers.seconds[category] += time.perf_counter() - t0
                    timers.calls[category] += 1
        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def per_turn_ms(self, turns: int) -> dict[str, float]:
        return {k: 1000 * v / max(1, turns) for k, v in sorted(self.seconds.items())}


async def _seed_turn_zero(cfg: Any, run_dir: Path, bootstrap: str, episodes: int) -> None:
    """Every episode's turn-0 message on agent-steps (made by the real init actor), before the clock starts."""
    from rollway.actors.init import InitActor
    from rollway.actors.services import Services
    from rollway.runtime.actor import MessageMeta
    from rollway.runtime.kafka import ensure_topics, make_producer, topic_name
    from rollway.schemas.codec import encode
    from rollway.schemas.messages import EpisodeKey, InitRequest

    await ensure_topics(cfg.broker, cfg.topics, bootstrap)
    init = InitActor(Services(cfg, run_dir))
    await init.setup()
    producer = await make_producer(cfg.broker, bootstrap)
    try:
        for i in range(episodes):
            eid = f"{cfg.run.id}-ceiling-e{i:05d}"  # the run's own episodes (stages skip others)
            req = InitRequest(episode=EpisodeKey(episode_id=eid, group_id=eid, task_id=f"sim-{i:05d}"),
                              issued_at=time.time(), deadline=time.time() + 1e9)
            out = (await init.handle(req, MessageMeta("init-requests", 0, i)))[0]
            await producer.send_and_wait(topic_name(out.topic, cfg.topics), encode(out.value), key=eid.encode())
    finally:
        await producer.stop()


async def _run_worker(cfg: Any, run_dir: Path, bootstrap: str, turns: int, timers: CallTimers) -> dict[str, float]:
    """One agent worker until it has handled `turns` turns; wall and CPU time of that stretch."""
    from rollway.actors.agent import AgentActor
    from rollway.actors.services import Services
    from rollway.envs import base as environments
    from rollway.runners.stage import group_id, stage_concurrency, stage_prefetch
    from rollway.runtime import worker as stage_runtime

    services = Services(cfg, run_dir)
    actor = AgentActor(services)
    worker = stage_runtime.StageWorker(actor, cfg, bootstrap, stage_concurrency("agent", cfg),
                                       group_id("agent", cfg), prefetch=stage_prefetch("agent", cfg))
    timers.wrap(stage_runtime, "decode", "decode")
    timers.wrap(stage_runtime, "encode", "encode")
    for name in ("initial", "continuation", "decode", "encode", "drift"):
        timers.wrap(services.chat, name, "tokenisation")
    timers.wrap(services.inference, "generate", "inference_round_trip")
    timers.wrap(environments, "run_tool_calls", "tool_dispatch")  # what Environment.run_tools calls
    timers.wrap(worker.sender, "produce", "produce")  # the broker round trip (encoding is timed apart)
    timers.wrap(worker, "commit", "commit")
    timers.wrap(actor, "handle", "handle")
    stop = asyncio.Event()
    marks: dict[str, float] = {}

    async def watch() -> None:
        while worker.stats["handled"] < turns:
            if worker.stats["handled"] and "wall0" not in marks:
                marks["wall0"], marks["cpu0"] = time.perf_counter(), time.process_time()
                marks["handled0"] = worker.stats["handled"]
            await asyncio.sleep(0.005)
        marks["wall1"], marks["cpu1"] = time.perf_counter(), time.process_time()
        stop.set()

    watcher = asyncio.create_task(watch())
    try:
        await worker.run(stop)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await services.inference.close()
    counted = turns - marks["handled0"]
    wall, cpu = marks["wall1"] - marks["wall0"], marks["cpu1"] - marks["cpu0"]
    figures = {"turns": turns, "turns_timed": counted, "wall_s": wall}
    put(figures, "turns_per_s", ratio(counted, wall), "no time passed between the timing marks")
    put(figures, "cpu_ms_per_turn", scaled(1000, ratio(cpu, counted)), "no turn was handled after the warm-up mark")
    put(figures, "cpu_busy_fraction", ratio(cpu, wall), "no time passed between the timing marks")
    return figures


def measure(wl: WorkloadConfig, out: Path, bootstrap: str, server_url: str, name: str,
            profile: Path | None = None) -> dict[str, Any]:
    """One worker over the workload's episodes; figures and the per-turn breakdown (ms)."""
    from rollway.bench.pipeline import load_run_config, run_config

    run_dir = RunDir(out).sub(name).path
    data = run_config(wl, BenchDir(out).plans, RunDir(run_dir).sandboxes, server_url, name)
    data["run"]["trace"] = False
    cfg = load_run_config(data, RunDir(run_dir).run_config_yaml)
    turns = sum(p.num_turns for p in plan_workload(wl))
    asyncio.run(_seed_turn_zero(cfg, run_dir, bootstrap, wl.episodes))
    timers = CallTimers()
    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile(time.process_time)  # CPU, not wall: the idle event loop costs nothing
        profiler.enable()
    try:
        figures = _run_in_loop(cfg, run_dir, bootstrap, turns, timers)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        timers.restore()
    figures["per_turn_ms"] = timers.per_turn_ms(turns)
    figures["turns_in_flight"] = wl.slots + wl.model_call_slack + wl.tool_overlap
    return figures


def _run_in_loop(cfg: Any, run_dir: Path, bootstrap: str, turns: int, timers: CallTimers) -> dict[str, float]:
    return run_async(_run_worker(cfg, run_dir, bootstrap, turns, timers))


def run_ceiling_bench(wl: WorkloadConfig, out: Path, profile: bool = False, say=print) -> dict[str, Any]:
    """Two runs of one agent worker against the zero-latency engine: one turn at a time (each call's
    own latency, nothing waiting beside it) and `slots + tool_overlap` turns at once (the ceiling)."""
    from rollway.bench.run import SimServer
    from rollway.runtime.broker import EmbeddedBroker

    out.mkdir(parents=True, exist_ok=True)
    wl = wl.model_copy(update=ZERO_TIME)
    write_plans(plan_workload(wl), BenchDir(out).plans)
    serial = wl.model_copy(update={"slots": 1, "tool_overlap": 0, "model_call_slack": 0, "agent_prefetch": 4,
                                   "episodes": min(wl.episodes, 64)})
    results = {}
    with SimServer(BenchDir(out).plans, wl, BenchDir(out).sim_server_log, instant=True) as server, \
            EmbeddedBroker(log_path=BenchDir(out).bench_broker_log) as broker:
        say(f"bench ceiling: one turn at a time, {serial.episodes} episodes")
        results["serial"] = measure(serial, out, broker.bootstrap, server.url, "serial")
        say(f"bench ceiling: {wl.slots + wl.model_call_slack + wl.tool_overlap} turns at once, {wl.episodes} episodes")
        results["concurrent"] = measure(wl, out, broker.bootstrap, server.url, "concurrent")
        if profile:
            say("bench ceiling: the concurrent run again under cProfile (CPU by category)")
            profiled = measure(wl, out, broker.bootstrap, server.url, "profiled", BenchDir(out).profile)
            results["cpu"] = cpu_breakdown(BenchDir(out).profile, profiled["turns"],
                                           results["concurrent"]["cpu_ms_per_turn"])
    return {"workload": wl.model_dump(), **results, "out_dir": str(out)}


CPU_CATEGORIES = (
    # first match wins: the client's JSON (msgspec.json) before the broker messages' msgpack (msgspec)
    ("inference_client", ("aiohttp", "json/", "msgspec.json", "policies/openai_client", "yarl", "multidict",
                          "http_")),
    ("decode_encode", ("msgspec", "schemas/codec")),
    ("tokenisation", ("policies/chat", "policies/base")),
    ("tool_dispatch", ("tools/", "sandboxes/")),
    ("kafka_client", ("aiokafka", "kafka/")),
    ("agent_logic", ("actors/",)),
    ("stage_runtime", ("runners/stage",)),
    ("logging", ("structlog", "logging/")),
    ("event_loop", ("asyncio/", "uvloop", "selectors", "socket")),
)
"""Where a profiled turn's CPU goes, by the file (or built-in) each function's own time was spent in."""


def cpu_breakdown(pstats_path: Path, turns: int, cpu_ms_per_turn: float | None) -> dict[str, Any]:
    """Own (tottime) CPU per category from a cProfile of the worker, as shares and as ms per turn
    scaled to the unprofiled run's CPU per turn (the profiler slows every call, roughly evenly)."""
    import pstats

    stats = pstats.Stats(str(pstats_path)).stats  # type: ignore[attr-defined]
    seconds: dict[str, float] = defaultdict(float)
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        where = f"{filename}:{name}"
        category = next((c for c, marks in CPU_CATEGORIES if any(m in where for m in marks)), "other")
        seconds[category] += tottime
    total = sum(seconds.values()) or 1.0
    shares = {k: v / total for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    return {"cpu_share": shares,
            "cpu_ms_per_turn": {k: None if cpu_ms_per_turn is None else share * cpu_ms_per_turn for k, share in shares.items()},
            "profiled_cpu_ms_per_turn": 1000 * total / max(1, turns),
            "top_functions": [{"function": f"{f}:{line}({name})", "tottime_s": round(v[2], 3), "calls": v[1]}
                              for (f, line, name), v in top]}


def format_ceiling_text(result: dict[str, Any]) -> str:
    lines = []
    for name in ("serial", "concurrent"):
        r = result[name]
        breakdown = ", ".join(f"{k} {v:.2f}" for k, v in r["per_turn_ms"].items())
        lines.append(f"{name:<11} {r['turns_in_flight']:>3} turns in flight: {fmt(r['turns_per_s'], '.0f')} turns/s, "
                     f"CPU {fmt(r['cpu_ms_per_turn'])} ms/turn (busy {fmt(r['cpu_busy_fraction'])})")
        lines.append(f"{'':<11} per turn (ms, wall time inside each call): {breakdown}")
    if "cpu" in result:
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in result["cpu"]["cpu_ms_per_turn"].items())
        lines.append(f"CPU per turn by category (ms, profile shares x the concurrent run's CPU): {cpu}")
    return "\n".join(lines)
