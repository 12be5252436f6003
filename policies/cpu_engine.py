"""`rollway serve`: the built-in engine behind the subset of vLLM's OpenAI-compatible API rollway uses.

Endpoints (request and response fields follow vLLM's documented ones, so one client serves both):

- `POST /v1/completions`: `prompt` (a list of token ids, or one such list in a list), `max_tokens`
  (default 16), `temperature` (>= 0, default 1), `top_p` (0 < p <= 1), `seed`, `stop_token_ids`,
  `ignore_eos`, `logprobs` (int k: the sampled token's logprob plus k alternatives),
  `return_tokens_as_token_ids`, `return_token_ids`, `model` (optional, must match). Answer:
  `choices[0]` with `text`, `finish_reason` (`stop`/`length`), `stop_reason`, `logprobs`
  (`tokens` as "token_id:N" when asked, `token_logprobs`, `top_logprobs`, `text_offset`) and, with
  `return_token_ids`, `token_ids` and `prompt_token_ids`; `usage`; plus rollway's `policy_version`
  (also in the `X-Policy-Version` header). Logprobs are those of the temperature-scaled, top-p
  renormalised distribution actually sampled from (vLLM: `--logprobs-mode processed_logprobs`);
  greedy requests (T=0) report the T=1 logprob. Not supported: text prompts, `n` > 1, `stream`.
- `GET /v1/models`: the served model with `max_model_len` and `policy_version`.
- `GET /health`: 200 when serving (with the policy version).
- Weight updates mirror vLLM's dev-mode endpoints (`VLLM_SERVER_DEV_MODE=1`), which RL frameworks
  call to load a new checkpoint into a running OpenAI server: `POST /collective_rpc` with
  `{"method": "update_config", "args": [{"model_config": {"model": FOLDER}}]}` points the engine at
  the new checkpoint, then `{"method": "reload_weights"}` loads it in place (rollway reads an extra
  `policy_version` field, which vLLM ignores; without it the version increments). `POST
  /reset_prefix_cache` is accepted (no prefix cache here). Our engine finishes running sequences and
  holds new ones back during the swap (like vLLM's `/pause` in wait mode), so each completion comes
  from one policy version. `OpenAICompletionsClient.load_weights` sends exactly this sequence.
- Errors: 4xx with `{"error": {"message", "type", "param", "code"}}` as vLLM/OpenAI do.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from rollway.base.secret_pipe import peek_secret
from rollway.policies.base import SamplingParams

VERSION_HEADER = "X-Policy-Version"
MAX_TOP_LOGPROBS = 20


class RequestError(Exception):
    """A client error: becomes a 4xx JSON answer."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(err: RequestError) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError"}.get(err.status, "Error")
    body = {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.status}}
    return web.json_response(body, status=err.status)


# -- request parsing ---------------------------------------------------------------------------------

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool)) and math.isfinite(x)


def parse_prompt(prompt: Any) -> list[int]:
    if prompt is None:
        raise RequestError("`prompt` is required: a list of token ids", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) or not isinstance(prompt, list) or not all(_is_int(t) for t in prompt):
        raise RequestError("`prompt` must be a list of token ids (ints): this engine is token-in; tokenize "
                           "with the model's tokenizer (one prompt per request)", "prompt")
    if not prompt:
        raise RequestError("`prompt` is empty: send at least one token id", "prompt")
    return prompt


def _get(body: dict, name: str, default: Any, ok: Any, rule: str) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not ok(value):
        raise RequestError(f"`{name}` must be {rule}, got {value!r}", name)
    return value


