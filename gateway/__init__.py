"""An OpenAI-compatible gateway in front of a rollway engine: external agent programs call it, and every
call is captured token-exact and recorded in the log before it is answered.

The names below load on first use: the config root imports `rollway.gateway.config`, and every stage
process would otherwise pay for the HTTP server (aiohttp) it never starts."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "EpisodeCapture": "capture", "RequestError": "protocol", "CallRecorder": "recorder", "KafkaRecorder": "recorder",
    "MemoryRecorder": "recorder", "RecordFailed": "recorder", "RecordTooLarge": "recorder", "EpisodeHandle": "server",
    "Gateway": "server", "CallLogError": "trajectory", "Segment": "trajectory", "rebuild_segments": "trajectory",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rollway.gateway' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rollway.gateway.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
