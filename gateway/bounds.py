"""Per-episode bounds at the gateway's connection and request layer, below every endpoint: how many
connections an episode holds open, how large and how slow a request may be, and what the gateway
refused (which counts against the episode). See GatewayLimits for the numbers."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from rollway.gateway.config import GatewayLimits
from rollway.runtime import metrics

if TYPE_CHECKING:
    from rollway.gateway.server import EpisodeHandle

log = structlog.get_logger()

EPISODE: web.RequestKey = web.RequestKey("rollway.episode", object)
"""Request key of the episode whose socket a request came in on (absent on the shared TCP listener)."""

REFUSED_LIMIT = "refused_limit"
"""`EpisodeHandle.stop_reason` once an episode reached `max_refused`."""

_NOT_COUNTED = {409, 429}
"""4xx answers that are not the program's abuse: its episode ended or reached a limit already."""


def refuse(handle: EpisodeHandle | None, limits: GatewayLimits, what: str) -> None:
    """Count one refused request or connection against `handle`'s episode; at `max_refused` the episode
    is marked to end (its driver polls `stop_reason`)."""
    if handle is None:
        return
    handle.refused += 1
    if handle.refused >= limits.max_refused and handle.stop_reason is None:
        handle.stop_reason = REFUSED_LIMIT
        log.warning("episode reached its limit of refused requests", episode_id=handle.episode.episode_id,
                    refused=handle.refused, last=what)


def _refusal(status: int, code: str, message: str) -> web.Response:
    response = web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                            "code": code}}, status=status)
    response.force_close()  # whatever is left of the request is not read
    return response


def bounds_middleware(limits: GatewayLimits, episode_of: Any) -> Any:
    """An aiohttp middleware (so it covers every endpoint): the body size is checked before reading,
    the body read within `body_timeout_s`, and 4xx answers count against the request's episode.
    `episode_of(request)`: the episode a credential names, or None."""

    @web.middleware
    async def counted(request: web.Request, handler: Any) -> web.StreamResponse:
        response = await bounded(request, handler)
        if response.status >= 400:
            metrics.GATEWAY_REFUSALS.labels("agent", str(response.status)).inc()
        return response

    async def bounded(request: web.Request, handler: Any) -> web.StreamResponse:
        handle = request.get(EPISODE) or episode_of(request)
        if handle is not None and handle.stop_reason == REFUSED_LIMIT:
            return _refusal(409, "refused_limit_reached", f"episode {handle.episode.episode_id} made too many "
                            "refused requests; no more are taken")
        if request.can_read_body:
            length = request.content_length
            if length is not None and length > limits.max_request_bytes:
                refuse(handle, limits, "request too large")
                return _refusal(413, "request_too_large", f"the request body is {length} bytes; at most "
                                f"{limits.max_request_bytes} are read (agent.harness.limits.max_request_bytes)")
            try:
                async with asyncio.timeout(limits.body_timeout_s):
                    await request.read()  # cached: handlers read it again for free
            except TimeoutError:
                refuse(handle, limits, "body too slow")
                return _refusal(408, "request_timeout", f"the request body did not arrive within "
                                f"{limits.body_timeout_s:g}s (agent.harness.limits.body_timeout_s)")
            except web.HTTPRequestEntityTooLarge:
                refuse(handle, limits, "request too large")
                return _refusal(413, "request_too_large", f"the request body passed {limits.max_request_bytes} "
                                "bytes (agent.harness.limits.max_request_bytes)")
        response = await handler(request)
        if 400 <= response.status < 500 and response.status not in _NOT_COUNTED:
            refuse(handle, limits, f"answered {response.status}")
        return response

    return counted


class _EpisodeServer(web.Server):
    """The app's request handling for the connections of one episode's socket: its requests carry the
    episode (`request[EPISODE]`), and each closed connection is reported to the listener."""

    def __init__(self, base: web.Server, handle: EpisodeHandle, on_lost: Any, **kwargs: Any) -> None:
        super().__init__(base.request_handler, request_factory=self._tagged, **kwargs)
        self._base_factory, self.handle, self._on_lost = base.request_factory, handle, on_lost

    def _tagged(self, *args: Any) -> Any:
        request = self._base_factory(*args)
        request[EPISODE] = self.handle
        return request

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._on_lost()


class EpisodeListener:
    """Serves one episode's unix socket with at most `max_connections` connections open at once: one
    more is accepted and closed at once, and counted as refused. An idle or trickling connection is
    closed `header_timeout_s` after it opened or its last answer ended (aiohttp's keep-alive timer,
    armed from the connection's start)."""

    def __init__(self, sock: socket.socket, base: web.Server, handle: EpisodeHandle, limits: GatewayLimits) -> None:
        self.sock, self.handle, self.limits = sock, handle, limits
        self.open = 0
        self.server = _EpisodeServer(base, handle, self._lost, access_log=None,
                                     keepalive_timeout=limits.header_timeout_s)
        self._task: asyncio.Task | None = None

    def _lost(self) -> None:
        self.open -= 1
        self.handle.connections = self.open

    async def start(self) -> None:
        self.sock.listen(128)
        self.sock.setblocking(False)
        self._task = asyncio.create_task(self._accept(), name=f"gateway-accept-{self.handle.episode.episode_id}")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("gateway cannot accept (out of descriptors or memory); retrying",
                                episode_id=self.handle.episode.episode_id, error=str(err))
                    await asyncio.sleep(0.5)
                    continue
                raise
            if self.open >= self.limits.max_connections or self.handle.closed:
                conn.close()
                refuse(self.handle, self.limits, "too many connections")
                continue
            self.open += 1
            self.handle.connections = self.open
            try:
                await loop.connect_accepted_socket(self.server, conn)
            except OSError:
                self._lost()
                conn.close()

    async def stop(self) -> None:
        """Stop accepting, close the socket and every connection of the episode."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close()
        self.server.pre_shutdown()
        await self.server.shutdown(1.0)
