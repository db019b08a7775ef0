"""Structured logs (structlog): every guard event becomes one log line.

Lines go through the standard-library logger ``vllm.kvguard``, a child of vLLM's
``vllm`` logger, so they share vLLM's handlers, prefix, level and any logging
configuration the operator gave vLLM (``VLLM_LOGGING_CONFIG_PATH``). The message
is rendered by structlog: JSON when asked (``VLLM_KVGUARD_LOG_FORMAT=json``) or,
with ``auto``, when vLLM's logging configuration uses a JSON formatter; readable
``key=value`` console lines otherwise. With ``VLLM_KVGUARD_LOG_FILE`` every line
is also appended to that file as one JSON object (for tools and fire drills).

The guard never reconfigures structlog globally, so an application's own
structlog setup is left alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import traceback
from collections.abc import Mapping
from typing import Any, TextIO

import structlog

from vllm_kvguard.config import KVGuardConfig, LogFormat
from vllm_kvguard.core.events import InternalError

LOGGER_NAME = "vllm.kvguard"
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}


def vllm_logs_json(config_path: str | None) -> bool:
    """Whether vLLM's logging config (``VLLM_LOGGING_CONFIG_PATH``) uses a JSON formatter."""
    if not config_path:
        return False
    try:
        with open(config_path) as f:
            return "json" in f.read().lower()
    except OSError:
        return False


def _render_format(config: KVGuardConfig) -> LogFormat:
    if config.log_format != LogFormat.AUTO:
        return config.log_format
    return LogFormat.JSON if vllm_logs_json(os.environ.get("VLLM_LOGGING_CONFIG_PATH")) else LogFormat.CONSOLE


class _FileSink:
    """Appends JSON lines to a file; one lock so lines from threads never interleave."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def write(self, line: str) -> None:
        with self._lock:
            self._file.write(line + "\n")


def power_of_two(n: int) -> bool:
    """Whether the n-th occurrence of a repeated error is logged (1st, 2nd, 4th, 8th...), so
    that a bug hit on every step does not flood the logs."""
    return n > 0 and n & (n - 1) == 0


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _flat(record: Mapping[str, Any], hidden: tuple[str, ...]) -> dict[str, Any]:
    """A console line's fields: nested settings (``config``, ``details``) spread into plain
    ``key=value`` pairs, unset ones dropped, so that no Python dict is printed."""
    shown: dict[str, Any] = {}
    for key, value in record.items():
        if key in hidden:
            continue
        if isinstance(value, dict):
            shown.update({k: v for k, v in value.items() if v is not None and k not in hidden})
        else:
            shown[key] = value
    return shown


class GuardLog:
    """The guard's logger, with role, rank, engine and model bound as context."""

    def __init__(self, config: KVGuardConfig, **context: Any) -> None:
        self._std = logging.getLogger(LOGGER_NAME)
        self._level = _LEVELS[config.log_level]
        self._context = {"logger": LOGGER_NAME, "pid": os.getpid(), **context}
        self.engine = str(context.get("engine", "0"))
        stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
        self._stamp = stamp
        self._json = structlog.processors.JSONRenderer(sort_keys=False)
        self._render = (
            self._json
            if _render_format(config) == LogFormat.JSON
            else structlog.dev.ConsoleRenderer(colors=False, pad_event_to=0)
        )
        self._file = _FileSink(config.log_file) if config.log_file else None

    def internal_error(self, where: str, exc: Exception, count: int) -> None:
        """The ``count``-th internal error of this role, with its traceback, rate-limited by
        :func:`power_of_two` (call it from the ``except`` block)."""
        if power_of_two(count):
            self.event(
                "kvguard_internal_error",
                InternalError(where, repr(exc), count),
                level="error",
                traceback=traceback.format_exc(),
            )

    def event(
        self, name: str, obj: object, level: str = "info", *, console_skip: tuple[str, ...] = (), **extra: Any
    ) -> None:
        """One event as one line; ``console_skip``: fields left out of console lines only (the
        JSON line and the log file keep every field)."""
        fields = {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}  # type: ignore[call-overload]
        self.line(name, level, console_skip=console_skip, **fields, **extra)

    def line(
        self, name: str, level: str = "info", *, console_skip: tuple[str, ...] = (), **fields: Any
    ) -> None:
        number = _LEVELS.get(level.upper(), logging.INFO)
        if number < self._level:
            return
        record = self._stamp(None, level, {**self._context, **fields, "event": name, "level": level})
        if self._file is not None:
            self._file.write(str(self._json(None, level, dict(record))))
        if self._render is self._json:
            self._std.log(number, self._json(None, level, dict(record)))
        else:
            hidden = ("logger", "pid", "timestamp", "level", *console_skip)
            self._std.log(number, self._render(None, level, _flat(record, hidden)))
