"""The guard's configuration: read from the environment once, validated, frozen.

No other module reads ``os.environ``. The front-end process parses the
environment and hands the result to the engine and worker processes inside
vLLM's ``kv_connector_extra_config`` (see :meth:`KVGuardConfig.to_dict`), so that
every process runs with the same, already validated, settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

from vllm_kvguard.errors import KVGuardConfigError

PREFIX = "VLLM_KVGUARD"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class Mode(StrEnum):
    """What the guard does when a page fails verification."""

    QUARANTINE = "quarantine"
    RAISE = "raise"
    LOG = "log"


class VerifyPolicy(StrEnum):
    """Which sealed pages are verified, besides every prefix-cache hit."""

    REUSE = "reuse"  # only prefix-cache hits, before the forward that reads them
    SAMPLED = "sampled"  # plus pages running requests read, round-robin within a byte budget
    PARANOID = "paranoid"  # plus every sealed page every step's attention reads


class NonFiniteAction(StrEnum):
    """What the guard does with a page that holds NaN/Inf when it is sealed."""

    MODE = "mode"  # the same action as VLLM_KVGUARD_MODE
    LOG = "log"  # report and count only
    OFF = "off"  # do not look


class SuspectAction(StrEnum):
    """What happens to a request that emitted tokens computed from a page later found bad
    (quarantine mode; raise mode fails it anyway, log mode only flags it)."""

    FAIL = "fail"  # end it with an error that names the block
    FLAG = "flag"  # let it finish; stop_reason, log line and metric say it is suspect


class HashAlgorithm(StrEnum):
    XXH3_64 = "xxh3_64"
    XXH64 = "xxh64"
    # The device digest (kernel.py); chosen by itself for KV caches on a GPU. Asking for it
    # forces the kernel path (on CPU only under TRITON_INTERPRET=1: how tests run it).
    KVG64 = "kvg64"


class LogFormat(StrEnum):
    AUTO = "auto"
    JSON = "json"
    CONSOLE = "console"


# The key of the guard's KV-connector extra config that names the connectors beside it in a
# MultiConnector (set by the plugin): pages they load are checked (digest/loads.py).
BESIDE_KEY = "kvguard_beside"


@dataclass(frozen=True)
class KVGuardConfig:
    """Effective settings. Field docs are the configuration reference (docs/configuration.md)."""

    enabled: bool = False
    mode: Mode = Mode.QUARANTINE
    verify: VerifyPolicy = VerifyPolicy.SAMPLED
    verify_budget_bytes: int = 256 << 10
    verify_every: int = 4
    scrub_interval_s: float = 300.0
    scrub_budget_bytes: int = 1 << 20
    nonfinite: NonFiniteAction = NonFiniteAction.MODE
    suspect: SuspectAction = SuspectAction.FAIL
    repair: bool = True
    rows: bool = True
    finish_check: bool = True
    hash: HashAlgorithm = HashAlgorithm.XXH3_64
    quarantine_max_fraction: float = 0.02
    load_digests_bytes: int = 16 << 20
    load_digest_sets: int = 4
    load_audit: float = 0.05
    digest_dir: str | None = None
    digest_dir_bytes: int = 256 << 20
    log_format: LogFormat = LogFormat.AUTO
    log_file: str | None = None
    log_level: str = "INFO"
    inject: str | None = None
    metrics_port: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, StrEnum) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVGuardConfig:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        enums = (
            ("mode", Mode),
            ("verify", VerifyPolicy),
            ("nonfinite", NonFiniteAction),
            ("suspect", SuspectAction),
            ("hash", HashAlgorithm),
            ("log_format", LogFormat),
        )
        for name, enum in enums:
            if name in kw:
                kw[name] = enum(kw[name])
        return cls(**kw)

    @property
    def nonfinite_mode(self) -> Mode | None:
        """The action on a non-finite page (None: not checked)."""
        if self.nonfinite == NonFiniteAction.OFF:
            return None
        if self.nonfinite == NonFiniteAction.LOG:
            return Mode.LOG
        return self.mode


def _choice(var: str, raw: str, enum: type[StrEnum]) -> Any:
    value = raw.strip().lower()
    try:
        return enum(value)
    except ValueError:
        accepted = " | ".join(m.value for m in enum)  # type: ignore[attr-defined]
        raise KVGuardConfigError(var, raw, accepted) from None


def _switch(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise KVGuardConfigError(var, raw, "1 or 0 (also true/false, yes/no, on/off)")


def _fraction(var: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise KVGuardConfigError(var, raw, "a number between 0 and 1")
    return value


_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "kb": 1 << 10,
    "k": 1 << 10,
    "mib": 1 << 20,
    "mb": 1 << 20,
    "m": 1 << 20,
}
_UNITS |= {"gib": 1 << 30, "gb": 1 << 30, "g": 1 << 30}


def _bytes(var: str, raw: str) -> int:
    text = raw.strip().lower()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :].strip()
    if not number.strip().isdigit() or unit not in _UNITS or int(number) * _UNITS[unit] < 1:
        raise KVGuardConfigError(var, raw, "a positive size in bytes, e.g. 4194304, 512KiB or 4MiB")
    return int(number) * _UNITS[unit]


_SECONDS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def _interval(var: str, raw: str) -> float:
    text = raw.strip().lower()
    if text == "off":
        return 0.0
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :].strip()
    try:
        value = float(number) * _SECONDS[unit]
    except (ValueError, KeyError):
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise KVGuardConfigError(var, raw, "a duration such as 300, 30s, 5m or 1h (0 or off: no scrubbing)")
    return value


def _log_level(var: str, raw: str) -> str:
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    value = raw.strip().upper()
    if value not in levels:
        raise KVGuardConfigError(var, raw, " | ".join(levels))
    return value


def _steps(var: str, raw: str) -> int:
    text = raw.strip()
    if not text.isdigit() or not 1 <= int(text) <= 1_000_000:
        raise KVGuardConfigError(var, raw, "a whole number of engine steps, 1 to 1000000 (1: every step)")
    return int(text)


def _digest_sets(var: str, raw: str) -> int:
    text = raw.strip()
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise KVGuardConfigError(var, raw, "a whole number of digest sets per page identity, 1 to 64")
    return int(text)


def _port(var: str, raw: str) -> int | None:
    text = raw.strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise KVGuardConfigError(var, raw, "a TCP port number 1-65535 (or empty for none)")
    return int(text)


def _digest_dir(var: str, raw: str) -> str | None:
    """A folder engines share page digests through (created if missing, like a log file's
    folder must exist: its parent must)."""
    text = raw.strip()
    if not text:
        return None
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(path) and not os.path.isdir(path):
        raise KVGuardConfigError(var, raw, f"a folder (or a path to create one): {path} is a file")
    if not os.path.isdir(path) and not os.path.isdir(os.path.dirname(path)):
        raise KVGuardConfigError(
            var,
            raw,
            f"a folder, or a path to create one in an existing folder: {os.path.dirname(path)} is missing",
        )
    if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
        raise KVGuardConfigError(var, raw, f"a folder the engine can write: {path} is not writable")
    return path


def _log_file(var: str, raw: str) -> str | None:
    """A file the guard can append to: checked here, before any engine process starts, so that a
    typo stops start-up with one line instead of killing the engine core later."""
    text = raw.strip()
    if not text:
        return None
    path = os.path.abspath(os.path.expanduser(text))
    folder = os.path.dirname(path)
    why = ""
    if os.path.isdir(path):
        why = f"{path} is a folder"
    elif os.path.exists(path) and not os.access(path, os.W_OK):
        why = f"{path} is not writable"
    elif not os.path.isdir(folder):
        why = f"the folder {folder} does not exist"
    elif not os.access(folder, os.W_OK | os.X_OK):
        why = f"the folder {folder} is not writable"
    if why:
        raise KVGuardConfigError(var, raw, f"a file path in an existing, writable folder ({why})")
    return path


def _inject(var: str, raw: str) -> str | None:
    from vllm_kvguard.core.faults import parse_fault_spec

    text = raw.strip()
    if not text:
        return None
    parse_fault_spec(text, variable=var)
    return text


# Variable suffix -> (field name, parser). The single list of what the guard reads.
_VARIABLES = {
    "": ("enabled", _switch),
    "_MODE": ("mode", lambda var, raw: _choice(var, raw, Mode)),
    "_VERIFY": ("verify", lambda var, raw: _choice(var, raw, VerifyPolicy)),
    "_VERIFY_BUDGET": ("verify_budget_bytes", _bytes),
    "_VERIFY_EVERY": ("verify_every", _steps),
    "_SCRUB_INTERVAL": ("scrub_interval_s", _interval),
    "_SCRUB_BUDGET": ("scrub_budget_bytes", _bytes),
    "_NONFINITE": ("nonfinite", lambda var, raw: _choice(var, raw, NonFiniteAction)),
    "_SUSPECT": ("suspect", lambda var, raw: _choice(var, raw, SuspectAction)),
    "_REPAIR": ("repair", _switch),
    "_ROWS": ("rows", _switch),
    "_FINISH_CHECK": ("finish_check", _switch),
    "_HASH": ("hash", lambda var, raw: _choice(var, raw, HashAlgorithm)),
    "_QUARANTINE_MAX_FRACTION": ("quarantine_max_fraction", _fraction),
    "_LOAD_DIGESTS": ("load_digests_bytes", _bytes),
    "_LOAD_DIGEST_SETS": ("load_digest_sets", _digest_sets),
    "_LOAD_AUDIT": ("load_audit", _fraction),
    "_DIGEST_DIR": ("digest_dir", _digest_dir),
    "_DIGEST_DIR_BYTES": ("digest_dir_bytes", _bytes),
    "_LOG_FORMAT": ("log_format", lambda var, raw: _choice(var, raw, LogFormat)),
    "_LOG_FILE": ("log_file", _log_file),
    "_LOG_LEVEL": ("log_level", _log_level),
    "_INJECT": ("inject", _inject),
    "_METRICS_PORT": ("metrics_port", _port),
}


def variable_names() -> list[str]:
    return [PREFIX + suffix for suffix in _VARIABLES]


def load_config(environ: Mapping[str, str] | None = None) -> KVGuardConfig:
    """Parse every ``VLLM_KVGUARD*`` variable; raise :class:`KVGuardConfigError` on the first bad one."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in sorted(k for k in env if k == PREFIX or k.startswith(PREFIX + "_")):
        suffix = name[len(PREFIX) :]
        if suffix not in _VARIABLES:
            raise KVGuardConfigError(name, env[name], "a known variable name: " + ", ".join(variable_names()))
        field_name, parse = _VARIABLES[suffix]
        values[field_name] = parse(name, env[name])
    config = KVGuardConfig(**values)
    if config.inject and not config.enabled:
        raise KVGuardConfigError(
            PREFIX + "_INJECT",
            config.inject,
            "to be unset unless VLLM_KVGUARD=1 (fault injection needs the guard on)",
        )
    return config
