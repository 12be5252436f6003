"""A simulated GPU inference server speaking the OpenAI completions API, with its own utilisation record."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from rollway.bench.workload import EpisodePlan, WorkloadConfig, read_plans
from rollway.policies.base import count_subsequence
from rollway.policies.chat import IM_END, BytesChatML
from rollway.policies.openai_client import VERSION_HEADER

SIM_LOGPROB = -0.05
MARKER_RE = re.compile(rb"\[sim-episode (\d+)\]")


BLOCK_TOKENS = 16
"""KV-cache block size (vLLM's default): prefixes are shared across requests in whole blocks."""


class PrefixCache:
    """vLLM's automatic prefix caching, in simulation. Across requests, a prompt reuses the longest
    run of whole blocks some earlier request prefilled (chained block hashes, as vLLM keys them): the
    system prompt and tool list every episode shares is prefilled once per run, not once per episode.
    Within an episode, the next turn's prompt reuses the previous prompt and completion to the token.
    Nothing is evicted (the simulated GPU's KV memory is taken to be ample)."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.episodes: dict[int, int] = {}
        """Episode -> tokens of its last prompt and completion, cached."""

    def prefill(self, episode: int, prompt_ids: list[int]) -> int:
        """Prompt tokens this request must prefill; its prompt's whole blocks are cached from now on."""
        cached = self.episodes.get(episode, 0)
        if cached:  # a later turn: its prefix is the episode's own earlier prompt and completion
            return max(0, len(prompt_ids) - cached)
        shared, key, hit = 0, 0, True
        for start in range(0, len(prompt_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            key = hash((key, *prompt_ids[start:start + BLOCK_TOKENS]))
            if hit and key in self.blocks:
                shared += BLOCK_TOKENS
            else:
                hit = False
                self.blocks.add(key)
        return len(prompt_ids) - shared

    def finished(self, episode: int, tokens: int) -> None:
        self.episodes[episode] = tokens

    def reset(self) -> int:
        """Forget everything; returns the episodes forgotten."""
        dropped = len(self.episodes)
        self.episodes.clear()
        self.blocks.clear()
        return dropped


@dataclass
class _Request:
    episode: int
    token_ids: list[int]
    prompt_ids: list[int]
    done: asyncio.Future
    arrived: float
    prefill_tokens: int = 0
    """Prompt tokens not found in the prefix cache when it was admitted."""
    produced: int = 0
    admitted: float = 0.0
    """Simulated time of the step boundary it joined at."""
    version: int = 0
    """The policy version served when it was admitted (its first token's weights)."""
    finished: float = 0.0
    """Simulated time its last token was produced."""


@dataclass
class SimEngine:
    """Continuous batching in simulation: every step serves all running sequences one token and lasts
    a + b * running + p * newly_prefilled_tokens seconds; at most `cap` sequences run, the rest wait.
    The completion of turn k of episode e is the plan's text, so episodes are reproducible."""

    plans: dict[int, EpisodePlan]
    a: float
    b: float
    p: float
    cap: int
    instant: bool = False
    """Zero-latency engine (the framework-ceiling benchmark): answer at once, no steps."""
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    """(start, end, running sequences) of every step, wall-clock seconds."""
    cache: PrefixCache = field(default_factory=PrefixCache)
    """Prefix caching: only prompt tokens not yet in the KV cache are prefilled."""
    requests: int = 0
    step_prefill: int = 0
    """Prompt tokens admitted at the current step's start (they lengthen that step)."""
    pauses: list = field(default_factory=list)
    """(start, end, version) of every weight-sync pause, wall-clock seconds: no step starts inside
    one, and from its end the engine serves `version` (reported per response, as rollway's engines
    and `policies/cpu_engine.py` do in the X-Policy-Version header)."""
    request_log: list = field(default_factory=list)
    """(arrived, admitted, finished, answered, prefilled) of every request: wall-clock seconds (the
    engine's queueing is admitted - arrived, how late the answer leaves after its last step is
    answered - finished) and the prompt tokens it prefilled."""

    def __post_init__(self) -> None:
        self.chat = BytesChatML()
        self.wake = asyncio.Event()

    def completion_ids(self, prompt_ids: list[int]) -> tuple[int, list[int]]:
        match = MARKER_RE.search(bytes(t for t in prompt_ids[:8192] if t < 256))
        if match is None:
            raise ValueError("prompt has no [sim-episode N] marker: the sim server only plays sim tasks")
        plan = self.plans[int(match.group(1))]
        turn = max(0, count_subsequence(prompt_ids, self.chat.assistant_header_ids) - 1)
        text = plan.turns[min(turn, plan.num_turns - 1)].text
        return plan.index, [*self.chat.encode(text), IM_END]

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str, int]:
        """The planned completion, its finish reason and the policy version it was admitted under."""
        episode, ids = self.completion_ids(prompt_ids)
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        if self.instant:
            self.requests += 1
            return ids, finish, self.version_at(time.time())
        req = _Request(episode, ids, prompt_ids, asyncio.get_running_loop().create_future(), time.time())
        self.waiting.append(req)
        self.requests += 1
        self.wake.set()
        await req.done
        self.request_log.append((req.arrived, req.admitted, req.finished, time.time(), req.prefill_tokens))
        return ids, finish, req.version

    def reset_cache(self) -> int:
        """Forget every cached prefix and go back to policy version 0 (a new run starts cold: the
        benchmark's modes replay the same episodes, and the second must not find the first's prompts
        cached). Returns episodes dropped."""
        self.pauses.clear()
        return self.cache.reset()

    def pause(self, seconds: float, version: int | None = None) -> tuple[float, float, int]:
        """A weight sync: steps that would start in the next `seconds` wait for its end (sequences in
        flight keep their KV cache and go on with the new weights, as an in-flight update does).
        From its end the engine serves `version` (default: one more than before)."""
        start = time.time()
        if version is None:
            version = (self.pauses[-1][2] if self.pauses else 0) + 1
        self.pauses.append((start, start + max(0.0, seconds), version))
        self.wake.set()
        return self.pauses[-1]

    def version_at(self, t: float) -> int:
        """The policy version served at time `t`: that of the last pause ended by then."""
        for _start, end, version in reversed(self.pauses):
            if end <= t:
                return version
        return 0

    def _paused_until(self, vt: float) -> float | None:
        for start, end, _version in reversed(self.pauses):
            if start <= vt < end:
                return end
            if end <= vt:
                return None
        return None

    async def run(self) -> None:
        """Steps run on a simulated clock `vt`: whenever the loop wakes it replays every step that has
        ended by now, so a late wake-up under CPU load delays answers a little but never slows the
        simulated GPU down (its throughput follows the model exactly)."""
        vt = time.time()
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                vt = max(vt, time.time())
            vt = self._catch_up(vt, time.time())
            self.wake.clear()
            try:  # sleep to the next finish (or a little); an arrival to an idle engine wakes us early
                await asyncio.wait_for(self.wake.wait(), timeout=max(0.0, self._next_event(vt) - time.time()))
            except TimeoutError:
                pass

    def _admit(self, vt: float) -> None:
        """At a step boundary, requests that arrived by then join (up to the cap)."""
        while self.waiting and len(self.running) < self.cap and self.waiting[0].arrived <= vt:
            req = self.waiting.popleft()
            req.admitted, req.version = vt, self.version_at(vt)
            req.prefill_tokens = self.cache.prefill(req.episode, req.prompt_ids)
            self.step_prefill += req.prefill_tokens
            self.running.append(req)

    def _step_s(self) -> float:
        return self.a + self.b * len(self.running) + self.p * self.step_prefill

    def _catch_up(self, vt: float, now: float) -> float:
        while True:
            resume = self._paused_until(vt)
            if resume is not None:
                if resume > now:
                    return vt
                vt = resume
            self._admit(vt)
            if not self.running:
                if not self.waiting or self.waiting[0].arrived > now:
                    return max(vt, now) if not self.waiting else vt
                vt = max(vt, self.waiting[0].arrived)  # idle until the next arrival
                continue
            dt = self._step_s()
            if vt + dt > now:
                return vt
            self._finish_step(vt, vt + dt)
            vt += dt

    def _finish_step(self, start: float, end: float) -> None:
        self.steps.append((start, end, len(self.running)))
        self.step_prefill = 0
        for req in self.running:
            req.produced += 1
            if req.produced >= len(req.token_ids):
                req.finished = end
                self.cache.finished(req.episode, len(req.prompt_ids) + len(req.token_ids))
                req.done.set_result(None)
        self.running = [r for r in self.running if r.produced < len(r.token_ids)]

    def _next_event(self, vt: float) -> float:
        """When to look again: the first running sequence's finish at the current step time, but at
        least every 20 ms (arrivals change the batch and so the step time)."""
        if not self.running:
            return vt + 0.001
        left = min(len(r.token_ids) - r.produced for r in self.running)
        return vt + min(0.02, left * self._step_s())


def busy_stats(steps: list[tuple[float, float, int]], t0: float, t1: float, cap: int) -> dict[str, float]:
    """Over [t0, t1]: share of wall time with >= 1 running sequence, and mean running sequences."""
    busy = active = 0.0
    for s, e, n in steps:
        overlap = max(0.0, min(e, t1) - max(s, t0))
        busy += overlap
        active += overlap * n
    span = max(t1 - t0, 1e-9)
    return {"busy_fraction": busy / span, "mean_active_sequences": active / span,
            "mean_active_fraction_of_cap": active / span / cap}


def build_app(engine: SimEngine) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return web.json_response({"error": {"message": "prompt must be a list of token ids"}}, status=400)
        ids, finish, version = await engine.generate(prompt, int(body.get("max_tokens", 256)))
        return web.json_response(headers={VERSION_HEADER: str(version)}, data={
            "object": "text_completion", "model": body.get("model", "sim"),
            "choices": [{"index": 0, "text": engine.chat.decode(ids), "token_ids": ids, "finish_reason": finish,
                         "logprobs": {"token_logprobs": [SIM_LOGPROB] * len(ids)}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}, "policy_version": version})

    async def steps(request: web.Request) -> web.Response:
        t0, t1 = float(request.query.get("t0", 0)), float(request.query.get("t1", 1e18))
        return web.json_response({"cap": engine.cap, "requests": engine.requests,
                                  "steps": [s for s in engine.steps if s[1] >= t0 and s[0] <= t1],
                                  "request_log": [r for r in engine.request_log if t0 <= r[0] <= t1],
                                  "prefill_tokens": sum(r[4] for r in engine.request_log if t0 <= r[0] <= t1),
                                  "pauses": [p for p in engine.pauses if p[1] >= t0 and p[0] <= t1]})

    async def reset(request: web.Request) -> web.Response:
        return web.json_response({"dropped": engine.reset_cache()})

    async def pause(request: web.Request) -> web.Response:
        version = request.query.get("version")
        start, end, version = engine.pause(float(request.query.get("seconds", 0)),
                                           int(version) if version is not None else None)
        return web.json_response({"start": start, "end": end, "version": version})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim", "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def run_engine(app: web.Application):
        task = asyncio.create_task(engine.run())
        yield
        task.cancel()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes([web.post("/v1/completions", completions), web.get("/sim/steps", steps), web.get("/v1/models", models),
                    web.get("/health", health), web.post("/sim/reset", reset), web.post("/sim/pause", pause)])
    app.cleanup_ctx.append(run_engine)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="Simulated inference server for `rollway bench pipeline`.")
    parser.add_argument("--plans", required=True, help="plans file written by the benchmark")
    parser.add_argument("--workload", required=True, help="WorkloadConfig as JSON")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--instant", action="store_true", help="zero-latency engine: answer at once, no steps")
    args = parser.parse_args()
    cfg = WorkloadConfig.model_validate(json.loads(args.workload))
    plans = {p.index: p for p in read_plans(Path(args.plans))}
    engine = SimEngine(plans, cfg.step_base_s, cfg.step_per_seq_s, cfg.prefill_per_token_s, cfg.slots,
                       instant=args.instant)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(build_app(engine), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
