"""InferenceClients over OpenAI-compatible endpoints: completions with token ids (`rollway serve`, vLLM,
others that return token ids and logprobs), and chat completions for endpoints that take no token ids."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec

from rollway.policies.base import (
    EngineAnswerUnreadable,
    Generation,
    InferenceClient,
    InferenceRequestError,
    SamplingParams,
    inference_refusal,
    read_answer,
)

VERSION_HEADER = "X-Policy-Version"
JSON_HEADERS = {"Content-Type": "application/json"}
_encode_json = msgspec.json.Encoder().encode
_decode_json_strict = msgspec.json.Decoder().decode


def _decode_json(raw: bytes) -> Any:
    """msgspec first; the standard library for what strict JSON forbids (NaN, Infinity) and it accepts."""
    try:
        return _decode_json_strict(raw)
    except msgspec.DecodeError:
        return json.loads(raw)

"""msgspec's JSON codec: a turn's body is mostly the prompt's token ids (thousands of ints), which the
standard library's json encoded at about a third of the agent worker's CPU per turn (`rollway bench
ceiling --profile`); msgspec encodes and decodes them several times faster, to the same JSON."""


ALIVE_TIMEOUT_S = 30.0
"""How long a generation's engine may take to answer the check that it is alive (`_exchange`)."""

_UNREAD = object()
"""`OpenAICompletionsClient._context` before /v1/models was read."""
CONTEXT_RETRY_S = 30.0
"""After /v1/models could not be read, how long the context stays unknown before it is asked again."""


