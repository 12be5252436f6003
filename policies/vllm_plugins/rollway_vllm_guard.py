"""Loaded into vLLM's API server (`--middleware rollway_vllm_guard.RequireKey`, this folder on its
PYTHONPATH): every route needs `Authorization: Bearer $VLLM_API_KEY`, not only the ones vLLM guards.

Why: vLLM 0.32's own AuthenticationMiddleware checks the key only on paths under /v1, /v2, /inference
and /cohere (GUARDED_PREFIX in vllm/entrypoints/serve/middleware/authenticate.py). The routes that
VLLM_SERVER_DEV_MODE=1 registers, which rollway needs for weight updates (/pause, /resume,
/collective_rpc, /reset_prefix_cache, /update_weight_version, /weight_info, /sleep, ...), are
outside them: without this guard anything on the host could reload the weights or call any worker
method. Only liveness and metrics (read-only) stay open. Standalone: vLLM's environment has no rollway."""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
"""Read-only routes a readiness probe or a metrics sampler calls without the key."""


class RequireKey:
    """Pure ASGI middleware: a request without the bearer key gets 401 (a websocket is closed)."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get("VLLM_API_KEY")
        if not key:
            raise RuntimeError("rollway_vllm_guard.RequireKey needs VLLM_API_KEY in vLLM's environment")
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "Unauthorized: this server needs its API key on every route"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
