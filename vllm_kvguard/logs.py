"""Structured logs (structlog): every guard event becomes one log line.

Lines go to stderr and, when ``VLLM_KVGUARD_LOG_FILE`` is set, are appended to
that file too (one JSON object per line with the ``json`` format). The guard
never reconfigures structlog globally, so an application's own structlog setup
is left alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from typing import Any, TextIO

import structlog

from vllm_kvguard.config import KVGuardConfig, LogFormat

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}


class _Sink:
    """Writes each rendered line to stderr and the optional log file, atomically per line."""

    def __init__(self, path: str | None) -> None:
        self._lock = threading.Lock()
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def msg(self, line: str) -> None:
        with self._lock:
            sys.stderr.write(line + "\n")
            if self._file is not None:
                self._file.write(line + "\n")

    log = debug = info = warning = error = critical = exception = msg


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


class GuardLog:
    """The guard's logger, with rank, role, engine and model bound as context."""

    def __init__(self, config: KVGuardConfig, **context: Any) -> None:
        renderer: Any = (
            structlog.processors.JSONRenderer(sort_keys=False)
            if config.log_format == LogFormat.JSON
            else structlog.dev.ConsoleRenderer(colors=False)
        )
        processors = [
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ]
        self._log = structlog.wrap_logger(
            _Sink(config.log_file),
            processors=processors,
            wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[config.log_level]),
        ).bind(logger="vllm_kvguard", pid=os.getpid(), **context)

    def event(self, name: str, obj: object, level: str = "info", **extra: Any) -> None:
        fields = {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}  # type: ignore[call-overload]
        getattr(self._log, level)(name, **fields, **extra)

    def line(self, name: str, level: str = "info", **fields: Any) -> None:
        getattr(self._log, level)(name, **fields)