def parse_sampling(body: dict) -> SamplingParams:
    stops = _get(body, "stop_token_ids", [], lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                 "a list of token ids")
    return SamplingParams(
        temperature=float(_get(body, "temperature", 1.0, lambda v: _is_number(v) and 0 <= v <= 100,
                               "a number in [0, 100] (0 = greedy)")),
        top_p=float(_get(body, "top_p", 1.0, lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")),
        max_tokens=_get(body, "max_tokens", 16, lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        stop_token_ids=tuple(stops),
        seed=_get(body, "seed", None, _is_int, "an integer"))


@dataclass(frozen=True)
class ResponseOptions:
    logprobs: int | None
    tokens_as_ids: bool
    return_token_ids: bool


def parse_completion(body: Any, served_model: str) -> tuple[list[int], SamplingParams, dict, ResponseOptions]:
    """Validate a /v1/completions body; returns prompt ids, sampling params, engine extras, options."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("model") not in (None, served_model):
        raise RequestError(f"The model `{body['model']}` does not exist; this server serves `{served_model}`",
                           "model", 404)
    for name, unsupported in (("stream", True), ("echo", True)):
        if body.get(name) is unsupported:
            raise RequestError(f"`{name}` is not supported by the rollway engine", name)
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        raise RequestError("only one completion per request (n=1): send parallel requests instead", "n")
    logprobs = _get(body, "logprobs", None, lambda v: _is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                    f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    extras = {"ignore_eos": bool(body.get("ignore_eos", False)), "top_logprobs": logprobs or 0}
    options = ResponseOptions(logprobs, bool(body.get("return_tokens_as_token_ids", False)),
                              bool(body.get("return_token_ids", False)))
    return parse_prompt(body.get("prompt")), parse_sampling(body), extras, options


# -- response building -------------------------------------------------------------------------------

class CompletionRenderer:
    """Turns engine outputs into vLLM-shaped completion responses."""

    def __init__(self, tokenizer: Any, served_model: str):
        self.tokenizer, self.served_model = tokenizer, served_model

    def _token_name(self, token_id: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.convert_ids_to_tokens(token_id)

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _logprobs(self, out: Any, opts: ResponseOptions) -> dict:
        pieces = [self._text([t]) for t in out.token_ids]
        offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        tops = [{self._token_name(t, opts.tokens_as_ids): lp for t, lp in top.items()} for top in out.top_logprobs]
        return {"tokens": [self._token_name(t, opts.tokens_as_ids) for t in out.token_ids],
                "token_logprobs": out.logprobs, "top_logprobs": tops or None, "text_offset": offsets}

    def render(self, prompt_ids: list[int], out: Any, opts: ResponseOptions) -> dict:
        choice: dict[str, Any] = {"index": 0, "text": self._text(out.token_ids),
                                  "logprobs": self._logprobs(out, opts) if opts.logprobs is not None else None,
                                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if opts.return_token_ids:
            choice["token_ids"], choice["prompt_token_ids"] = out.token_ids, prompt_ids
        n_out = len(out.token_ids)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.served_model, "choices": [choice], "policy_version": out.policy_version,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                          "total_tokens": len(prompt_ids) + n_out}}


ENGINE_KEY_ENV = "ROLLWAY_ENGINE_API_KEY"
"""The API key `rollway serve` wants: handed over a pipe by `policy.launch` (base/secret_pipe.py), or set by
hand as an environment variable (never argv: `ps` shows it)."""


# -- the HTTP app ------------------------------------------------------------------------------------

class EngineServer:
    """HTTP front of a `BatchEngine`; `app()` builds the aiohttp application."""

    def __init__(self, engine: Any, tokenizer: Any, served_model: str, model_path: str = "",
                 api_key: str | None = None):
        self.engine = engine
        self.served_model = served_model
        self.model_path = model_path
        self.renderer = CompletionRenderer(tokenizer, served_model)
        self._staged_checkpoint: str | None = None
        self.api_key = api_key if api_key is not None else peek_secret(ENGINE_KEY_ENV) or None
        """With a key every route but /health wants it (`/collective_rpc` loads weights from any path)."""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[self._require_key] if self.api_key else [])
        app.add_routes([web.post("/v1/completions", self.completions), web.get("/v1/models", self.models),
                        web.get("/health", self.health), web.post("/collective_rpc", self.collective_rpc),
                        web.post("/reset_prefix_cache", self.reset_prefix_cache)])
        return app

    @web.middleware
    async def _require_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if request.path == "/health" or hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            return await handler(request)
        return web.json_response({"error": {"message": "Unauthorized: send the engine's API key"}}, status=401)

    def _headers(self) -> dict[str, str]:
        return {VERSION_HEADER: str(self.engine.policy_version)}

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except ValueError as err:
            raise RequestError(f"the request body is not valid JSON: {err}") from err

    async def completions(self, request: web.Request) -> web.Response:
        from rollway.policies.batching import EngineRequest, RequestRefused

        try:
            prompt, params, extras, opts = parse_completion(await self._json(request), self.served_model)
            try:
                out = await self.engine.generate(EngineRequest(prompt, params, **extras))
            except RequestRefused as err:
                raise RequestError(str(err), "prompt") from err
        except RequestError as err:
            return error_response(err)
        body = self.renderer.render(prompt, out, opts)
        return web.json_response(body, headers={VERSION_HEADER: str(out.policy_version)})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.served_model, "object": "model", "created": 0, "owned_by": "rollway",
                "root": self.model_path or self.served_model, "parent": None,
                "max_model_len": self.engine.max_model_len, "policy_version": self.engine.policy_version}
        return web.json_response({"object": "list", "data": [card]}, headers=self._headers())

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "policy_version": self.engine.policy_version},
                                 headers=self._headers())

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({}, headers=self._headers())  # no prefix cache: nothing to reset

    async def collective_rpc(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode RPC, for the two methods a checkpoint reload needs."""
        try:
            body = await self._json(request)
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            method = body.get("method")
            if method == "update_config":
                self._staged_checkpoint = self._checkpoint_from(body.get("args") or [])
                return web.json_response({"results": [None]}, headers=self._headers())
            if method == "reload_weights":
                return await self._reload(body.get("policy_version"))
            raise RequestError(f"unsupported collective_rpc method {method!r}: this engine implements "
                               "update_config and reload_weights", "method")
        except RequestError as err:
            return error_response(err)

    def _checkpoint_from(self, args: list) -> str:
        try:
            path = args[0]["model_config"]["model"]
        except (IndexError, KeyError, TypeError) as err:
            raise RequestError('update_config needs args [{"model_config": {"model": FOLDER}}]', "args") from err
        if not isinstance(path, str) or not Path(path).exists():
            raise RequestError(f"checkpoint {path!r} does not exist on the server's file system", "args")
        return path

    async def _reload(self, version: Any) -> web.Response:
        if version is not None and not _is_int(version):
            raise RequestError("`policy_version` must be an integer", "policy_version")
        path = self._staged_checkpoint or self.model_path
        try:
            new_version = await self.engine.update_weights(path, version)
        except (ValueError, FileNotFoundError) as err:
            raise RequestError(str(err), "args") from err
        self.model_path, self._staged_checkpoint = path, None
        return web.json_response({"results": [None], "policy_version": new_version}, headers=self._headers())


# -- running -----------------------------------------------------------------------------------------

def build_engine(model: str | None = None, dtype: str = "bfloat16", device: str | None = None,
                 max_batch: int = 8, max_model_len: int = 2048, threads: int = 0,
                 served_model: str | None = None) -> EngineServer:
    """Load the model (see `model_loading`) and start a `BatchEngine` behind an `EngineServer`.
    `threads` > 0 sets torch's CPU threads (1 is much faster when the cores are shared)."""
    import torch

    from rollway.policies.batching import BatchEngine
    from rollway.policies.model_loading import (
        DEFAULT_MODEL,
        eos_token_ids,
        load_causal_lm,
        load_tokenizer,
        resolve_model_folder,
    )

    if threads > 0:
        torch.set_num_threads(threads)
    lm = load_causal_lm(model, dtype=dtype, device=device)
    engine = BatchEngine(lm, eos_token_ids(lm), max_batch=max_batch, max_model_len=max_model_len).start()
    name = served_model or model or DEFAULT_MODEL
    return EngineServer(engine, load_tokenizer(model), name, str(resolve_model_folder(model)))


async def serve_forever(server: EngineServer, host: str, port: int) -> None:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"rollway engine: serving {server.served_model} at http://{host}:{port}/v1", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class BackgroundServer:
    """Serves an `EngineServer` from a thread with its own event loop (tests, benchmarks, `local`)."""

    def __init__(self, server: EngineServer, host: str = "127.0.0.1", port: int = 0):
        self.server, self.host, self.port = server, host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollway-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> BackgroundServer:
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("the engine's HTTP server did not start within 30 s")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.server.app(), access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]  # the OS-chosen port when port=0
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        async def shutdown() -> None:
            await self._runner.cleanup()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(timeout=10)
        self.server.engine.stop()
