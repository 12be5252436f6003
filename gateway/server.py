"""The OpenAI-compatible gateway: per-episode credentials in front of one rollway InferenceClient; every
call rendered token-exact, sent to the engine as ids, recorded durably, then answered."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import structlog
from aiohttp import web

from rollway.gateway.apis import (
    CHAT_APIS,
    anthropic_error,
    messages_body,
    messages_events,
    parse_messages_request,
    parse_responses_request,
    responses_body,
    responses_events,
)
from rollway.gateway.bounds import EpisodeListener, bounds_middleware
from rollway.gateway.capture import EpisodeCapture, Plan
from rollway.gateway.config import GatewayLimits
from rollway.gateway.protocol import (
    Reply,
    RequestError,
    Sampling,
    chat_chunks,
    chat_completion,
    completion_chunks,
    cut_at_stop,
    make_reply,
    parse_chat_request,
    parse_completion_request,
    text_completion,
)
from rollway.gateway.recorder import CallRecorder, RecordFailed, RecordTooLarge
from rollway.gateway.side import SideCallRule, side_call_of
from rollway.policies.base import (
    ChatFormat,
    Generation,
    InferenceClient,
    InferenceRequestError,
    InferenceSettingsRefused,
    SamplingParams,
)
from rollway.runtime import metrics
from rollway.schemas.messages import CapturedCall, EpisodeKey

log = structlog.get_logger()

INLINE_REQUEST_BYTES = 1 << 20
INLINE_REQUEST_CONTAINERS = 1024
INLINE_REQUEST_VALUES = 16384
"""A call's request of at most INLINE_REQUEST_BYTES, INLINE_REQUEST_CONTAINERS JSON objects and arrays and
this many values in them (counted from its bytes by _parsed_on_loop) is parsed on the event loop (a few ms
at most) and, when its plan tokenises no more than INLINE_RENDER_CHARS, planned there too: a thread hop and
the GIL's hand-overs cost more than such work (64 episodes whose calls arrive together waited about twice as
long). Larger work (a first call's full render, a long tool output, a request of many small values: 34,000
messages in 1 MiB took 225 ms to check, 250,000 empty lists 222 ms to parse, 300,000 token ids 43 ms) goes
off the loop in one hop, as everything did before."""
INLINE_RENDER_CHARS = 8192
"""Characters a call's plan may tokenise on the event loop (about 2 ms at most with a real tokenizer)."""
INLINE_OUTPUT_TOKENS = 1024
"""Output ids decoded into the reply on the event loop; a longer output is decoded off it."""
INLINE_COMMIT_MESSAGES = 256
"""New messages a recorded call applies to its episode's conversation on the event loop; more (each is
put in render form) are applied off it."""
INLINE_COMMIT_TOKENS = 16384
"""Prompt ids a recorded call adds to its episode's stream on the event loop; more are added off it."""


@dataclass
class EpisodeHandle:
    """What an episode driver holds for one episode: the credential to give the program (`api_key`,
    or `base_url` with the key in its path) and the episode's counters for its limits."""

    episode: EpisodeKey
    token: str
    base_url: str
    max_calls: int | None
    calls: int = 0
    """Calls recorded so far."""
    last_call_at: float | None = None
    """time.monotonic() of the last recorded call (None: none yet), for a silence limit."""
    opened_at: float = field(default_factory=time.monotonic)
    stop_reason: str | None = None
    """Set when the gateway refused a call because of a limit (call_limit, refused_limit, segment_limit,
    token_limit)."""
    infrastructure_failure: str | None = None
    """Set when a call failed outside the sandbox (the inference engine unreachable, the call not recorded):
    a program that then fails has failed for the infrastructure, not for the agent (base/blame.py)."""
    refused: int = 0
    """Requests and connections refused for the gateway's limits or as malformed (gateway/bounds.py)."""
    connections: int = 0
    """Connections open on the episode's own socket now."""
    max_segments: int | None = None
    """Token streams (segments) per episode: a call that would open one more is refused."""
    max_trained_tokens: int | None = None
    """Sampled (trained) tokens per episode: each call's max_tokens is cut to what is left, and the call
    after the budget is spent is refused."""
    trained_tokens: int = 0
    """Sampled tokens recorded so far (a retried call's count too: the bound is never exceeded)."""
    closed: bool = False
    unsupported: str | None = None
    """The first endpoint or option the program asked for that the gateway does not serve: the program
    cannot work here, so the attempt fails for good (not retried)."""
    capture: EpisodeCapture | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    generating: asyncio.Future | None = None
    """The engine call of the call being served, while the engine generates (`close_episode` cancels it)."""

    @property
    def api_key(self) -> str:
        return self.token


