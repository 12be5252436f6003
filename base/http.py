"""Blocking HTTP calls for code that is not async (readiness waits, benchmark samplers, one-off engine
routes), built on aiohttp, the project's one HTTP client library. Async code uses aiohttp directly."""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from rollway.base.redaction import mask_url_credentials

T = TypeVar("T")


class HttpError(OSError):
    """A request failed: no connection, a timeout, or (with `check`) a status outside 2xx. An OSError,
    as connection failures are, so one `except OSError` covers every way a server can be unreachable."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HttpResponse:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return jsonlib.loads(self.body)


def http_request(method: str, url: str, *, json: Any = None, headers: dict[str, str] | None = None,
                 timeout_s: float = 30.0, check: bool = True) -> HttpResponse:
    """`method url` with an optional JSON body; blocks until the whole answer is read. With `check`, a
    status outside 2xx raises HttpError naming the URL (credentials in it masked) and the status."""
    response = _run(_request(method, url, json, headers or {}, timeout_s))
    if check and not 200 <= response.status < 300:
        raise HttpError(f"{method} {mask_url_credentials(url)} answered {response.status}: {response.text[:200]}",
                        response.status)
    return response


def http_get(url: str, *, headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> HttpResponse:
    return http_request("GET", url, headers=headers, timeout_s=timeout_s)


def http_post(url: str, json: Any = None, *, headers: dict[str, str] | None = None,
              timeout_s: float = 30.0) -> HttpResponse:
    return http_request("POST", url, json=json, headers=headers, timeout_s=timeout_s)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether `url` answers 200 now (a health route); False when it cannot be reached or answers otherwise."""
    try:
        return http_request("GET", url, timeout_s=timeout_s, check=False).status == 200
    except HttpError:
        return False


async def _request(method: str, url: str, body: Any, headers: dict[str, str], timeout_s: float) -> HttpResponse:
    import aiohttp  # late: base stays cheap to import for the processes that never speak HTTP

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.request(method, url, json=body, headers=headers) as response:
            return HttpResponse(response.status, await response.read())
    except (aiohttp.ClientError, TimeoutError) as err:
        raise HttpError(f"{method} {mask_url_credentials(url)} failed: {type(err).__name__} {err}") from err


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end from sync code. Called inside a running event loop (a sync helper used from
    async code), it runs on a thread of its own: asyncio.run cannot nest."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1, thread_name_prefix="http-sync") as pool:
        return pool.submit(asyncio.run, coro).result()