def completion_payload(model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The /v1/completions body: token-id prompt, sampled-token logprobs, token ids back (vLLM fields)."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(prompt_ids), "max_tokens": params.max_tokens,
        "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
        "stop_token_ids": list(params.stop_token_ids),
        "return_tokens_as_token_ids": True,  # logprobs.tokens as "token_id:N" (older vLLM)
        "return_token_ids": True,  # choices[0].token_ids (vLLM >= 0.10.2)
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.ignore_eos:  # vLLM's and the built-in engine's extension; sent only when asked for
        body["ignore_eos"] = True
    return body


def builtin_weight_update_calls(checkpoint: str, version: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(HTTP method, route from the server root, JSON body) calls that make `rollway serve` load
    `checkpoint` as `version` (it finishes running turns first, like vLLM's pause in wait mode)."""
    return [
        ("POST", "/collective_rpc", {"method": "update_config", "args": [{"model_config": {"model": checkpoint}}]}),
        ("POST", "/collective_rpc", {"method": "reload_weights", "policy_version": version}),
        ("POST", "/reset_prefix_cache", {}),
    ]


def parse_completion(body: dict[str, Any], fallback_version: int | str) -> Generation:
    """A Generation from a completions response; the version comes from the body when the server says."""
    choice = body["choices"][0]
    logprobs = choice.get("logprobs") or {}
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens") or []]
    token_logprobs = [float(x) if x is not None else 0.0 for x in logprobs.get("token_logprobs") or []]
    if len(token_logprobs) != len(token_ids):
        raise ValueError(f"the server returned {len(token_ids)} tokens but {len(token_logprobs)} logprobs: "
                         "it must support `logprobs` and token-id output (vLLM: --return-tokens-as-token-ids)")
    version = body.get("policy_version", fallback_version)
    return Generation(list(token_ids), token_logprobs, choice.get("finish_reason") or "length", int(version))


class OpenAICompletionsClient(InferenceClient):
    """Calls `{base_url}/completions` once per turn. `model` None: the first model of /v1/models.

    `policy_version`: the server's (rollway engine) or, for servers that do not report one (vLLM), the
    version last passed to `load_weights`."""

    @classmethod
    def from_config(cls, cfg: Any, chat: Any, taskset: Any = None) -> InferenceClient:
        """`policy.type: openai`: vLLM's client for `engine: vllm` (weight reloads, several servers), the
        chat-completions client for `api: chat`, else this completions client."""
        if cfg.engine == "vllm":
            from rollway.policies.vllm import VLLMClient

            return VLLMClient(cfg.base_urls(), None if cfg.launch else cfg.model, cfg.request_timeout_s,
                              cfg.max_retries, api_key=cfg.api_key_value(), pause_mode=cfg.pause_mode)
        if cfg.api == "chat":
            from rollway.policies.openai_chat import OpenAIChatClient

            return OpenAIChatClient(cfg.base_url or "", chat, cfg.model, cfg.request_timeout_s, cfg.max_retries,
                                    api_key=cfg.api_key_value())
        return cls(cfg.base_url or "", None if cfg.launch else cfg.model, cfg.request_timeout_s, cfg.max_retries,
                   api_key=cfg.api_key_value())

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 300.0,
                 max_retries: int = 5, backoff_s: float = 0.5, policy_version: int = 0,
                 api_key: str | None = None):
        self.base_url, self.headers = _split_credentials(base_url.rstrip("/"), api_key)
        self.root_url = self.base_url.removesuffix("/v1")
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.policy_version = policy_version
        self._session: aiohttp.ClientSession | None = None
        self._context: object = _UNREAD
        self._context_retry_at = 0.0

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        return self._session

    async def _request(self, method: str, url: str, body: Any = None, retries: int | None = None,
                       alive_url: str | None = None,
                       work: Callable[[], Awaitable[float | None]] | None = None) -> tuple[dict, Any]:
        """JSON answer and headers; retries transport failures (no connection, a body cut short by an engine
        restart) and 5xx with exponential backoff, then raises ConnectionError: an OSError, the engine's failure
        (base/blame.py), never the agent's. `alive_url` and `work`: see `_exchange`."""
        retries = self.max_retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                data = None if body is None else _encode_json(body)
                status, raw, headers = await self._exchange(method, url, data, alive_url, work)
                if status < 400:  # some routes (vLLM's /health) answer with no body
                    return _read_json(f"{method} {url}", raw), headers
                text = raw.decode("utf-8", "replace")
                if status < 500:
                    reason = _message(text)
                    raise inference_refusal(f"{method} {url} -> {status}: {reason}", status, reason)
                error: Exception = RuntimeError(f"{method} {url} -> {status}: {_message(text)}")
            except (TimeoutError, aiohttp.ClientError) as err:  # the connection or the body cut short: the engine
                error = err
            if attempt < retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise ConnectionError(f"{method} {url} failed after {retries + 1} attempts: {error!r}; "
                              "is the inference server running (rollway serve / vllm serve)?") from error

    async def _exchange(self, method: str, url: str, data: bytes | None, alive_url: str | None,
                        work: Callable[[], Awaitable[float | None]] | None = None) -> tuple[int, bytes, Any]:
        """Status, body and headers of one request. Without `alive_url`, given up after the client's timeout
        (`policy.request_timeout_s`). With it (a generation), never for being long: how long a generation runs
        is the program's and the model's doing (max_tokens, a reply that never stops), and a timeout would turn
        it into a retried infrastructure failure that is never graded. Each time the timeout passes without an
        answer the engine is asked `alive_url` instead; the request is given up (TimeoutError) when that is not
        answered either, or when `work` (the tokens the engine has processed, None when unknown or meaningless
        now) reads the same at two checks in a row: a whole timeout in which an engine that answers did nothing
        (its core hung), which no program or model can cause. The episode's own deadline still bounds the wait."""
        async def exchange(**timeout: aiohttp.ClientTimeout) -> tuple[int, bytes, Any]:
            async with self._http().request(method, url, data=data, headers=JSON_HEADERS, **timeout) as resp:
                return resp.status, await resp.read(), resp.headers

        if alive_url is None:
            return await exchange()
        call = asyncio.ensure_future(exchange(timeout=aiohttp.ClientTimeout(sock_connect=self.timeout.total)))
        before: float | None = None
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=self.timeout.total)
                if done:
                    return call.result()
                if not await self._answers(alive_url):
                    raise TimeoutError(f"no answer in {self.timeout.total:g} s (policy.request_timeout_s), and "
                                       f"the engine did not answer GET {alive_url} either")
                now = await work() if work is not None else None
                if now is not None and now == before:
                    raise TimeoutError(f"no answer, and in the last {self.timeout.total:g} s (policy.request_timeout_s) "
                                       f"the engine, which answers and is not paused, processed no token (its count "
                                       f"stayed at {now:g}): it is stuck")
                before = now
        finally:
            call.cancel()

    async def _answers(self, url: str) -> bool:
        """Whether the server answers GET `url` at all (any HTTP status under 500) within the timeout (at most
        ALIVE_TIMEOUT_S)."""
        try:
            async with self._http().get(url, timeout=aiohttp.ClientTimeout(min(self.timeout.total, ALIVE_TIMEOUT_S))) as resp:
                return resp.status < 500
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def model_name(self) -> str:
        if self.model is None:
            url = self._models_url()
            body, _ = await self._request("GET", url)
            self.model = _model_id(url, body)
        return self.model

    async def context_tokens(self) -> int | None:
        """The served model's `max_model_len` from /v1/models (vLLM and `rollway serve` report it), read
        once; None when the server does not report it, or cannot be reached now (asked again after
        CONTEXT_RETRY_S, so calls meanwhile do not each wait on a server that is down)."""
        if self._context is _UNREAD and time.monotonic() >= self._context_retry_at:
            try:
                body, _ = await self._request("GET", self._models_url(), retries=0)
            except (ConnectionError, InferenceRequestError):
                self._context_retry_at = time.monotonic() + CONTEXT_RETRY_S
                return None
            cards = [c for c in body.get("data") or [] if isinstance(c, dict)] if isinstance(body, dict) else []
            named = [c for c in cards if c.get("id") == self.model and "max_model_len" in c]
            reported = named or [c for c in cards if "max_model_len" in c]
            length = reported[0]["max_model_len"] if reported else None
            self._context = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
        return None if self._context is _UNREAD else self._context  # type: ignore[return-value]

    def _models_url(self) -> str:
        return f"{self.base_url}/models"

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        payload = completion_payload(await self.model_name(), prompt_ids, params)
        url = f"{self.base_url}/completions"
        body, headers = await self._request("POST", url, payload, alive_url=self._models_url())
        return read_answer(f"POST {url}", parse_completion, body, headers.get(VERSION_HEADER, self.policy_version))

    supports_weight_sync = True

    async def load_weights(self, path: str, version: int) -> int:
        """Make the built-in engine (`rollway serve`) load the safetensors checkpoint folder `path` (a
        path on the server's machine) as policy `version`; see `rollway.policies.cpu_engine`."""
        for method, route, body in builtin_weight_update_calls(path, version):
            await self._request(method, f"{self.root_url}{route}", body)
        self.policy_version = version
        return version

    async def served_version(self) -> int | None:
        """The policy version the server reports now (`rollway serve` does), else None."""
        try:
            body, headers = await self._request("GET", f"{self.root_url}/health", retries=1)
        except InferenceRequestError:
            return None
        version = headers.get(VERSION_HEADER, (body or {}).get("policy_version") if isinstance(body, dict) else None)
        return None if version is None else int(version)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _split_credentials(url: str, api_key: str | None) -> tuple[str, dict[str, str]]:
    """The URL without user-info, and the Authorization header: the API key as a bearer token, else the
    URL's `user:pass` as basic auth. Credentials then never appear in a URL an error message quotes."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if parts.username is None and parts.password is None:
        return url, headers
    if not api_key:
        import base64

        pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
        headers = {"Authorization": "Basic " + base64.b64encode(pair).decode()}
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])), headers


def _model_id(url: str, body: Any) -> str:
    """The first model a /v1/models answer names."""
    try:
        name = body["data"][0]["id"]
    except (KeyError, IndexError, TypeError) as err:
        raise EngineAnswerUnreadable(f"could not read the inference engine's answer to GET {url}: {err!r}") from None
    if not isinstance(name, str) or not name:
        raise EngineAnswerUnreadable(f"the inference engine's GET {url} names no model: {name!r}")
    return name


def _read_json(what: str, raw: bytes) -> Any:
    """A success answer's JSON body ({} for none); one that is not JSON is the engine's failure."""
    if not raw.strip():
        return {}
    try:
        return _decode_json(raw)
    except ValueError:
        raise EngineAnswerUnreadable(f"could not read the inference engine's answer to {what}: not JSON: "
                                     f"{raw[:200]!r}") from None


def _message(text: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the raw text (shortened)."""
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]
