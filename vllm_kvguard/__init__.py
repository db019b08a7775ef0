"""vllm-kvguard: checksums for vLLM's KV-cache pages.

Install next to vLLM and set ``VLLM_KVGUARD=1``. See the README and docs/.
"""

from __future__ import annotations

from typing import Any

from vllm_kvguard.config import KVGuardConfig, Mode, load_config
from vllm_kvguard.errors import KVCacheCorruptionError, KVGuardConfigError

__version__ = "0.1.0"


def raise_for_corruption(output: Any) -> None:
    """Raise :class:`KVCacheCorruptionError` if a vLLM ``RequestOutput`` was ended by the guard.

    In ``raise`` mode vLLM ends a request that read a corrupted page with
    ``finish_reason == "error"``; the guard puts its message in ``stop_reason``.
    """
    for completion in getattr(output, "outputs", ()):
        if completion.finish_reason == "error" and isinstance(completion.stop_reason, str):
            error = KVCacheCorruptionError.parse(completion.stop_reason, getattr(output, "request_id", None))
            if error is not None:
                raise error


__all__ = [
    "KVCacheCorruptionError",
    "KVGuardConfig",
    "KVGuardConfigError",
    "Mode",
    "__version__",
    "load_config",
    "raise_for_corruption",
]
