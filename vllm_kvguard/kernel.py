"""On-device page digests: KVG64, a Triton kernel and its numpy reference.

XXH3 is a sequential hash: one page is one dependent chain, which a GPU cannot
spread over its threads. KVG64 keeps XXH64's round and final mix but makes
every 8-byte word independent, so a page is hashed by many threads at once and
summed. Over a byte string ``s`` of ``n`` bytes:

    pad s with zero bytes to a multiple of 8; w_j = little-endian uint64 word j, j = 0 .. m-1
    t_j    = avalanche(round((j + 1) * P5, w_j))       round(a, x) = rotl64(a + x * P2, 31) * P1
    h      = (t_0 + t_1 + ... + t_{m-1}) mod 2**64
    digest = avalanche(h xor (n * P3))

``avalanche`` is XXH64's final mix (x ^= x >> 33; x *= P2; x ^= x >> 29; x *= P3;
x ^= x >> 32) and P1..P5 are XXH64's primes; all arithmetic is mod 2**64. For a
fixed position ``j`` every step from ``w_j`` to ``t_j`` is a bijection, so a change
confined to one 8-byte word (any bit flip, any overwritten element) always changes
the digest; wider changes collide with probability about 2**-64. A page made of
several runs (K and V apart) is hashed as the concatenation of its runs; every
run but the last must then be a multiple of 8 bytes (true of vLLM's layouts).

:func:`kvg64_reference` (numpy) defines the digest; :func:`kvg64_pages` runs the
kernel on the device the tensor lives on (or under ``TRITON_INTERPRET=1`` on the
CPU, which is how CI checks the kernel bit for bit against the reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F
P3 = 0x165667B19E3779F9
P5 = 0x27D4EB2F165667C5
_MASK = (1 << 64) - 1


# ------------------------------------------------------------------ reference


def _avalanche(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(P2)
    x = x ^ (x >> np.uint64(29))
    x = x * np.uint64(P3)
    return x ^ (x >> np.uint64(32))


def kvg64_reference(pages: Sequence[bytes] | np.ndarray) -> np.ndarray:
    """KVG64 of each byte string (or each row of a uint8 array), uint64. The definition."""
    rows = [bytes(p) for p in pages] if not isinstance(pages, np.ndarray) else [r.tobytes() for r in pages]
    out = np.empty(len(rows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i, raw in enumerate(rows):
            n = len(raw)
            padded = raw + b"\0" * (-n % 8)
            words = np.frombuffer(padded, dtype="<u8").astype(np.uint64)
            keys = (np.arange(1, len(words) + 1, dtype=np.uint64) * np.uint64(P5)).astype(np.uint64)
            a = keys + words * np.uint64(P2)
            a = (a << np.uint64(31)) | (a >> np.uint64(33))
            terms = _avalanche(a * np.uint64(P1))
            h = np.uint64(int(terms.sum(dtype=np.uint64)) & _MASK)
            total = np.array([h ^ np.uint64((n * P3) & _MASK)], dtype=np.uint64)
            out[i] = _avalanche(total)[0]
    return out


# --------------------------------------------------------------------- kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # the host path needs no Triton
    triton = None

if triton is not None:

    @triton.jit
    def _avalanche_tl(x):  # type: ignore[no-untyped-def]
        x = x ^ (x >> 33)
        x = x * 0xC2B2AE3D27D4EB4F
        x = x ^ (x >> 29)
        x = x * 0x165667B19E3779F9
        return x ^ (x >> 32)

    @triton.jit
    def _kvg64_kernel(  # type: ignore[no-untyped-def]
        base_ptr,  # uint8: the tensor's whole storage
        page_starts_ptr,  # int64 [pages]: byte offset of each page in the storage
        run_offsets_ptr,  # int64 [runs]: byte offset of each run in a page
        run_lengths_ptr,  # int64 [runs]: bytes in each run
        out_ptr,  # uint64 [pages]
        num_runs,
        page_bytes,
        WORDS: tl.constexpr,  # every run starts and ends on an 8-byte boundary: load words
        BLOCK: tl.constexpr,
    ):
        page = tl.program_id(0)
        start = tl.load(page_starts_ptr + page)
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        lanes = tl.arange(0, BLOCK)
        byte_lanes = tl.arange(0, 8)
        first_word = start * 0  # int64 zero: word index of the run's first word in the page
        for r in range(num_runs):
            offset = tl.load(run_offsets_ptr + r)
            length = tl.load(run_lengths_ptr + r)
            num_words = (length + 7) // 8
            for w in range(0, num_words, BLOCK):
                index = w + lanes
                live = index < num_words
                if WORDS:
                    words_ptr = (base_ptr + start + offset).to(tl.pointer_type(tl.uint64))
                    x = tl.load(words_ptr + index, mask=live, other=0)
                else:
                    at = index[:, None] * 8 + byte_lanes[None, :]
                    raw = tl.load(base_ptr + start + offset + at, mask=at < length, other=0)
                    x = tl.sum(raw.to(tl.uint64) << (byte_lanes[None, :].to(tl.uint64) * 8), axis=1)
                key = (first_word + index + 1).to(tl.uint64) * 0x27D4EB2F165667C5
                a = key + x * 0xC2B2AE3D27D4EB4F
                a = (a << 31) | (a >> 33)
                a = _avalanche_tl(a * 0x9E3779B185EBCA87)
                acc += tl.where(live, a, 0)
            first_word += num_words
        h = tl.sum(acc, axis=0)
        h = h ^ (page_bytes.to(tl.uint64) * 0x165667B19E3779F9)
        tl.store(out_ptr + page, _avalanche_tl(h))


def kernel_available(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on ``device`` (a GPU, or the interpreter)."""
    import os

    if triton is None:
        return False
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return device.type in ("cuda", "xpu")


def kvg64_pages(
    tensor: torch.Tensor, block_ids: Sequence[int], runs: Sequence[tuple[int, int]], block: int = 1024
) -> torch.Tensor:
    """KVG64 of pages ``tensor[b]`` for ``b`` in ``block_ids``, one launch, on ``tensor``'s device.

    ``tensor`` has blocks on dim 0; ``runs`` are each page's contiguous byte runs
    (offset from the page start, length), as :func:`vllm_kvguard.digest._page_runs`
    gives them. Returns a uint64 tensor on the same device; the caller decides
    when to bring it to the host.
    """
    if triton is None:
        raise RuntimeError("the KVG64 kernel needs Triton")
    device = tensor.device
    elsize = tensor.element_size()
    for _, length in runs[:-1]:
        if length % 8:
            raise ValueError("KVG64 needs every run but the last to be a multiple of 8 bytes")
    storage = tensor.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))
    origin = tensor.storage_offset() * elsize
    stride = tensor.stride(0) * elsize
    starts = torch.tensor([origin + b * stride for b in block_ids], dtype=torch.int64, device=device)
    offsets = torch.tensor([o for o, _ in runs], dtype=torch.int64, device=device)
    lengths = torch.tensor([n for _, n in runs], dtype=torch.int64, device=device)
    aligned = origin % 8 == 0 and stride % 8 == 0 and all(o % 8 == 0 and n % 8 == 0 for o, n in runs)
    out = torch.empty(len(block_ids), dtype=torch.uint64, device=device)
    if len(block_ids):
        page_bytes = sum(n for _, n in runs)
        _kvg64_kernel[(len(block_ids),)](
            base, starts, offsets, lengths, out, len(runs), page_bytes, WORDS=aligned, BLOCK=block
        )
    return out
