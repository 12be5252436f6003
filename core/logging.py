"""structlog setup: readable lines on the console, JSON lines in the run folder, stage on every line."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import structlog

_SECRET = re.compile(r"(?i)(api[_-]?key|token|password|secret|authorization)(['\"]?\s*[:=]\s*['\"]?)([^\s'\",]+)")


def redact(text: str) -> str:
    """Mask values that look like credentials (key=..., token: ...)."""
    return _SECRET.sub(lambda m: m.group(1) + m.group(2) + "***", text)


def _redact_processor(_, __, event_dict: dict) -> dict:
    for k, v in list(event_dict.items()):
        if isinstance(v, str):
            event_dict[k] = redact(v)
    return event_dict


def _console_prefix(_, __, event_dict: dict) -> dict:
    """Console lines start with `[stage episode]` so a reader can follow one episode by eye."""
    tags = [str(v) for v in (event_dict.pop("stage", None), event_dict.pop("episode_id", None)) if v]
    if tags:
        event_dict["event"] = f"[{' '.join(tags)}] {event_dict.get('event', '')}"
    return event_dict


def configure_logging(stage: str, run_dir: Path | None = None, level: str = "INFO") -> None:
    """Console lines to stderr; with a run folder also `logs/<stage>.jsonl` there."""
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        _redact_processor,
    ]
    structlog.contextvars.bind_contextvars(stage=stage)
    handlers: list[logging.Handler] = []
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _console_prefix,
                    structlog.dev.ConsoleRenderer(colors=False)], foreign_pre_chain=shared))
    handlers.append(console)
    if run_dir is not None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(run_dir / "logs" / f"{stage}.jsonl")
        fh.setFormatter(structlog.stdlib.ProcessorFormatter(
            processor=structlog.processors.JSONRenderer(), foreign_pre_chain=shared))
        handlers.append(fh)
    root = logging.getLogger()
    root.handlers = handlers
    root.setLevel(level)
    for noisy in ("aiokafka", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        cache_logger_on_first_use=False,
    )
