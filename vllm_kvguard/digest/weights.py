"""The model's weights, as a 64-bit identity: what a page's KV was computed by.

A page's identity (digest/identity.py) covers the inputs it was computed from; the weights that
computed it are the other half. Two engines serving "the same model" after a redeploy with other
weights (a fine-tune pushed under the same name, another revision) compute other KV for the same
tokens: a page one of them stored in a shared LMCache, or published in a shared digest folder,
must never verify in the other. The identity is mixed into every page fingerprint's root and names
the digest folder's namespace (digest/store.py).

Cheap, at start: each weights file's name and size, and its bytes at three fixed places (the first,
middle and last 64 KiB: a retrained or fine-tuned model differs everywhere), hashed with XXH3-64,
with the dtype, KV-cache dtype and quantization the engine computes with. Where no weights file is
found locally, the model's name and revision stand in (said in the start-up line).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import xxhash

SAMPLE = 64 << 10
SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_files(where: str | Path) -> list[Path]:
    """The weights files of a local model: a folder's files with a weights suffix (not its
    subfolders), or the file itself."""
    path = Path(where)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)


def fingerprint(files: Sequence[Path], context: str) -> int:
    """XXH3-64 over ``context`` and each file's name, size and bytes at its start, middle and end
    (never the file's folder: the same weights in another place are the same weights)."""
    h = xxhash.xxh3_64()
    h.update(context.encode())
    for path in sorted(files, key=lambda p: p.name):
        size = os.path.getsize(path)
        h.update(f"\x1f{path.name}\x1e{size}".encode())
        with open(path, "rb") as f:
            for at in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
                f.seek(at)
                h.update(f.read(SAMPLE))
    return h.intdigest() or 1


def of_name(name: str, context: str) -> int:
    """The stand-in where no weights file is found: the model's name (and revision) only."""
    return xxhash.xxh3_64_intdigest(f"{context}\x1fname={name}".encode()) or 1
