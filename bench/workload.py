"""The seeded benchmark workload: per-episode plans (turns, tokens, tool/init/grade times) and the ideal makespan."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from rollway.base.config import StrictModel

MARKER = "[sim-episode {index:05d}]"
"""Written into each sim task's prompt: the simulated model reads it to find the episode's plan."""
MARKER_BYTES = len(MARKER.format(index=0))
TOOL_CALL = '<tool_call>{{"name": "bash", "arguments": {{"command": "sim-exec {seconds:.3f} {out_bytes}"}}}}</tool_call>'
FINISH_CALL = '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'


class WorkloadConfig(StrictModel):
    """A scaled-down SWE-like rollout workload and the resources both modes get. Every duration is
    seconds of wall time; every distribution is lognormal (median, sigma) so a few draws are long."""


    seed: int = 0
    """Seed of the workload: episode k's plan depends only on (seed, k)."""
    episodes: int = Field(384, ge=1)
    """Episodes per mode: one RL step's batch (48 tasks x 8 samples, say). A rollout stream pays its
    start-up and drain once per run, not per batch; with fewer episodes here those one-off phases
    weigh more (docs/benchmarks.md compares 192 and 384 episodes)."""
    turns_median: float = Field(4.0, gt=0)
    """Median model turns per episode (the last one calls finish)."""
    turns_sigma: float = Field(0.4, ge=0)
    turns_max: int = Field(20, ge=1)
    """Turns are clipped to [2, turns_max]."""
    thought_tokens_median: float = Field(30.0, gt=0)
    """Completion tokens before the tool call (the tool call itself adds about 80 byte-tokens)."""
    thought_tokens_sigma: float = Field(0.6, ge=0)
    observation_bytes_median: float = Field(300.0, gt=0)
    """Bytes a tool call prints (the next prompt grows by that much)."""
    observation_bytes_sigma: float = Field(0.8, ge=0)
    prompt_bytes: int = Field(600, ge=0)
    """Task statement length (bytes, one token each in the byte-level chat format)."""
    tool_s_median: float = Field(0.1, ge=0)
    """Tool execution time per turn."""
    tool_s_sigma: float = Field(0.8, ge=0)
    init_s_median: float = Field(1.1, ge=0)
    """Sandbox start (container/repo copy) time."""
    init_s_sigma: float = Field(0.5, ge=0)
    grade_s_median: float = Field(1.1, ge=0)
    """Grading (test run) time."""
    grade_s_sigma: float = Field(0.5, ge=0)
    max_tail_s: float = Field(20.0, gt=0)
    """Every drawn duration is clipped here, so one freak draw cannot dominate a short benchmark."""
    resolve_rate: float = Field(0.4, ge=0, le=1)
    """Share of episodes that pass their tests (reward 1)."""
    estimate_sigma: float = Field(0.3, ge=0)
    """The scheduler knows a task's sandbox-start and grading times only as estimates (from earlier
    timed runs of the task): true time x lognormal(0, estimate_sigma). 0: exact."""
    order: Literal["given", "johnson", "ends"] = "ends"
    """Issue order of both modes (scheduler.order): `ends` orders the first burst and the final wave
    by the estimates, `johnson` the whole run, `given` keeps the plan's (seeded, shuffled) order."""
    # -- simulated inference server ---------------------------------------------------------
    step_base_s: float = Field(0.003, gt=0)
    """Decode step time a in a + b * active_sequences (memory-bound part of a GPU step)."""
    step_per_seq_s: float = Field(0.00005, ge=0)
    """Decode step time b per active sequence."""
    prefill_per_token_s: float = Field(0.000003, ge=0)
    """Extra step time per newly prefilled prompt token (prefix cache: only new tokens count)."""
    # -- resources (both modes) ---------------------------------------------------------------
    slots: int = Field(16, ge=1)
    """Concurrent sequences at the inference server: the baseline's slots, the pipeline's model calls
    at once (agent concurrency), and the server's cap."""
    tool_overlap: int = Field(16, ge=0)
    """Pipeline: turns the agent stage runs beyond `slots` (agent.tool_overlap, split over the agent
    workers): a turn holds a model-call slot only while it generates, so tool calls no longer keep
    server sequences idle. The server still runs at most `slots` sequences. Rule of thumb: slots x
    tool time / generation time, with margin; `slots` covers tool calls as long as generation
    (seed 0, tool_s_median=0.3: efficiency 0.854 with 8, 0.907 with 16). 0: a turn holds its slot
    through generation and tools, as a baseline slot does."""
    init_lookahead: int = Field(16, ge=0)
    """Pipeline: episodes initialised ahead of agent capacity (scheduler.init_lookahead). Rule of thumb:
    agent throughput (episodes/s) x (init time + scheduling delay), with margin for the long tail."""
    init_concurrency: int = Field(32, ge=1)
    """Pipeline: sandboxes started at once (init.concurrency)."""
    grade_concurrency: int = Field(12, ge=1)
    """Pipeline: gradings at once (reward.concurrency)."""
    final_wave: bool = True
    """Pipeline: scheduler.final_wave (start the last sandboxes early, within the bound, and run the
    newest episodes' turns first)."""
    episode_deadline_s: float = Field(120.0, gt=0)
    """Pipeline: an episode not graded this long after it was issued is re-issued once
    (scheduler.episode_deadline_s). Far above any planned episode's lifetime at the defaults, so it
    fires only if a message is stuck; the output counts re-issues as `episodes_retried`."""
    fetch_max_wait_ms: int = Field(10, ge=1)
    """Pipeline: broker.fetch_max_wait_ms of every consumer (the embedded broker answers a waiting
    fetch only when this expires, so it bounds each hop's delivery delay)."""
    agent_prefetch: int = Field(8, ge=0)
    """Pipeline: agent-steps an agent worker holds beyond its concurrency, to run later turns first."""

    model_call_slack: int = Field(2, ge=0)
    """Pipeline: model calls the agent may have outstanding beyond `slots` (added to
    agent.concurrency, split over the workers). The server still runs at most `slots` sequences and
    queues the rest, so a sequence that finishes is replaced at the next step boundary instead of
    after the agent's HTTP round trip, tool call bookkeeping and the next request (as a vLLM server
    with max_num_seqs queues what is beyond it). Pipeline-only runs, 2 against 0 (carry_over, loaded
    machine): seeds 0/1/2 efficiency 0.977/0.980/0.979 against 0.953/0.970/0.943, mean running
    sequences 15.7 against 15.0-15.5. 0: as many calls as the server's cap."""
    carry_over: bool = True
    """Measure a step of a stream, as an asynchronous trainer sees it: both modes get `sandbox_bound`
    more episodes (the next step's work, issued after these in the same order), and a mode's
    makespan ends when `episodes` of them are graded; episodes still running then carry over into
    the next step instead of being waited for (their staleness is what `rollway bench training`
    bounds). `ideal_makespan` is taken over the `episodes` the pipeline finished first. False: exactly
    `episodes` run, and the makespan includes their drain (long episodes issued last)."""

    @property
    def carried(self) -> int:
        """Episodes planned beyond `episodes` (the next step's, for carry_over)."""
        return self.sandbox_bound if self.carry_over else 0

    @property
    def sandbox_bound(self) -> int:
        """Most sandboxes the pipeline may hold at once: turns the agent runs at once (slots +
        model_call_slack + tool_overlap) + look-ahead + grading."""
        return self.slots + self.model_call_slack + self.tool_overlap + self.init_lookahead + self.grade_concurrency


