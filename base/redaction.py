"""Masking of credentials in text that leaves a rollway process (log lines, tracebacks, child output,
failure reasons, summaries): credential shapes, and the exact values of the secrets configured for
this run (`register_secrets`). Lives in `base` so every package (policies, actors, runners) can use it."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any

MASK = "***"
_KEYS = r"[\w-]*(?:api[_-]?key|apikey|token|password|passwd|secret)"
_PAIR = re.compile(rf"(?i)\b({_KEYS})(['\"]?\s*[:=]\s*['\"]?)([^\s'\",&;}}]+)")
"""`api_key=VALUE`, `"password": "VALUE"`, `token: VALUE`: the value is masked, the key kept."""
_AUTH_HEADER = re.compile(r"(?i)\b(authorization['\"]?\s*[:=]\s*['\"]?)(?:(basic|bearer|token)\s+)?([^\s'\",]+)")
"""`Authorization: Bearer TOKEN` / `Authorization: Basic B64` / `Authorization: TOKEN`."""
_BEARER = re.compile(r"(?i)\b(bearer)(\s+|-)([A-Za-z0-9._~+/=-]+)")
"""A bearer token on its own (`Bearer TOKEN`), also the `Bearer-TOKEN` typo shape."""
URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s@'\"]+)@")
"""`scheme://user:pass@host`: the whole user-info part is masked (a user name can itself be a token)."""
_MIN_SECRET_LEN = 4
"""Shorter configured values (a one-letter password) are not searched for: they would mask ordinary words."""

_known: set[str] = set()
_known_lock = threading.Lock()


def register_secrets(values: Iterable[str | None]) -> None:
    """Mask these exact values wherever they appear from now on (the secrets configured for this run)."""
    with _known_lock:
        _known.update(v for v in values if v and len(v) >= _MIN_SECRET_LEN)


def mask_url_credentials(text: str) -> str:
    """`text` with the user-info of every URL in it replaced by `***` (`https://***@host/v1`)."""
    return URL_USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)


def redact(text: str) -> str:
    """`text` with credentials masked: known secrets, user-info in URLs, Authorization headers,
    bearer tokens and key=value pairs whose key names a credential."""
    for value in sorted(_known, key=len, reverse=True):  # longest first: one secret may contain another
        if value in text:
            text = text.replace(value, MASK)
    text = mask_url_credentials(text)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + (f"{m.group(2)} " if m.group(2) else "") + MASK, text)
    text = _BEARER.sub(lambda m: m.group(1) + m.group(2) + MASK if m.group(3) != MASK else m.group(0), text)
    return _PAIR.sub(lambda m: m.group(1) + m.group(2) + MASK, text)


def redact_data(value: Any) -> Any:
    """`redact` applied to every string inside JSON-like data (summaries, reports, failure records)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_data(v) for v in value]
    return value
