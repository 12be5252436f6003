"""structlog setup: readable lines on the console, JSON lines in the run folder, stage on every line.

Every line that leaves a rollway process (structlog and stdlib records, their tracebacks, and the
captured stdout/stderr of the processes `rollway up` starts) passes `redact`, which masks credential
shapes and the values of the secrets configured for this run (`register_secrets`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import structlog

from rollway.base.process import spawn_logged
from rollway.base.redaction import MASK, redact, redact_data, register_secrets
from rollway.base.run_dir import RunDir

__all__ = ["MASK", "configure_logging", "redact", "redact_data", "register_secrets", "spawn_logged"]


class RedactingFormatter(structlog.stdlib.ProcessorFormatter):
    """Redacts the finished line, so the traceback (rendered after every processor ran) is covered too."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


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


def _line_stage(record: logging.LogRecord) -> str | None:
    """The stage a log record belongs to: the `stage` bound in the context that wrote it (a one-process
    job's stage tasks each bind theirs), else one the line itself names."""
    stage = structlog.contextvars.get_contextvars().get("stage")
    if stage is None and isinstance(record.msg, dict):
        stage = record.msg.get("stage")
    return stage


class _StageFilter(logging.Filter):
    """Passes the records of `stages` (include) or of every other stage (exclude)."""

    def __init__(self, stages: set[str], include: bool):
        super().__init__()
        self.stages, self.include = stages, include

    def filter(self, record: logging.LogRecord) -> bool:
        return (_line_stage(record) in self.stages) == self.include


def configure_logging(stage: str, run_dir: Path | None = None, level: str = "INFO", *, console: bool = True,
                      local_stages: tuple[str, ...] = ()) -> None:
    """Console lines to stderr; with a run folder also `logs/<stage>.jsonl` there. `local_stages`: stages
    running as tasks of this process (a one-process job): their lines go to their own `logs/STAGE.jsonl`
    and `logs/STAGE-0.out`, as a stage process's would, not to this process's console and log."""
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        _redact_processor,
    ]
    structlog.contextvars.bind_contextvars(stage=stage)

    def console_format() -> logging.Formatter:
        return RedactingFormatter(processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                                              _console_prefix, structlog.dev.ConsoleRenderer(colors=False)],
                                  foreign_pre_chain=shared)

    def json_file(path: Path) -> logging.Handler:
        fh = logging.FileHandler(path)
        fh.setFormatter(RedactingFormatter(  # format_exc_info: stdlib records keep their traceback too
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
            foreign_pre_chain=shared))
        return fh

    handlers: list[logging.Handler] = []
    if console:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(console_format())
        handlers.append(stream)
    if run_dir is not None:
        RunDir(run_dir).logs.mkdir(parents=True, exist_ok=True)
        handlers.append(json_file(RunDir(run_dir).json_log(stage)))
    if local_stages:
        for handler in handlers:
            handler.addFilter(_StageFilter(set(local_stages), include=False))
        for name in local_stages if run_dir is not None else ():
            out = logging.FileHandler(RunDir(run_dir).stage_log(name, 0))
            out.setFormatter(console_format())
            for handler in (json_file(RunDir(run_dir).json_log(name)), out):
                handler.addFilter(_StageFilter({name}, include=True))
                handlers.append(handler)
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


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is when a line is written, not when logging was configured (a
    caller that swaps stderr, a test capturing it, must not leave the logger holding a closed stream)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def log_to_stderr() -> None:
    """Console log lines to stderr only (commands whose stdout is their result: `tasks verify --json`,
    `grader check --json`)."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()))
