"""`rollway bench gateway`: the time the gateway adds to a model call, against calling the engine directly.

An in-process engine that answers at once (a fixed short reply) sits behind the gateway; each episode
is a program that sends a long first prompt (`--prompt-tokens`), then extends it call after call with
a tool result, as agent programs do. Measured per call, from the request's bytes leaving the client to
its response parsed: through the gateway (render, engine, capture, record, HTTP) and the engine alone
on the same prompts. Reported as p50/p99 over the continued calls (incremental rendering) and over the
first calls (a full render) for 1 and 64 concurrent episodes, with the in-memory recorder (the
gateway's own cost) and the Kafka recorder on an embedded broker (adds the log's acknowledgement), for
each API (`--apis`: chat completions, Responses, Anthropic Messages) side by side. With `--tool-ms` the
programs wait between calls as agents do while a tool runs, so the episodes' calls stop arriving together.
Each row also gives the time a call waited to be recorded (p50/p99 over all its calls): the part of the
added time that is the log's acknowledgement. With `--plain-server` each row also times the same programs
against a plain HTTP server in the same process that parses each request and answers from the same engine
(no rendering, capture or record): the part of the added time any HTTP server in Python costs on the machine."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from asyncio.subprocess import PIPE
from typing import Any

from rollway.base.figures import dumps
from rollway.base.loop import run_async
from rollway.policies.base import ChatFormat, Generation, InferenceClient, SamplingParams
from rollway.policies.chat import BytesChatML
from rollway.schemas.messages import EpisodeKey

REPLY = "Ran the command; the next step follows."
TOOL_OUTPUT = "x" * 48  # about 64 tokens with its chat markup


class ZeroLatencyEngine(InferenceClient):
    """Answers every prompt with the same reply: at once (no model, no sleep), or after `latency_s` of waiting
    that costs this process nothing (a real engine's time is spent on its own device)."""

    def __init__(self, latency_s: float = 0.0, chat: ChatFormat | None = None) -> None:
        self.chat = chat or BytesChatML()
        self.reply = self.chat.encode(REPLY) + list(self.chat.stop_token_ids)
        self.latency_s = latency_s

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.latency_s:
            # uvloop's timers count whole milliseconds: a sleep woken by another call's event can end up to
            # 1 ms early, so wait on this clock until the time is really spent
            deadline = time.perf_counter() + self.latency_s
            while (left := deadline - time.perf_counter()) > 0:
                await asyncio.sleep(left)
        return Generation(list(self.reply), [-0.1] * len(self.reply), "stop", 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--episodes", default="1,64", help="concurrent episodes (comma list)")
    parser.add_argument("--prompt-tokens", default="1024,16384", help="first-prompt lengths in tokens (comma list)")
    parser.add_argument("--calls", type=int, default=8, help="calls per episode (the first renders in full)")
    parser.add_argument("--recorders", default="memory,kafka", help="memory, kafka (an embedded broker) or both")
    parser.add_argument("--apis", default="chat,responses,messages", help="chat, responses, messages (comma list)")
    parser.add_argument("--engine-ms", default="0", help="the engine's time per call in ms (comma list); 0: answers at "
                        "once, so every program always has a call in flight and the gateway runs saturated (its "
                        "capacity); a real engine's time (hundreds of ms) gives the latency a program sees")
    parser.add_argument("--tool-ms", default="0", help="the programs' time between a response and their next call in ms "
                        "(comma list), drawn per call uniformly from 0 to twice it, as a tool's run varies; 0, the "
                        "default, keeps the episodes' calls in step (with --engine-ms, all of them arrive together: "
                        "the worst case); a real agent's tool time spreads them")
    parser.add_argument("--chat-formats", default="smollm2", help="the chat formats the gateway renders with "
                        "(comma list): smollm2 (the bundled model's tokenizer and template, as a run uses them) "
                        "and/or bytes (one token per byte, no tokenizer: the gateway's cost without tokenising)")
    parser.add_argument("--plain-server", action="store_true", help="also time the same programs against a plain "
                        "HTTP server that parses each request and answers from the same engine, without the gateway's "
                        "rendering, capture and record (each setting then takes twice as long): the part of the added "
                        "time that is HTTP and the machine's other processes, not the gateway")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    try:
        episodes = [int(x) for x in args.episodes.split(",")]
        lengths = [int(x) for x in args.prompt_tokens.split(",")]
        recorders = [r.strip() for r in args.recorders.split(",") if r.strip()]
        apis = [a.strip() for a in args.apis.split(",") if a.strip()]
        engine_ms = [float(x) for x in args.engine_ms.split(",")]
        tool_ms = [float(x) for x in args.tool_ms.split(",")]
        formats = [f.strip() for f in args.chat_formats.split(",") if f.strip()]
        if not formats or not set(formats) <= {"smollm2", "bytes"}:
            raise ValueError
        if not all(math.isfinite(x) and x >= 0 for x in (*engine_ms, *tool_ms)) or min(episodes) < 1 or min(lengths) < 64 or args.calls < 2 or not set(recorders) <= {"memory", "kafka"} \
                or not apis or not set(apis) <= set(_REQUESTS):
            raise ValueError
    except ValueError:
        print("rollway bench gateway: --episodes and --prompt-tokens are comma lists of positive integers "
              "(prompts of 64 tokens or more), --calls at least 2, --recorders memory and/or kafka, --apis chat, "
              "responses and/or messages, --engine-ms and --tool-ms comma lists of milliseconds (0 or more), "
              "--chat-formats smollm2 "
              "and/or bytes", file=sys.stderr)
        return 2
    result = run_async(measure_all(episodes, lengths, args.calls, recorders, apis, engine_ms, formats, tool_ms,
                                   args.plain_server))
    print(dumps(result) if args.json else format_text(result))
    return 0


def _chat_format(name: str) -> ChatFormat:
    if name == "bytes":
        return BytesChatML()
    from rollway.policies.hf_chat import HFChatFormat
    from rollway.policies.model_loading import load_tokenizer

    return HFChatFormat(load_tokenizer())


async def measure_all(episodes: list[int], lengths: list[int], calls: int, recorders: list[str],
                      apis: tuple[str, ...] | list[str] = ("chat",), engine_ms: list[float] | None = None,
                      formats: tuple[str, ...] | list[str] = ("bytes",),
                      tool_ms: list[float] | None = None, plain: bool = False) -> dict[str, Any]:
    rows = []
    for fmt in formats:
        chat = await asyncio.to_thread(_chat_format, fmt)
        gc.freeze()  # as a stage worker does after its setup (runtime.faust)
        for name in recorders:
            async with _recorder(name) as recorder:
                for ms in engine_ms or [0.0]:
                    for tool in tool_ms or [0.0]:
                        for n in episodes:
                            for tokens in lengths:
                                for api in apis:
                                    rows.append({"chat_format": fmt, "recorder": name, "api": api, "engine_ms": ms,
                                                 "tool_ms": tool, "episodes": n, "prompt_tokens": tokens,
                                                 **await measure(recorder, n, tokens, calls, api, ms / 1000, chat,
                                                                 tool / 1000)})
        if plain:  # after every gateway setting of the format, so that the gateway's are taken exactly as without it
            ours = [r for r in rows if r["chat_format"] == fmt]
            summaries = {}
            for setting in dict.fromkeys(map(_setting, ours)):  # each setting once, whatever the recorders
                api, ms, tool, n, tokens = setting
                summaries[setting] = await measure_plain(n, tokens, calls, api, ms / 1000, chat, tool / 1000)
            for row in ours:
                row["plain_continued"] = summaries[_setting(row)]
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return {"engine": "in-process, a fixed reply after engine_ms", "event_loop": loop, "calls_per_episode": calls,
            "cores": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2), "rows": rows,
            "target": "added p50 <= 5 ms on continued calls with 16k-token histories"}


def _setting(row: dict[str, Any]) -> tuple[str, float, float, int, int]:
    """A row's setting apart from its format and recorder: (api, engine_ms, tool_ms, episodes, prompt_tokens)."""
    return row["api"], row["engine_ms"], row["tool_ms"], row["episodes"], row["prompt_tokens"]


class _recorder:
    """The recorder by name; the Kafka one on its own embedded broker, stopped on exit."""

    def __init__(self, name: str):
        self.name, self.broker, self.recorder = name, None, None

    async def __aenter__(self) -> Any:
        from rollway.gateway import KafkaRecorder

        if self.name == "memory":
            self.recorder = _Discarding()
            return self.recorder
        from rollway.base.broker import BrokerConfig, TopicsConfig
        from rollway.runtime.broker import EmbeddedBroker

        self.broker = await asyncio.to_thread(EmbeddedBroker(0).start)
        self.recorder = await KafkaRecorder.connect(BrokerConfig(), TopicsConfig(prefix="bench-"), self.broker.bootstrap)
        return self.recorder

    async def __aexit__(self, *exc: object) -> None:
        await self.recorder.close()
        if self.broker is not None:
            self.broker.stop()


class _Discarding:
    """An in-memory recorder that keeps nothing (the gateway's own cost, without the log's)."""

    async def record(self, call: Any) -> None:
        return None

    async def close(self) -> None:
        return None


async def measure(recorder: Any, episodes: int, prompt_tokens: int, calls: int, api: str = "chat",
                  latency_s: float = 0.0, chat: ChatFormat | None = None, tool_s: float = 0.0) -> dict[str, Any]:
    """One setting: the episodes' programs run in client processes of their own (so their JSON work
    does not queue behind the gateway's in one event loop), waiting about `tool_s` between calls; the
    engine alone is timed here on the same prompts afterwards."""
    from rollway.gateway import Gateway

    engine = ZeroLatencyEngine(latency_s, chat)
    timed = _TimedRecorder(recorder)
    gateway = Gateway(engine, engine.chat, timed)
    await gateway.start()
    try:
        await _run_clients(gateway, 1, _filler(engine.chat, 256), 2, api, 0.0)  # warm-up: connections, code paths
        filler = await asyncio.to_thread(_filler, engine.chat, prompt_tokens)
        timed.seconds.clear()
        cpu = time.process_time()
        handles, timings, wall = await _run_clients(gateway, episodes, filler, calls, api, tool_s)
        cpu = time.process_time() - cpu
    finally:
        await gateway.stop()
    direct = await _direct_timings(engine, handles, calls, tool_s)
    first = [(t[0], d) for t, d in zip(timings, direct, strict=True)]
    later = [(x, d) for t, d in zip(timings, direct, strict=True) for x in t[1:]]
    total = episodes * calls
    # CPU of this process (the gateway, its recorder's client, the engine) per call: what bounds the
    # calls/s one gateway process serves, whatever the machine's other load.
    recorded = sorted(timed.seconds)
    return {"continued": _summary(later), "first_call": _summary(first), "calls_per_s": round(total / wall, 1),
            "gateway_cpu_ms_per_call": _ms(cpu / total),
            "record_p50_ms": _ms(_pct(recorded, 50)), "record_p99_ms": _ms(_pct(recorded, 99))}


async def measure_plain(episodes: int, prompt_tokens: int, calls: int, api: str, latency_s: float, chat: ChatFormat,
                        tool_s: float) -> dict[str, float]:
    """The same programs (the same prompts and tool times) against a plain HTTP server on the same engine:
    the continued calls' summary, as `measure` gives the gateway's."""
    engine = ZeroLatencyEngine(latency_s, chat)
    server = _PlainServer(engine, api)
    await server.start()
    try:
        await _run_clients(server, 1, _filler(engine.chat, 256), 2, api, 0.0)
        filler = await asyncio.to_thread(_filler, engine.chat, prompt_tokens)
        handles, timings, _ = await _run_clients(server, episodes, filler, calls, api, tool_s)
    finally:
        await server.stop()
    direct = await _direct_timings(engine, handles, calls, tool_s)
    return _summary([(x, d) for t, d in zip(timings, direct, strict=True) for x in t[1:]])


class _PlainServer:
    """An HTTP server with none of the gateway's work: it reads and parses each request (as any server of the
    API does), waits for the engine and answers with the engine's reply text in the API's shape. The programs
    reach it as they reach the gateway (`open_episode(...).base_url`), so what they see of it is the time
    HTTP and the machine's other processes add, with nothing rendered, captured or recorded."""

    def __init__(self, engine: ZeroLatencyEngine, api: str):
        self.engine, self.api, self.runner, self.url = engine, api, None, ""

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/" + _REQUESTS[self.api][0], self._serve)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

    async def stop(self) -> None:
        await self.runner.cleanup()

    def open_episode(self, episode: EpisodeKey) -> Any:
        return argparse.Namespace(base_url=self.url)

    async def close_episode(self, handle: Any) -> None:
        return None

    async def _serve(self, request: Any) -> Any:
        from aiohttp import web

        json.loads(await request.read())
        await self.engine.generate([0] * 16, SamplingParams())
        if self.api == "responses":
            body = {"object": "response", "status": "completed", "output": [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": REPLY}]}]}
        elif self.api == "messages":
            body = {"type": "message", "role": "assistant", "content": [{"type": "text", "text": REPLY}]}
        else:
            body = {"object": "chat.completion", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": REPLY}}]}
        return web.json_response(body)


class _TimedRecorder:
    """The recorder with each call's time to be recorded kept (`seconds`): with the Kafka recorder, the log's
    acknowledgement, which every call waits for before its answer (a share of its added time)."""

    def __init__(self, inner: Any):
        self.inner, self.seconds = inner, []

    async def record(self, call: Any) -> None:
        start = time.perf_counter()
        try:
            await self.inner.record(call)
        finally:
            self.seconds.append(time.perf_counter() - start)


FILLER = ("Traceback (most recent call last):\n  File \"src/app/models.py\", line 218, in save\n"
          "    self.full_clean(exclude=exclude)\nValueError: the field 'name' must not be empty; got ''\n")


def _filler(chat: ChatFormat, tokens: int) -> str:
    """Text of about `tokens` tokens in `chat` less the markup (log-like lines, as a first prompt holds)."""
    per = max(1, len(chat.encode(FILLER)))
    return (FILLER * (max(1, tokens - 40) // per + 1))[: max(1, (tokens - 40) * len(FILLER) // per)]


EPISODES_PER_CLIENT = 8
"""Programs per client process. Real programs are processes of their own; 64 in one event loop queued
behind each other's JSON work (about 0.5 ms a call with a 16k-token history), which the bench then
counted as the gateway's time (p50 5-7 ms instead of 2-3 at 64 episodes in step)."""


async def _run_clients(gateway: Any, episodes: int, filler: str, calls: int,
                       api: str, tool_s: float) -> tuple[list, list, float]:
    """The programs of `episodes` episodes, EPISODES_PER_CLIENT to a client process, all started at once:
    their handles, each episode's call timings, and the seconds from the first request to the last answer."""
    handles = [gateway.open_episode(EpisodeKey(episode_id=f"e{i}", group_id="bench", task_id="bench"))
               for i in range(episodes)]

    async def start(first: int, urls: list[str]) -> Any:
        spec = json.dumps({"urls": urls, "first": first, "filler": filler, "calls": calls, "api": api,
                           "tool_s": tool_s})
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "rollway.bench.gateway", stdin=PIPE,
                                                    stdout=PIPE, stderr=PIPE)
        proc.stdin.write(spec.encode() + b"\n")
        if await proc.stdout.readline() != b"ready\n":  # imported and connected: the programs start together
            await finish(proc)  # raises with its error output
            raise RuntimeError("the bench's client process ended before it was ready")
        return proc

    async def finish(proc: Any) -> dict[str, Any]:
        out, err = await proc.communicate(b"go\n" if proc.returncode is None else None)
        if proc.returncode != 0:
            raise RuntimeError(f"the bench's client process failed: {err.decode()[-2000:]}")
        return json.loads(out)

    n = -(-episodes // EPISODES_PER_CLIENT)
    started = [asyncio.ensure_future(start(i * EPISODES_PER_CLIENT, [h.base_url for h in handles[i::n]]))
               for i in range(n)]
    try:
        procs = await asyncio.gather(*started)
        results = await asyncio.gather(*(finish(proc) for proc in procs))
    finally:  # a client that failed leaves none of the others waiting for their go
        for task in started:
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None and task.result().returncode is None:
                task.result().kill()
    timings: list[Any] = [None] * episodes
    for i, result in enumerate(results):
        timings[i::n] = result["timings"]
    for handle in handles:
        await gateway.close_episode(handle)
    return handles, timings, max(result["wall_s"] for result in results)


async def _direct_timings(engine: ZeroLatencyEngine, handles: list[Any], calls: int, tool_s: float = 0.0) -> list[float]:
    """The engine alone, once per episode (median of `calls` calls each); the episodes side by side, as the
    engine's time does not depend on the prompt's content or on other calls (64 episodes of 4 calls at 500
    ms took 128 s one after another), and a tool's time apart as the programs' calls are: the engine's timer
    overshoots by another amount when 64 end in the same millisecond (0.1-1 ms at the median, by where that
    millisecond falls) than when they are spread (about 0.2 ms), so a baseline timed in step would take the
    wrong amount out of calls that were not."""

    async def one(rng: random.Random) -> float:
        times = []
        for i in range(calls):
            if i and tool_s:
                await asyncio.sleep(rng.uniform(0, 2 * tool_s))
            start = time.perf_counter()
            await engine.generate([0] * 16, SamplingParams())
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return list(await asyncio.gather(*(one(random.Random(i)) for i in range(len(handles)))))


async def client_main(spec: dict[str, Any]) -> dict[str, Any]:
    """The programs: one per URL, all at once; seconds of each call through the gateway, and the
    seconds from the first request to the last response."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the bench's go
        start = time.perf_counter()
        timings = await asyncio.gather(*(_episode(http, url, spec["filler"], spec["calls"], spec["api"],
                                                  random.Random(spec["first"] + i), spec["tool_s"])
                                         for i, url in enumerate(spec["urls"])))
        return {"timings": list(timings), "wall_s": time.perf_counter() - start}


async def _episode(http: Any, base_url: str, filler: str, calls: int, api: str, rng: random.Random,
                   tool_s: float) -> list[float]:
    path, first, add = _REQUESTS[api]
    history: list[Any] = [first(filler)]
    out: list[float] = []
    for _ in range(calls):
        if out and tool_s:
            await asyncio.sleep(rng.uniform(0, 2 * tool_s))  # the tool the last answer asked for runs
        body = json.dumps(_body(api, history)).encode()
        start = time.perf_counter()
        async with http.post(f"{base_url}/{path}", data=body, headers={"Content-Type": "application/json"}) as response:
            raw = await response.read()
        out.append(time.perf_counter() - start)
        reply = json.loads(raw)
        if response.status != 200:
            raise RuntimeError(f"the gateway answered {response.status}: {reply}")
        history += add(reply)
    return out


SYSTEM = "You are a bench."
_REQUESTS: dict[str, tuple[str, Any, Any]] = {
    # path, the first user message, the history items a reply and the next tool output add
    "chat": ("chat/completions", lambda text: {"role": "user", "content": text},
             lambda r: [r["choices"][0]["message"], {"role": "user", "content": TOOL_OUTPUT}]),
    "responses": ("responses", lambda text: {"type": "message", "role": "user", "content": text},
                  lambda r: [*r["output"], {"type": "message", "role": "user", "content": TOOL_OUTPUT}]),
    "messages": ("messages", lambda text: {"role": "user", "content": text},
                 lambda r: [{"role": "assistant", "content": r["content"]}, {"role": "user", "content": TOOL_OUTPUT}]),
}


def _body(api: str, history: list[Any]) -> dict[str, Any]:
    if api == "responses":
        return {"model": "m", "instructions": SYSTEM, "input": history, "store": False}
    if api == "messages":
        return {"model": "m", "system": SYSTEM, "messages": history, "max_tokens": 1024}
    return {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, *history]}


def _summary(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """Percentiles of (through the gateway, engine alone) seconds per call."""
    through = sorted(p[0] for p in pairs)
    added = sorted(p[0] - p[1] for p in pairs)
    return {"calls": len(pairs), "gateway_p50_ms": _ms(_pct(through, 50)), "gateway_p99_ms": _ms(_pct(through, 99)),
            "direct_p50_ms": _ms(statistics.median(p[1] for p in pairs)),
            "added_p50_ms": _ms(_pct(added, 50)), "added_p99_ms": _ms(_pct(added, 99))}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def format_text(result: dict[str, Any]) -> str:
    lines = [f"gateway overhead ({result['engine']} engine, {result['event_loop']} event loop, "
             f"{result['calls_per_episode']} calls per episode, {result['cores']} cores, load {result['load_average']})",
             f"{'format':7} {'recorder':8} {'api':9} {'engine':>6} {'tools':>6} {'episodes':>8} {'prompt':>7} | "
             f"{'continued: added p50':>20} {'p99':>8} {'plain p50':>9} | {'first call: added p50':>21} {'p99':>8} | "
             f"{'recorded p50':>12} {'p99':>8} | {'CPU/call':>9} {'calls/s':>8}"]
    for row in result["rows"]:
        c, f = row["continued"], row["first_call"]
        plain = f"{row['plain_continued']['added_p50_ms']} ms" if "plain_continued" in row else "-"
        lines.append(f"{row['chat_format']:7} {row['recorder']:8} {row['api']:9} {row['engine_ms']:>4g}ms {row['tool_ms']:>4g}ms "
                     f"{row['episodes']:>8} {row['prompt_tokens']:>7} | {c['added_p50_ms']:>17} ms "
                     f"{c['added_p99_ms']:>5} ms {plain:>9} | {f['added_p50_ms']:>18} ms {f['added_p99_ms']:>5} ms | "
                     f"{row['record_p50_ms']:>9} ms {row['record_p99_ms']:>5} ms | "
                     f"{row['gateway_cpu_ms_per_call']:>6} ms {row['calls_per_s']:>8}")
    lines.append(f"target: {result['target']}")
    return "\n".join(lines)


if __name__ == "__main__":  # the client process of `measure`
    print(json.dumps(run_async(client_main(json.loads(sys.stdin.readline())))))
