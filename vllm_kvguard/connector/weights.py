"""The weights' identity of the model vLLM serves (digest/weights.py), found from vLLM's config.

The model is a local folder or file, or a Hugging Face id whose snapshot vLLM downloaded into the
local cache (found without the network). Hashed once per process for the same files (both sides
of the guard ask).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from vllm_kvguard.digest import weights


def weights_identity(vllm_config: Any) -> tuple[int, str]:
    """(identity, how it was found: "files" or "name") of the model ``vllm_config`` serves."""
    model = vllm_config.model_config
    context = "|".join(
        str(x)
        for x in (
            getattr(model, "dtype", ""),
            getattr(vllm_config.cache_config, "cache_dtype", ""),
            getattr(model, "quantization", ""),
        )
    )
    return _identity(str(model.model), str(getattr(model, "revision", None) or ""), context)


def _identity(name: str, revision: str, context: str) -> tuple[int, str]:
    files = weights.weight_files(name)
    if not files:
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(name, revision=revision or None, local_files_only=True)
            files = weights.weight_files(folder)
        except Exception:  # not a hub id, or not in the local cache: the name stands in
            files = []
    if files:
        stats = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        return _of_files(stats, context), "files"
    return weights.of_name(f"{name}@{revision}", context), "name"


@functools.lru_cache(maxsize=8)
def _of_files(stats: tuple[tuple[str, int, int], ...], context: str) -> int:
    """Once per process for the same files as they are now (a file rewritten in place, as by a
    redeploy, has another size or modification time)."""
    return weights.fingerprint([Path(path) for path, _, _ in stats], context)