@dataclass
class TurnPlan:
    completion_tokens: int
    """Tokens the model produces this turn, the stop token included."""
    tool_s: float
    observation_bytes: int
    text: str
    """The completion text (thoughts, then the tool call)."""


@dataclass
class EpisodePlan:
    index: int
    init_s: float
    grade_s: float
    resolved: bool
    prompt: str
    turns: list[TurnPlan]
    init_s_estimate: float = 0.0
    """What the scheduler is told init_s is (the task's expected_init_s)."""
    grade_s_estimate: float = 0.0

    @property
    def num_turns(self) -> int:
        return len(self.turns)


def _lognormal(rng: random.Random, median: float, sigma: float, cap: float) -> float:
    return min(cap, median * math.exp(rng.gauss(0.0, sigma))) if median > 0 else 0.0


def _turn(rng: random.Random, cfg: WorkloadConfig, last: bool) -> TurnPlan:
    thought = max(1, round(_lognormal(rng, cfg.thought_tokens_median, cfg.thought_tokens_sigma, 4096)))
    tool_s = _lognormal(rng, cfg.tool_s_median, cfg.tool_s_sigma, cfg.max_tail_s)
    out = max(1, round(_lognormal(rng, cfg.observation_bytes_median, cfg.observation_bytes_sigma, 3000)))
    call = FINISH_CALL if last else TOOL_CALL.format(seconds=tool_s, out_bytes=out)
    text = ("thinking " * (thought // 9 + 1))[:thought] + call
    return TurnPlan(len(text.encode()) + 1, 0.0 if last else round(tool_s, 3), 0 if last else out, text)


def plan_episode(cfg: WorkloadConfig, index: int) -> EpisodePlan:
    """Episode `index`'s plan, a pure function of (cfg, seed, index): never of timing or order."""
    rng = random.Random(f"rollway-bench:{cfg.seed}:{index}")
    turns = min(cfg.turns_max, max(2, round(_lognormal(rng, cfg.turns_median, cfg.turns_sigma, 1e9))))
    init_s = _lognormal(rng, cfg.init_s_median, cfg.init_s_sigma, cfg.max_tail_s)
    grade_s = _lognormal(rng, cfg.grade_s_median, cfg.grade_s_sigma, cfg.max_tail_s)
    resolved = rng.random() < cfg.resolve_rate
    prompt = MARKER.format(index=index) + " Fix the failing test. " + "x" * cfg.prompt_bytes
    plan = EpisodePlan(index, round(init_s, 3), round(grade_s, 3), resolved, prompt,
                       [_turn(rng, cfg, last=t == turns - 1) for t in range(turns)])
    noise = random.Random(f"rollway-bench-estimate:{cfg.seed}:{index}")  # own stream: the plan stays the same
    plan.init_s_estimate = round(plan.init_s * math.exp(noise.gauss(0.0, cfg.estimate_sigma)), 3)
    plan.grade_s_estimate = round(plan.grade_s * math.exp(noise.gauss(0.0, cfg.estimate_sigma)), 3)
    return plan


def plan_workload(cfg: WorkloadConfig) -> list[EpisodePlan]:
    return [plan_episode(cfg, i) for i in range(cfg.episodes)]


def write_plans(plans: list[EpisodePlan], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in plans))


def read_plans(path: str | Path) -> list[EpisodePlan]:
    plans = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            raw = json.loads(line)
            raw["turns"] = [TurnPlan(**t) for t in raw["turns"]]
            plans.append(EpisodePlan(**raw))
    return plans


# -- the lower bound --------------------------------------------------------------------------
def ideal_makespan(plans: list[EpisodePlan], cfg: WorkloadConfig,
                   partial: Sequence[EpisodePlan] = ()) -> dict[str, float]:
    """A true lower bound on the pipeline's makespan for these plans and resources.

    `partial`: work done in the same window by episodes that carry over (carry_over): each one's
    sandbox start and the turns it completed, as a plan cut to those turns. The terms above stay
    over `plans`; beside them `*_with_carried` terms take the server, slot and init sums over both
    without the final min G (carried turns may run during the batch's last grading), from the
    shortest start of either.

    With a = step_base_s, b = step_per_seq_s, p = prefill_per_token_s, C = slots (the server's cap and
    the agent's model calls at once), H = C + tool_overlap (turns the agent runs at once), for turn j
    of episode e with k tokens, q new prompt tokens (at least the observation bytes; the first turn at
    least the task text after its marker, since prefix caching shares the system prompt, the tool list
    and whole blocks up to where episodes' markers differ) and tool time x:
      gen_min = k (a + b) + p q        a decode step with >= 1 sequence lasts >= a + b
      turn_min = gen_min + x           a turn runs its generation, then its tool call
      T_e = sum of turn_min;  path_e = I_e + T_e + G_e (init, turns, grading, in sequence)
    and the bound is the largest of
      critical path   max_e path_e
      inference       min I + [sum k (a + b C) / C + p sum q] + min G   (a step serves <= C sequences;
                      nothing generates before the first sandbox exists, the last turn is then graded)
      model slots     min I + sum gen_min / C + min G    (a model-call slot is held while generating)
      turn slots      min I + sum turn_min / H + min G   (a turn holds one of H for generation and tool)
      joint           min I + min G + min over S >= K/C of
                      max(a S + b K + p Q, (a K + b K^2/S + p Q) / C, (a K + b K^2/S + p Q + X) / H)
                      with K = sum k, Q = sum q, X = sum x: if the server runs S steps (n_t sequences in
                      step t, sum n_t = K) it is busy sum (a + b n_t) + p Q = a S + b K + p Q, while the
                      model-call slots hold generation for sum n_t (a + b n_t) >= a K + b K^2 / S
                      (Cauchy-Schwarz) plus each turn's prefill, and the turn slots that plus tool time
      init            sum I / init_concurrency + min_e (T_e + G_e)
      grading         min_e (I_e + T_e) + sum G / grade_concurrency
    The baseline runs the same turns through C slots (C <= H), so every term but init and grading
    bounds it too.
    """
    agent_s = [sum(_turn_min(e, j, cfg) for j in range(e.num_turns)) for e in plans]
    paths = [e.init_s + t + e.grade_s for t, e in zip(agent_s, plans, strict=True)]
    min_i, min_g = min(e.init_s for e in plans), min(e.grade_s for e in plans)
    bounds = {
        "critical_path": max(paths),
        **_work_bounds(plans, cfg, min_i + min_g),
        "init": sum(e.init_s for e in plans) / cfg.init_concurrency
        + min(t + e.grade_s for t, e in zip(agent_s, plans, strict=True)),
        "grading": min(e.init_s + t for t, e in zip(agent_s, plans, strict=True))
        + sum(e.grade_s for e in plans) / cfg.grade_concurrency,
    }
    if partial:  # carried work may run during the last grading: no min G after it
        first = min(e.init_s for e in [*plans, *partial])
        bounds.update({f"{k}_with_carried": v for k, v in _work_bounds([*plans, *partial], cfg, first).items()})
        bounds["init_with_carried"] = sum(e.init_s for e in [*plans, *partial]) / cfg.init_concurrency
    return {"ideal_makespan": max(bounds.values()), "bottleneck": max(bounds, key=bounds.get), **bounds}


def _prefill_q(e: EpisodePlan, j: int) -> int:
    return len(e.prompt.encode()) - MARKER_BYTES if j == 0 else e.turns[j - 1].observation_bytes


def _turn_min(e: EpisodePlan, j: int, cfg: WorkloadConfig) -> float:
    t = e.turns[j]
    return t.completion_tokens * (cfg.step_base_s + cfg.step_per_seq_s) + cfg.prefill_per_token_s * _prefill_q(e, j) \
        + t.tool_s


def _work_bounds(episodes: Sequence[EpisodePlan], cfg: WorkloadConfig, fill: float) -> dict[str, float]:
    """The inference, model-slot, turn-slot and joint terms of `ideal_makespan` over these
    episodes' turns, plus `fill` (time no turn can run: before the first sandbox, after the last)."""
    a, b, p, c = cfg.step_base_s, cfg.step_per_seq_s, cfg.prefill_per_token_s, cfg.slots
    h = c + cfg.tool_overlap
    tokens = prefill = gen_work = tool_work = 0.0
    for e in episodes:
        for j, t in enumerate(e.turns):
            q = _prefill_q(e, j)
            tokens, prefill = tokens + t.completion_tokens, prefill + q
            gen_work += t.completion_tokens * (a + b) + p * q
            tool_work += t.tool_s
    return {
        "inference": fill + tokens * (a + b * c) / c + p * prefill,
        "model_slots": fill + gen_work / c,
        "turn_slots": fill + (gen_work + tool_work) / h,
        "joint": fill + joint_bound(a, b, p * prefill, tokens, tool_work, c, h),
    }


def joint_bound(a: float, b: float, prefill_s: float, k: float, x: float, c: int, h: int) -> float:
    """min over S >= k/c of max(server(S), model_slots(S), turn_slots(S)). server(S) grows with S and
    both slot terms shrink, so the minimum is at S = k/c or where the server meets the larger slot
    term: at the later of its two crossings (each the positive root of a quadratic in S)."""
    def server(s: float) -> float:
        return a * s + b * k + prefill_s

    def slots(s: float, extra: float, n: int) -> float:
        return (a * k + b * k * k / s + prefill_s + extra) / n

    def crossing(extra: float, n: int) -> float:  # a S + b k + P = (a k + b k^2 / S + P + extra) / n
        qa, qb, qc = a * n, b * k * n + prefill_s * n - a * k - prefill_s - extra, -b * k * k
        return (-qb + math.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa)

    s = max(k / c, crossing(0.0, c), crossing(x, h))
    return max(server(s), slots(s, 0.0, c), slots(s, x, h))


def workload_summary(plans: list[EpisodePlan]) -> dict[str, float]:
    """Means of the drawn plan, for the report."""
    n = len(plans)
    turns = [t for e in plans for t in e.turns]
    return {"episodes": n, "turns_mean": sum(e.num_turns for e in plans) / n,
            "init_s_mean": sum(e.init_s for e in plans) / n, "grade_s_mean": sum(e.grade_s for e in plans) / n,
            "tool_s_mean": sum(t.tool_s for t in turns) / len(turns),
            "completion_tokens_mean": sum(t.completion_tokens for t in turns) / len(turns)}
