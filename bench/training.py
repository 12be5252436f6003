"""`rollway bench training`: synchronous against asynchronous RL training on the seeded benchmark
workload. Rollouts run the real init, agent and reward actors in-process against the simulated server
and sandboxes; the learner is simulated: a step lasts `learner_fixed_s + learner_s_per_ktoken x
trained tokens / 1000`, then the engine pauses `weight_sync_s` for the new weights.

One code path serves every mode. With a maximum policy lag L, episode n may start generating only
while n < (v + 1 + L) x B (v: the policy version the engine serves, B: episodes per step; AReaL's
staleness control, and rollway's scheduler's `_within_update_budget`; its sandbox may start up to
`init_lookahead` episodes earlier). What a step does about an episode that started under version
k - L or earlier and is still running is `stragglers`: `drop` (the default) is what rollway's learner
does (`learner.stale_policy: drop`): step k takes B finished episodes, those that started under the
oldest version first (then by finish time, as `learning/groups.py` pops complete groups), and trains
those at most L versions stale; an older one is consumed without training (dropped), and while an
episode more than L versions behind is still generating no new one starts (the scheduler's
`_room_for_group` rule). `wait` never drops: step k waits for every episode that started under
version k - L or earlier and fills the rest of its batch with the oldest finished ones, so the learner
idles for a cohort's slowest episode. Either way no trained episode is more than L versions stale.
L = 0 is synchronous training: a batch is generated, trained and synced before the next starts
(on-policy; nothing is ever dropped). With L >= 1 generation goes on while the learner trains, and
weights change under episodes in flight (their later turns run on the newer policy, which the engine
reports per response)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
from pydantic import Field

from rollway.actors.gate import RankedGate
from rollway.actors.services import Services
from rollway.base.config import StrictModel
from rollway.base.figures import ratio
from rollway.base.run_dir import RunDir
from rollway.bench.bench_dir import BenchDir
from rollway.bench.workload import WorkloadConfig
from rollway.config.run import RunConfig
from rollway.runtime.inprocess import InProcessDriver
from rollway.schemas.messages import AgentStep, EpisodeKey, InitRequest, Trajectory


class TrainingConfig(StrictModel):
    """The training loop around the benchmark workload: batch, steps, modes, learner cost."""


    batch_episodes: int = Field(32, ge=1)
    """Episodes per learner step (B)."""
    steps: int = Field(16, ge=1)
    """Learner steps per mode; every mode trains steps x B episodes. The first max lag + 1 steps are
    the start-up of an asynchronous mode (see `steady_episodes_per_s`); 16 leaves 11 steady steps at
    lag 4 (8, the earlier default, left 3, and the start-up weighed on the whole-run ratio)."""
    lags: list[int] = [0, 1, 2, 4]
    """Modes to run, by maximum policy lag: 0 is synchronous (on-policy), >= 1 asynchronous."""
    learner_fixed_s: float = Field(0.5, ge=0)
    """Seconds per learner step regardless of its tokens (optimizer step, launch overheads)."""
    learner_s_per_ktoken: float = Field(0.035, ge=0)
    """Learner seconds per 1000 trained tokens (every token of the episode: prompt, completions and
    observations go through forward and backward; the loss mask only selects the loss). Default: a
    step trains its batch in about the time the engine generates it at full throughput (seed 0: 32
    episodes of ~3,600 tokens: 0.5 + 4.0 s, against ~4.7 s of generation at ~6.8 episodes/s), the
    balanced split of rollout and training devices AReaL and verl recommend for disaggregated
    training. docs/benchmarks.md compares the resulting learner share of a synchronous step with published
    runs."""
    weight_sync_s: float = Field(0.3, ge=0)
    """Engine pause per update while the new weights load (no decode step starts inside it)."""
    out_of_order: bool = True
    """Asynchronous modes: a step may train episodes that finished before older ones still running
    (within the lag); False trains strictly in issue order."""
    stragglers: Literal["drop", "wait"] = "drop"
    """An episode still running when it is due (started under version k - L or earlier at step k):
    `drop` takes B finished ones, oldest start version first, and drops what is more than L versions
    stale when taken, as rollway's learner does (`learner.stale_policy: drop`); `wait` makes the step
    wait for it (the strict bound of earlier sessions' figures: nothing lost, the learner idles)."""

    def learner_s(self, tokens: int) -> float:
        return self.learner_fixed_s + self.learner_s_per_ktoken * tokens / 1000


@dataclass
class EpisodeRecord:
    index: int
    issued_at: float
    """When its sandbox start began (up to `init_lookahead` episodes ahead of admission)."""
    version: int | None = None
    """Policy version the engine served when the episode was admitted to generate (its first turn)."""
    admitted_at: float = 0.0
    done_at: float = 0.0
    trajectory: Trajectory | None = None
    trained_step: int | None = None
    dropped_step: int | None = None
    """The step that consumed it more than L versions stale (`stragglers: drop`), without training it."""

    @property
    def tokens(self) -> int:
        return len(self.trajectory.token_ids) if self.trajectory else 0


@dataclass
class StepRecord:
    step: int
    batch_ready_at: float
    train_start: float
    train_end: float
    sync_end: float
    tokens: int
    staleness: list[int]
    """Of the episodes trained (dropped ones excluded)."""
    dropped: int = 0


@dataclass
class TrainingModeResult:
    lag: int
    started: float
    ended: float
    episodes: list[EpisodeRecord]
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def trained(self) -> list[EpisodeRecord]:
        return [e for e in self.episodes if e.trained_step is not None]


def select_batch(pending: list[EpisodeRecord], step: int, lag: int, size: int,
                 out_of_order: bool = True, stragglers: str = "wait") -> list[EpisodeRecord] | None:
    """Step `step`'s batch (`size` episodes) from the unconsumed ones (in issue order), or None while
    it must wait. With out_of_order False only a finished prefix of the issue order counts.
    `wait`: every one that started under version step - lag or earlier must be in it, finished (so
    none is trained more than `lag` versions stale), the rest the oldest finished ones (by start
    version, then finish time). `drop`: `size` finished ones, oldest start version first, then by
    finish time (never waiting for one still running); the caller drops those more than `lag`
    versions stale."""
    if out_of_order:
        done = [e for e in pending if e.trajectory is not None]
    else:
        done = list(itertools.takewhile(lambda e: e.trajectory is not None, pending))
    if len(done) < size:
        return None
    if stragglers == "drop":
        return sorted(done, key=lambda e: (e.version, e.done_at))[:size]
    forced = [e for e in pending if e.version is not None and e.version <= step - lag]
    if any(e.trajectory is None for e in forced):
        return None
    rest = sorted((e for e in done if e.version > step - lag), key=lambda e: (e.version, e.done_at))
    return (forced + rest)[:size]


class TrainingLoop:
    """One mode: an issuer, per-episode coroutines and the simulated learner, in one event loop.
    Episodes pass through gates sized as the pipeline's stages are: sandbox starts (init concurrency),
    turns (slots + model_call_slack + tool_overlap, later turns first; the agent's own gate holds
    model calls to slots + model_call_slack), gradings (grade concurrency), and at most the sandbox
    bound alive. An episode that fails stops the mode with its error (the learner would otherwise
    wait for it forever)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, wl: WorkloadConfig, tc: TrainingConfig, lag: int,
                 pause_url: str | None):
        self.services = Services(cfg, run_dir)
        self.wl, self.tc, self.lag, self.pause_url = wl, tc, lag, pause_url
        self.driver = InProcessDriver(self.services)
        self.init_gate = asyncio.Semaphore(wl.init_concurrency)
        self.turn_gate = RankedGate(wl.slots + wl.model_call_slack + wl.tool_overlap)
        self.grade_gate = asyncio.Semaphore(wl.grade_concurrency)
        self.alive = 0
        self.version = 0
        self.changed = asyncio.Condition()
        self.records: list[EpisodeRecord] = []
        self.generating: dict[int, EpisodeRecord] = {}
        """Admitted and not yet finished, by index."""
        self.tasks: list[asyncio.Task] = []
        self.failure: BaseException | None = None

    # -- issuing ---------------------------------------------------------------------------
    def admissible(self, index: int) -> bool:
        """AReaL's staleness control, applied when an episode starts generating: episode n only
        while n < (v + 1 + lag) x B; with `stragglers: drop` also not while an episode more than
        `lag` versions behind is still generating (rollway's scheduler holds new groups then)."""
        if index >= (self.version + 1 + self.lag) * self.tc.batch_episodes:
            return False
        return self.tc.stragglers == "wait" or not any(
            self.version - e.version > self.lag for e in self.generating.values())

    def may_issue(self) -> bool:
        """Sandboxes start up to `init_lookahead` episodes ahead of admission, within the sandbox bound."""
        n, b = len(self.records), self.tc.batch_episodes
        return (self.alive < self.wl.sandbox_bound and n < (self.tc.steps + self.lag) * b
                and n < (self.version + 1 + self.lag) * b + self.wl.init_lookahead)

    async def issue_loop(self) -> None:
        while True:
            async with self.changed:
                await self.changed.wait_for(self.may_issue)
                record = EpisodeRecord(len(self.records), time.time())
                self.records.append(record)
                self.alive += 1
            self.tasks.append(asyncio.create_task(self.episode(record)))

    async def episode(self, record: EpisodeRecord) -> None:
        traj = failure = None
        try:
            eid = f"{self.services.cfg.run.id}-train-l{self.lag}-e{record.index:05d}"  # the run's own (stages skip others)
            traj = await self.driver.play(EpisodeKey(episode_id=eid, group_id=eid, task_id=f"sim-{record.index:05d}"),
                                          lambda stage, msg, meta: self._gated(record, msg))
        except Exception as err:
            failure = err
            raise
        finally:
            async with self.changed:  # one step: finished and no longer generating at the same instant
                if failure is not None:
                    self.failure = self.failure or failure
                elif traj is not None:
                    record.trajectory, record.done_at = traj, time.time()
                self.alive -= 1
                self.generating.pop(record.index, None)
                self.changed.notify_all()

    @contextlib.asynccontextmanager
    async def _gated(self, record: EpisodeRecord, msg):
        """A sandbox start, a turn (the first once admitted) or a grading, each through its gate."""
        if isinstance(msg, AgentStep) and record.version is None:
            async with self.changed:
                await self.changed.wait_for(lambda: self.admissible(record.index))
                record.version, record.admitted_at = self.version, time.time()
                self.generating[record.index] = record
        async with (self.init_gate if isinstance(msg, InitRequest) else self.grade_gate
                    if not isinstance(msg, AgentStep) else self.turn_gate.slot(lambda turn=msg.turn: float(turn))):
            yield

    # -- learning ----------------------------------------------------------------------------
    def batch_for(self, step: int) -> list[EpisodeRecord] | None:
        return select_batch([e for e in self.records if e.trained_step is None and e.dropped_step is None], step,
                            self.lag, self.tc.batch_episodes, self.tc.out_of_order, self.tc.stragglers)

    async def learner_loop(self) -> list[StepRecord]:
        steps = []
        async with aiohttp.ClientSession() as http:
            for k in range(self.tc.steps):
                async with self.changed:
                    await self.changed.wait_for(lambda k=k: self.failure or self.batch_for(k) is not None)
                    if self.failure is not None:
                        raise RuntimeError(f"bench training: an episode failed ({self.failure!r}); see the "
                                           "run folder's logs") from self.failure
                    batch = self.batch_for(k)
                    dropped = [e for e in batch if k - e.version > self.lag]
                    batch = [e for e in batch if k - e.version <= self.lag]
                    for e in batch:
                        e.trained_step = k
                    for e in dropped:
                        e.dropped_step = k
                ready = time.time()
                tokens = sum(e.tokens for e in batch)
                await asyncio.sleep(self.tc.learner_s(tokens))
                train_end = time.time()
                if self.pause_url and self.tc.weight_sync_s > 0:
                    await (await http.post(f"{self.pause_url}?seconds={self.tc.weight_sync_s}&version={k + 1}")).read()
                await asyncio.sleep(self.tc.weight_sync_s)
                async with self.changed:
                    self.version = k + 1
                    self.changed.notify_all()
                steps.append(StepRecord(k, ready, ready, train_end, time.time(), tokens,
                                        [k - e.version for e in batch], len(dropped)))
        return steps

    async def run(self) -> TrainingModeResult:
        async with self.driver:
            started = time.time()
            issuer = asyncio.create_task(self.issue_loop())
            try:
                steps = await self.learner_loop()
            finally:
                issuer.cancel()
                for task in self.tasks:
                    task.cancel()
                await asyncio.gather(issuer, *self.tasks, return_exceptions=True)
                await self.services.inference.close()
        return TrainingModeResult(self.lag, started, steps[-1].sync_end if steps else time.time(),
                                  self.records, steps)


def mode_figures(result: TrainingModeResult, tc: TrainingConfig) -> dict[str, Any]:
    """Throughput, staleness histogram, learner share and in-flight update counts of one mode."""
    wall = result.ended - result.started
    trained = result.trained
    dropped = sum(s.dropped for s in result.steps)
    histogram: dict[int, int] = {}
    for s in (s for step in result.steps for s in step.staleness):
        histogram[s] = histogram.get(s, 0) + 1
    learner_busy = sum(s.sync_end - s.train_start for s in result.steps)
    waits = [s.batch_ready_at - (result.steps[i - 1].sync_end if i else result.started)
             for i, s in enumerate(result.steps)]
    turns = newer = 0
    for e in trained:
        for turn in e.trajectory.turns:  # labelled by the engine with the version it served
            turns += 1
            newer += turn.policy_version > e.trajectory.turns[0].policy_version
    steady = _window(result.steps, result.lag)
    after_first = _window(result.steps, 0)
    return {
        "mode": "sync" if result.lag == 0 else f"async lag {result.lag}",
        "max_policy_lag": result.lag,
        "wall_s": wall,
        "trained_episodes": len(trained),
        "trained_episodes_per_s": len(trained) / wall,
        "step_s_mean": wall / max(1, len(result.steps)),
        "steady_episodes_per_s": steady.trained / steady.seconds if steady else None,
        "steady_step_s": steady.seconds / steady.steps if steady else None,
        "steady_from_step": result.lag,
        "after_first_update_episodes_per_s": after_first.trained / after_first.seconds if after_first else None,
        "learner_busy_fraction": learner_busy / wall,
        "learner_wait_s_mean": sum(waits) / max(1, len(waits)),
        "staleness_histogram": {str(k): histogram[k] for k in sorted(histogram)},
        "staleness_max": max(histogram, default=0),
        "staleness_mean": sum(k * n for k, n in histogram.items()) / max(1, sum(histogram.values())),
        "turns_after_an_inflight_update_fraction": newer / max(1, turns),
        "trained_tokens_per_episode": sum(e.tokens for e in trained) / max(1, len(trained)),
        "episodes_started": len(result.episodes),
        "episodes_dropped_stale": dropped,
        "dropped_fraction": dropped / max(1, len(trained) + dropped),
        "episodes_unconsumed_at_end": len(result.episodes) - len(trained) - dropped,
    }


@dataclass
class Window:
    steps: int
    trained: int
    """Episodes trained in the window (dropped ones not counted)."""
    seconds: float


def _window(steps: list[StepRecord], warm_up: int) -> Window | None:
    """The steps from the end of step `warm_up` to the end of the last, or None when fewer than two
    steps remain. With max lag L the first (1 + L) x B episodes all start under version 0, so steps
    0..L each wait for part of one (1 + L) x B cohort (step L for its slowest episode); steady state
    begins when that cohort is trained, at the end of step L."""
    if len(steps) <= warm_up + 1:
        return None
    later = steps[warm_up + 1:]
    return Window(len(later), sum(len(s.staleness) for s in later), steps[-1].sync_end - steps[warm_up].sync_end)


def training_workload(wl: WorkloadConfig, tc: TrainingConfig) -> WorkloadConfig:
    """The workload with enough planned episodes for every mode: an asynchronous mode starts up to
    max lag x B episodes beyond what it trains."""
    return wl.model_copy(update={"episodes": (tc.steps + max(tc.lags)) * tc.batch_episodes})


def run_mode(wl: WorkloadConfig, tc: TrainingConfig, lag: int, out: Path, server: Any) -> tuple[dict, list]:
    from rollway.bench.pipeline import load_run_config, run_config
    from rollway.bench.report import utilisation_series
    from rollway.bench.sim_server import busy_stats

    name = "sync" if lag == 0 else f"async-lag{lag}"
    run_dir = RunDir(out).sub(name).path
    server.reset()
    data = run_config(wl, BenchDir(out).plans, RunDir(run_dir).sandboxes, server.url, name)
    cfg = load_run_config(data, RunDir(run_dir).run_config_yaml)
    pause_url = server.url.removesuffix("/v1") + "/sim/pause"
    result = asyncio.run(TrainingLoop(cfg, run_dir, wl, tc, lag, pause_url).run())
    data = server.steps(result.started, result.ended)
    figures = mode_figures(result, tc)
    figures.update({k: v for k, v in busy_stats(data["steps"], result.started, result.ended, data["cap"]).items()})
    figures["learner_intervals"] = [(s.train_start - result.started, s.sync_end - result.started)
                                    for s in result.steps]
    series = utilisation_series(data["steps"], result.started, result.ended,
                                bin_s=max(0.25, (result.ended - result.started) / 120))
    return figures, series


def run_training_bench(wl: WorkloadConfig, tc: TrainingConfig, out: Path, say=print) -> dict[str, Any]:
    """Every mode in `tc.lags` on one workload, one simulated server; ratios against lag 0 (sync)."""
    from rollway.bench.run import SimServer
    from rollway.bench.workload import plan_workload, workload_summary, write_plans

    out.mkdir(parents=True, exist_ok=True)
    wl = training_workload(wl, tc)
    plans = plan_workload(wl)
    write_plans(plans, BenchDir(out).plans)
    modes: list[dict] = []
    series: dict[str, list] = {}
    t0 = time.monotonic()
    with SimServer(BenchDir(out).plans, wl, BenchDir(out).sim_server_log) as server:
        for lag in tc.lags:
            say(f"[{time.monotonic() - t0:5.0f}s] bench training: max policy lag {lag}"
                f"{' (sync)' if lag == 0 else ''}, {tc.steps} steps x {tc.batch_episodes} episodes")
            figures, series[str(lag)] = run_mode(wl, tc, lag, out, server)
            modes.append(figures)
    sync = next((m for m in modes if m["max_policy_lag"] == 0), None)
    for m in modes:
        m["ratio_to_sync"] = ratio(m["trained_episodes_per_s"], sync["trained_episodes_per_s"]) if sync else None
        m["steady_ratio_to_sync"] = ratio(m["steady_episodes_per_s"], sync["steady_episodes_per_s"]) if sync else None
    plot = BenchDir(out).training_plot
    plot_training(modes, series, plot, wl.slots)
    return {"workload": wl.model_dump(), "training": tc.model_dump(), "workload_summary": workload_summary(plans),
            "modes": modes, "ratios": {m["mode"]: m["ratio_to_sync"] for m in modes},
            "steady_ratios": {m["mode"]: m["steady_ratio_to_sync"] for m in modes},
            "plot": str(plot), "out_dir": str(out), "utilisation_series": series}


def plot_training(modes: list[dict], series: dict[str, list], path: Path, cap: int) -> None:
    """Engine busy fraction over time per mode, learner steps shaded beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 1.9 * len(modes) + 0.6), sharex=True, squeeze=False)
    for ax, m in zip(axes[:, 0], modes, strict=True):
        points = series[str(m["max_policy_lag"])]
        ts = [p["t"] for p in points]
        ax.plot(ts, [p["busy"] for p in points], drawstyle="steps-post", lw=1, label="busy (>= 1 sequence)")
        ax.plot(ts, [p["active"] / cap for p in points], drawstyle="steps-post", lw=1, label="running / cap")
        for start, end in m["learner_intervals"]:
            ax.axvspan(start, end, ymin=0, ymax=0.12, color="tab:orange", alpha=0.6, lw=0)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("busy")
        ax.grid(alpha=0.3)
        ax.set_title(f"{m['mode']}: {m['trained_episodes_per_s']:.2f} trained episodes/s, "
                     f"engine busy {m['busy_fraction']:.2f}, staleness {m['staleness_histogram']}", fontsize=9)
    axes[0, 0].legend(loc="lower left", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the mode started (orange: learner training and weight sync)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_training_text(result: dict[str, Any]) -> str:
    lines = [f"workload: {result['workload_summary']}",
             f"training: {result['training']}",
             f"{'mode':<14}{'wall_s':>8}{'ep/s':>7}{'ratio':>7}{'steady ep/s':>12}{'ratio':>7}"
             f"{'engine_busy':>12}{'learner_busy':>13}{'stale_max':>10}{'dropped':>8}  staleness histogram"]
    for m in result["modes"]:
        lines.append(f"{m['mode']:<14}{m['wall_s']:>8.1f}{m['trained_episodes_per_s']:>7.2f}"
                     f"{(m['ratio_to_sync'] or 0):>7.2f}{(m['steady_episodes_per_s'] or 0):>12.2f}"
                     f"{(m['steady_ratio_to_sync'] or 0):>7.2f}{m['busy_fraction']:>12.2f}"
                     f"{m['learner_busy_fraction']:>13.2f}{m['staleness_max']:>10}{m['episodes_dropped_stale']:>8}"
                     f"  {m['staleness_histogram']}")
    lines.append("steady: from the end of step L (max lag; sync: the first update) to the end of the last: an "
                 "asynchronous mode's first (1 + L) x B episodes all start under version 0, and steps 0..L wait "
                 "for that cohort")
    lines.append(f"dropped: episodes consumed more than L versions stale, not trained (stragglers="
                 f"{result['training']['stragglers']}; ep/s counts trained episodes only)")
    lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