class Gateway:
    """Serves `/v1/chat/completions`, `/v1/completions` and `/v1/models` for the episodes opened on it.

    A driver calls `open_episode` to get a credential for an episode's program and `close_episode`
    when the episode ends (after which its calls get 409). Calls of one episode run one at a time, in
    arrival order, so its token stream has one order; episodes run concurrently."""

    def __init__(self, engine: InferenceClient, chat: ChatFormat, recorder: CallRecorder, *,
                 model_name: str = "rollway-policy", default_max_tokens: int = 1024, max_tokens_cap: int = 32768,
                 check_drift: bool = True, host: str = "127.0.0.1", port: int = 0, public_host: str | None = None,
                 limits: GatewayLimits | None = None, enforce_sampling: tuple[float, float] | None = None,
                 side_rules: tuple[SideCallRule, ...] = ()):
        self.engine, self.chat, self.recorder = engine, chat, recorder
        self.limits = limits or GatewayLimits()
        # Parsing, rendering and decoding grow with what a program sends: off the loop every episode shares.
        self._pool = ThreadPoolExecutor(self.limits.parse_threads, thread_name_prefix="rollway-gateway")
        self.model_name, self.default_max_tokens, self.max_tokens_cap = model_name, default_max_tokens, max_tokens_cap
        self.host, self.port = host, port
        self.public_host = public_host or host
        """The host programs reach the gateway by (a sandbox may see the host under another name)."""
        self.check_drift = check_drift
        """Re-render each continued call from scratch to flag template drift (`CapturedCall.template_drift`):
        a full render per call, so off where rendering long histories costs too much."""
        self.enforce_sampling = enforce_sampling
        """(temperature, top_p) every call is sampled at, whatever the program sends; None: the program's."""
        self.side_rules = side_rules
        """Calls matching these are side conversations (gateway/side.py): recorded, outside the stream."""
        self.episodes: dict[str, EpisodeHandle] = {}
        """By token; closed episodes stay (their calls get 409, not 401)."""
        self._runner: web.AppRunner | None = None
        self._said_once: set[str] = set()

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> str:
        """Listen; returns the base URL (http://host:port)."""
        app = web.Application(client_max_size=self.limits.max_request_bytes,
                              middlewares=[bounds_middleware(self.limits, self._known_episode)])
        for prefix in ("", "/e/{token}"):
            app.router.add_post(f"{prefix}/v1/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/v1/completions", self._completions)
            app.router.add_get(f"{prefix}/v1/models", self._models)
            app.router.add_post(f"{prefix}/v1/responses", self._responses)
            app.router.add_post(f"{prefix}/v1/messages", self._messages)
        for prefix in ("/e/{token}", ""):  # after every served route: anything else is named as unsupported
            app.router.add_route("*", prefix + "/{tail:.*}", self._unsupported)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.limits.header_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.public_host}:{self.port}"

    async def listen_unix(self, path: str, handle: EpisodeHandle | None = None) -> web.SockSite | EpisodeListener:
        """Also serve on the unix socket `path` (made writable by anyone who can reach its folder: a
        sandbox without network reaches the gateway through a socket bound into it). With `handle`, the
        socket is that episode's own and its connections are bounded (gateway/bounds.py). Stop the
        returned listener when the episode that uses it ends."""
        if self._runner is None or self._runner.server is None:
            raise RuntimeError("start the gateway before adding a unix socket listener")
        if handle is not None:
            listener = EpisodeListener(_bound_unix_socket(path), self._runner.server, handle, self.limits)
            await listener.start()
            return listener
        site = web.SockSite(self._runner, _bound_unix_socket(path))
        await site.start()
        return site

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def open_episode(self, episode: EpisodeKey, max_calls: int | None = None, *, token: str | None = None,
                     recorded: list[CapturedCall] | None = None, max_segments: int | None = None,
                     max_trained_tokens: int | None = None) -> EpisodeHandle:
        """A fresh credential for `episode`. Give the program `handle.api_key` (with base URL
        `gateway.url + "/v1"`) or `handle.base_url` (the key in the path).

        After a crash of the gateway's process, reopen a running episode with its `token` (the one its
        program holds) and its `recorded` calls read back from the log: the episode goes on from there
        and the program's retry of an answered call is recorded as a retry, not a second call."""
        token = token or secrets.token_urlsafe(24)
        if token in self.episodes:
            raise ValueError(f"the token of episode {episode.episode_id} is already in use on this gateway")
        capture = EpisodeCapture.restore(self.chat, recorded) if recorded else EpisodeCapture(self.chat)
        handle = EpisodeHandle(episode, token, f"{self.url}/e/{token}/v1", max_calls, calls=capture.next_index,
                               capture=capture, max_segments=max_segments, max_trained_tokens=max_trained_tokens,
                               trained_tokens=sum(len(c.output_ids) for c in {c.call_index: c for c in recorded or []}.values()
                                                  if c.side_call is None))
        self.episodes[token] = handle
        return handle

    async def close_episode(self, handle: EpisodeHandle) -> None:
        """End the episode: a call the engine is still generating is abandoned (its engine request cancelled,
        the call answered 409 and not recorded), so an episode's end never waits on how long a generation the
        program asked for runs; a call being recorded is waited for; later calls get 409."""
        if handle.generating is not None:
            handle.generating.cancel()
        async with handle.lock:
            handle.closed = True
            handle.capture = None  # the record is in the log; free the token stream

    # -- handlers -----------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._episode(request)
        except RequestError as err:
            return web.json_response(err.body(), status=err.status)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollway"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "responses")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "messages")

    async def _unsupported(self, request: web.Request) -> web.Response:
        """An endpoint the gateway does not serve: 404 naming it, and the episode (when the credential
        names one) marked as unable to work here."""
        path = "/" + request.match_info.get("tail", "")
        err = RequestError(f"{request.method} {path} is not served by this gateway (it serves POST "
                           "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages and GET /v1/models): "
                           "configure the program to use one of those", None, 404, "unsupported_endpoint")
        try:
            self._mark_unsupported(self._episode(request), err)
        except RequestError:
            pass  # no episode to mark: the 404 is all there is to say
        return self._error(err, "messages" if path.startswith("/v1/messages") else "chat")

    def _mark_unsupported(self, handle: EpisodeHandle, err: RequestError) -> None:
        if err.code in ("unsupported_option", "unsupported_endpoint") and handle.unsupported is None:
            handle.unsupported = str(err)
            if str(err) not in self._said_once:  # every episode of the program asks alike: said once
                self._said_once.add(str(err))
                log.warning("a program asked for what the gateway does not serve", error=str(err))

    @staticmethod
    def _error(err: RequestError, api: str) -> web.Response:
        return web.json_response(anthropic_error(err) if api == "messages" else err.body(), status=err.status)

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            handle = self._episode(request)
            raw = await request.read()
            async with handle.lock:
                self._check_open(handle)
                capture = handle.capture
                assert capture is not None  # open episodes keep theirs
                try:  # small work on the loop, or one hop off it for all that grows with what the program sent
                    parsed, plan, parse_tools = (self._prepare(capture, api, raw, None, INLINE_RENDER_CHARS)
                                                 if _parsed_on_loop(raw) else (None, None, False))
                    if plan is None:
                        parsed, plan, parse_tools = await self._off_loop(self._prepare, capture, api, raw, parsed)
                except RequestError as err:
                    self._mark_unsupported(handle, err)
                    raise
                result = await self._call(handle, api, parsed, plan, parse_tools)
        except RequestError as err:
            return self._error(err, api)
        response = await self._respond(request, api, parsed, *result)
        metrics.GATEWAY_CALL_SECONDS.labels("agent", api).observe(time.perf_counter() - t0)
        return response

    def _episode(self, request: web.Request) -> EpisodeHandle:
        """The episode of the path token, else of the bearer key; 401 for an unknown credential or a
        key of another episode than the path's."""
        bearer = (request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                  or request.headers.get("x-api-key", "").strip())  # the Anthropic SDK's header
        token = request.match_info.get("token") or bearer
        handle = self.episodes.get(token)
        other = self.episodes.get(bearer)
        if handle is None or (other is not None and other is not handle):
            raise RequestError("unknown API key for this gateway, or a key of another episode: use the key "
                               "(or base URL) the episode was given", None, 401, "invalid_api_key")
        return handle

    def _known_episode(self, request: web.Request) -> EpisodeHandle | None:
        """The episode a request's credential names (None: none), for counting refusals."""
        bearer = (request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                  or request.headers.get("x-api-key", "").strip())
        return self.episodes.get(request.match_info.get("token") or bearer)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, _framed_off_loop, fn, *args)

    def _check_open(self, handle: EpisodeHandle) -> None:
        if handle.closed:
            raise RequestError(f"episode {handle.episode.episode_id} has ended; no more calls are taken",
                               None, 409, "episode_closed")
        if handle.max_calls is not None and handle.calls >= handle.max_calls:
            handle.stop_reason = "call_limit"
            raise RequestError(f"episode {handle.episode.episode_id} reached its limit of {handle.max_calls} "
                               "model calls", None, 409, "call_limit_reached")
        if handle.max_trained_tokens is not None and handle.trained_tokens >= handle.max_trained_tokens:
            handle.stop_reason = "token_limit"
            raise RequestError(f"episode {handle.episode.episode_id} reached its limit of {handle.max_trained_tokens} "
                               "sampled tokens", None, 409, "token_limit_reached")

    async def _call(self, handle: EpisodeHandle, api: str, parsed: Any, plan: Plan,
                    parse_tools: bool) -> tuple[str, Reply, dict[str, int]]:
        capture = handle.capture
        assert capture is not None
        if plan.segment_reason not in (None, "start") and handle.max_segments is not None \
                and capture.segment + 1 >= handle.max_segments:
            handle.stop_reason = "segment_limit"
            raise RequestError(f"episode {handle.episode.episode_id} reached its limit of {handle.max_segments} "
                               f"segments (this call would open another: {plan.segment_reason})", None, 409,
                               "segment_limit_reached")
        used = self._params(parsed.sampling, plan)
        if handle.max_trained_tokens is not None and plan.side is None:  # no more than the episode has left
            used = replace(used, max_tokens=min(used.max_tokens, handle.max_trained_tokens - handle.trained_tokens))
        context = await self.engine.context_tokens()
        if context is not None:  # a prompt the engine cannot hold is told as programs expect, to compact on
            if len(plan.prompt_ids) >= context:
                raise RequestError(
                    f"prompt is too long: {len(plan.prompt_ids)} tokens > {context - 1} maximum. This model's maximum "
                    f"context length is {context} tokens, prompt and output together: shorten or compact the "
                    "conversation", _PROMPT_FIELD[api], 400, "context_length_exceeded")
            used = replace(used, max_tokens=min(used.max_tokens, context - len(plan.prompt_ids)))
        # The drift check (a from-scratch render) needs only the plan: it runs while the engine generates,
        # not after it; the capture it reads changes only at commit, under the episode's lock held here.
        drift = asyncio.get_running_loop().run_in_executor(self._pool, capture.drifted, plan) \
            if self.check_drift else None
        handle.generating = asyncio.ensure_future(metrics.generate(self.engine, plan.prompt_ids, used, "agent"))
        try:
            generation = await handle.generating
        except BaseException as err:
            if drift is not None:
                drift.add_done_callback(_retrieved)  # a call that fails here never reads it
            if isinstance(err, asyncio.CancelledError) and not _being_cancelled():  # close_episode's doing
                raise RequestError("the episode ended while this call was generating", None, 409,
                                   "episode_closed") from None
            if isinstance(err, OSError):  # no connection, an answer it cannot read: the engine's, never the program's
                handle.infrastructure_failure = f"the inference engine failed: {err}"[:500]
            if isinstance(err, InferenceRequestError):
                raise self._refused(handle, err) from None
            raise
        finally:
            handle.generating = None
        drifted = drift is not None and await drift
        output, reply = (self._reply(generation, parsed.sampling, parse_tools)
                         if len(generation.token_ids) <= INLINE_OUTPUT_TOKENS
                         else await self._off_loop(self._reply, generation, parsed.sampling, parse_tools))
        call = self._record_of(handle, api, plan, generation, output, reply)
        call.temperature, call.top_p = used.temperature, used.top_p
        if plan.side is not None:
            call.side_call, call.segment, call.tools = plan.side, -1, plan.tools
        call.sampling_overridden = (used.temperature, used.top_p) != (parsed.sampling.temperature, parsed.sampling.top_p)
        if drifted:
            call.template_drift = True
            log.info("template drift: the conversation re-renders differently", episode_id=handle.episode.episode_id,
                     call=call.call_index)
        try:
            # Shielded: a client that goes away mid-record must not leave an acknowledged call uncommitted.
            await asyncio.shield(self._record_and_commit(handle, api, plan, call, reply))
        except RecordTooLarge as err:
            raise RequestError(str(err), None, 413, "record_too_large") from None
        except RecordFailed as err:
            handle.infrastructure_failure = f"a call was not recorded: {err}"[:500]
            log.warning("call not recorded", episode_id=handle.episode.episode_id, error=str(err))
            raise RequestError(f"{err}; retry the call", None, 503, "record_failed") from None
        usage = {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": len(output),
                 "total_tokens": len(plan.prompt_ids) + len(output)}
        return f"{handle.episode.episode_id}-{call.call_index}", reply, usage

    def _refused(self, handle: EpisodeHandle, err: InferenceRequestError) -> RequestError:
        """What the program is told when the engine refused its call: for what the call holds, a 400 in the
        engine's words (the program's doing: graded, not retried); for the gateway's own key, route or model
        (the operator's settings, which no program chooses), a 502 and the attempt the infrastructure's."""
        if not isinstance(err, InferenceSettingsRefused):
            return RequestError(f"the inference engine refused this call: {err.reason}", None, 400, "engine_refused")
        handle.infrastructure_failure = f"the inference engine refused the gateway's request: {err}"[:500]
        if str(err) not in self._said_once:  # every episode meets it alike: said once
            self._said_once.add(str(err))
            log.warning("the inference engine refuses the gateway's requests: check policy.model, policy.base_url "
                        "and the engine's API key", error=str(err))
        return RequestError(f"the inference engine refused the gateway's request ({err.status}); this is not the "
                            "program's doing", None, 502, "engine_refused")

    def _prepare(self, capture: EpisodeCapture, api: str, raw: bytes, parsed: Any = None,
                 render_limit: int | None = None) -> tuple[Any, Plan | None, bool]:
        """The request parsed (unless `parsed` is given) and planned: the parsed request, where the call goes
        in the episode's stream and whether to parse tool calls from its output. With `render_limit` (on the
        event loop) the plan is None when it would tokenise more than that: plan it again off the loop."""
        if parsed is None:
            parsed = _PARSERS[api](_json_body(raw))
        plan, parse_tools = self._plan(capture, api, parsed, render_limit)
        if plan is not None:
            _check_storable(plan)
        return parsed, plan, parse_tools

    def _plan(self, capture: EpisodeCapture, api: str, parsed: Any,
              render_limit: int | None = None) -> tuple[Plan | None, bool]:
        """Where the call goes in the episode's stream (None: over `render_limit`), and whether to parse
        tool calls from its output."""
        if api == "completions":
            if render_limit is not None and not isinstance(parsed.prompt, list):
                return None, False  # a text prompt is tokenised whole
            prompt = parsed.prompt if isinstance(parsed.prompt, list) else self._encode_prompt(parsed.prompt)
            return capture.plan_completion(prompt), False
        side = side_call_of(parsed.messages, self.side_rules)
        try:
            plan = (capture.plan_side(side, parsed.messages, parsed.tools, render_limit) if side is not None
                    else capture.plan_chat(parsed.messages, parsed.tools, render_limit))
        except Exception as err:  # noqa: BLE001 - a template's own checks (raise_exception) and its errors
            # Rendering depends only on the request: a template that refuses these messages (roles out
            # of the order it allows, a role it lacks) is the request's problem, said as the template says it.
            raise RequestError(f"the policy's chat template cannot render these messages: {type(err).__name__}: "
                               f"{str(err)[:500]}", "messages") from None
        return plan, bool(parsed.tools) and parsed.tool_choice != "none"

    def _encode_prompt(self, text: str) -> list[int]:
        """A raw completions prompt as the engine would tokenise it: special-token text (a program that
        writes the chat template itself) becomes special tokens where the format can say so."""
        encode_special = getattr(self.chat, "encode_special", None)
        return encode_special(text) if encode_special is not None else self.chat.encode(text)

    async def _record_and_commit(self, handle: EpisodeHandle, api: str, plan: Plan, call: CapturedCall,
                                 reply: Reply) -> None:
        await self.recorder.record(call)
        assert handle.capture is not None
        if len(plan.new_messages) <= INLINE_COMMIT_MESSAGES and len(plan.delta) <= INLINE_COMMIT_TOKENS:
            handle.capture.commit(plan, api, call.output_ids, reply)
        else:
            await self._off_loop(handle.capture.commit, plan, api, call.output_ids, reply)
        handle.calls += 1
        handle.trained_tokens += len(call.output_ids) if call.side_call is None else 0
        handle.last_call_at = time.monotonic()

    def _params(self, sampling: Sampling, plan: Plan) -> SamplingParams:
        limit = min(sampling.max_tokens or self.default_max_tokens, self.max_tokens_cap)
        temperature, top_p = self.enforce_sampling or (sampling.temperature, sampling.top_p)
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=limit,
                              stop_token_ids=tuple(self.chat.stop_token_ids), seed=sampling.seed)

    def _reply(self, generation: Generation, sampling: Sampling, parse_tools: bool) -> tuple[list[int], Reply]:
        """The kept output ids (cut after a stop string) and the reply decoded from them."""
        ids, finish = list(generation.token_ids), generation.finish_reason
        text = self.chat.decode(ids)
        if sampling.stop and cut_at_stop(text, sampling.stop) is not None:
            ids = ids[: self._stop_cut(ids, sampling.stop)]
            text, finish = self.chat.decode(ids), "stop"
            reply = make_reply(cut_at_stop(text, sampling.stop) or "", finish, parse_tools)
            reply.raw_text = text
            reply.stop_string = min((s for s in sampling.stop if s in text), key=text.index)
            return ids, reply
        return ids, make_reply(text, finish, parse_tools)

    def _stop_cut(self, ids: list[int], stops: tuple[str, ...]) -> int:
        """The fewest leading ids whose text contains a stop string (binary search: decoding grows
        with the prefix)."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if cut_at_stop(self.chat.decode(ids[:mid]), stops) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _record_of(self, handle: EpisodeHandle, api: str, plan: Plan, generation: Generation,
                   output: list[int], reply: Reply) -> CapturedCall:
        capture = handle.capture
        assert capture is not None
        opens = plan.segment_reason is not None
        return CapturedCall(
            episode=handle.episode, call_index=capture.next_index, segment=capture.segment + int(opens),
            segment_reason=plan.segment_reason, retry_of=plan.retry_of, continues_call=plan.continues,
            prompt_start=plan.prompt_start,
            prompt_ids=list(plan.delta), output_ids=output, logprobs=list(generation.logprobs[: len(output)]),
            finish_reason=reply.finish_reason, policy_version=generation.policy_version, api=api,
            new_messages=plan.new_messages, tools=plan.tools if opens and api in CHAT_APIS else None,
            raw_text=reply.raw_text, content=reply.content, tool_calls=reply.tool_calls, created_at=time.time())

    async def _respond(self, request: web.Request, api: str, parsed: Any, call_id: str, reply: Reply,
                       usage: dict[str, int]) -> web.StreamResponse:
        sampling: Sampling = parsed.sampling
        model = self.model_name
        if not sampling.stream:
            body = (chat_completion(f"chatcmpl-{call_id}", model, reply, usage) if api == "chat" else
                    responses_body(call_id, model, parsed, reply, usage) if api == "responses" else
                    messages_body(call_id, model, reply, usage) if api == "messages" else
                    text_completion(f"cmpl-{call_id}", model, reply.content, reply.finish_reason, usage))
            return web.json_response(body)
        shown_usage = usage if sampling.include_usage else None
        if api == "responses":
            events = [(f"event: {kind}\n", data) for kind, data in responses_events(call_id, model, parsed, reply, usage)]
        elif api == "messages":
            events = [(f"event: {kind}\n", data) for kind, data in messages_events(call_id, model, reply, usage)]
        else:
            events = [("", chunk) for chunk in (
                chat_chunks(f"chatcmpl-{call_id}", model, reply, shown_usage) if api == "chat" else
                completion_chunks(f"cmpl-{call_id}", model, reply.content, reply.finish_reason, shown_usage))]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            for event, data in events:
                await response.write(f"{event}data: {json.dumps(data)}\n\n".encode())
            if api in ("chat", "completions"):
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            # The call is already recorded; a program that left mid-stream retries or ends.
            log.info("client left mid-stream", call=call_id)
        return response


_PROMPT_FIELD = {"chat": "messages", "completions": "prompt", "responses": "input", "messages": "messages"}
"""The request field each API holds its conversation in."""
_PARSERS = {"chat": parse_chat_request, "completions": parse_completion_request,
            "responses": parse_responses_request, "messages": parse_messages_request}


def _framed_off_loop(fn: Any, *args: Any) -> Any:
    """fn(*args) in a pool thread. A request error it raises leaves its frames (and the exceptions it was
    raised from) here: they hold what was parsed from the request, which would otherwise be freed on the
    event loop when the loop drops the error (250,000 empty lists: 5-10 ms of the loop's time)."""
    try:
        return fn(*args)
    except RequestError as err:
        error = err
    error.__traceback__ = error.__context__ = error.__cause__ = None
    raise error


def _parsed_on_loop(raw: bytes) -> bool:
    """Whether a request body is small enough to parse on the event loop (INLINE_REQUEST_BYTES): its size,
    its containers (`{` and `[` bytes) and its values (`,` bytes), strings included, so upper bounds."""
    return (len(raw) <= INLINE_REQUEST_BYTES and _at_most(raw, (b"{", b"["), INLINE_REQUEST_CONTAINERS)
            and _at_most(raw, (b",",), INLINE_REQUEST_VALUES))


def _at_most(raw: bytes, marks: tuple[bytes, ...], limit: int, chunk: int = 1 << 16) -> bool:
    """Whether `raw` holds at most `limit` of the one-byte `marks`, counted 64 KiB at a time and no further
    than the chunk that passes it (counting 250,000 '[' in a whole body took about 1 ms of the loop)."""
    seen = 0
    for start in range(0, len(raw), chunk):
        seen += sum(raw.count(mark, start, start + chunk) for mark in marks)
        if seen > limit:
            return False
    return True


def _bound_unix_socket(path: str) -> socket.socket:
    """A unix socket bound at `path`, however long: bound through /proc/self/fd of its folder, since
    a socket address holds at most 107 bytes (a sandbox's workspace path can be longer)."""
    folder = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"/proc/self/fd/{folder}/{os.path.basename(path)}")
        _chmod_socket(folder, os.path.basename(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(folder)
    return sock


def _being_cancelled() -> bool:
    """Whether the running task itself is being cancelled (not only something it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _retrieved(future: asyncio.Future) -> None:
    """Read a finished future's outcome, so an error nobody awaits is not reported as lost."""
    if not future.cancelled():
        future.exception()


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestError("the request body is not valid JSON (or nests deeper than the parser reads)", None) from None


def _chmod_socket(folder: int, name: str) -> None:
    """Mode 0666 on the socket just bound as `name` in `folder` (the sandbox's user is not the gateway's),
    never on what a link put there in its place points to: the entry is opened without following it and
    changed only if it is a socket."""
    entry = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=folder)
    try:
        if not stat.S_ISSOCK(os.fstat(entry).st_mode):
            raise OSError(f"{name} was replaced before its mode was set; not changing what took its place")
        os.chmod(f"/proc/self/fd/{entry}", 0o666)
    finally:
        os.close(entry)


def _check_storable(plan: Plan) -> None:
    """The request's messages and tools go into the record: a value MessagePack cannot hold (an integer
    beyond 64 bits in echoed tool arguments, nesting past its depth) is refused before the engine runs."""
    try:
        msgspec.msgpack.encode([plan.new_messages, plan.tools])
    except Exception as err:  # noqa: BLE001 - msgspec raises OverflowError, RecursionError, TypeError
        raise RequestError(f"the messages or tools hold a value the log cannot store ({type(err).__name__}: "
                           f"{err}); integers must fit in 64 bits", "messages") from None
