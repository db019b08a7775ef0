"""Where one chunk of a host seal's time goes, part by part.

    python benchmarks/seal_parts.py [--blocks-per-chunk 32] [--repeats 15]

The seal of pages on the host (``KVPages.seal_host_pages``) works a chunk at a time (4 MiB: 32
blocks of the bench's model, 4 layers x 8 KV heads x 64, bf16, block 16). Its parts, each timed on
its own over the same chunk, the CPU caches flushed before the copy out of the pool only (the
parts after it find the copy in cache, as in the seal), medians, µs:

- ``copy out of the pool``: ``np.take`` of the chunk's pages, every layer;
- ``rows of the copy``: ``HostRows.page_rows``, the transposing copy of every row (K is stored
  transposed on vLLM's CPU layout: the fill check's gather until 2026-12-05, kept where a
  layout has no in-place plan);
- ``row digests``: rowhash's KVG64 of every row of that;
- ``rows in place``: the fill check's digests where the seal copies the pages, every row read in
  place in the copy (``RowDigests._copy_digests``: rowhash's ``page_sums`` and ``finish``; the
  seal in the pool runs the same loop on the pool's pages, ``RowDigests.check_pages``);
- ``page digests``: XXH3 of each page of the copy;
- ``syndromes``: numpy's two passes and ``finish`` (the path without numba);
- ``NaN/Inf test``: numpy's exponent test on the copy's element lanes (the same);
- ``syndromes + NaN/Inf``: both now, rowhash's ``page_facts`` (one pass a page, the syndromes
  finished in it); ``... without NaN/Inf``: the same pass without the test (what the test adds
  to it: the difference of the two);
- ``whole seal, copy``: ``KVPages.seal_host_pages(copy=True)`` with the fill check: the seal
  where pages cannot be read by address (and everywhere from 2026-12-05 until the in-place seal);
- ``whole seal, in place``: ``KVPages.seal_host_pages`` with the fill check, as the worker calls
  it: no copy, each 4 MiB chunk hashed in the pool, then read again from the cache for the fill
  check (``RowDigests.check_pages``) and ``pool_facts``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks-per-chunk", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_kvguard.connector.layout import cpu_slot_elements
    from vllm_kvguard.digest import rowhash
    from vllm_kvguard.digest.dtypes import EXPONENT_TESTS
    from vllm_kvguard.digest.pages import KVPages
    from vllm_kvguard.digest.row_access import HostRows, PackedRows
    from vllm_kvguard.digest.rows import RowDigests
    from vllm_kvguard.digest.syndrome import finish, parities

    layers, heads, head, bs, blocks, k = 4, 8, 64, 16, 8000, a.blocks_per_chunk
    dtype = torch.bfloat16
    elements = cpu_slot_elements((heads, bs, 2 * head), dtype, bs, str(_get_attn_isa(dtype, bs, head)))
    pool = torch.randn(layers, blocks, heads, bs, 2 * head).to(dtype)
    pages = KVPages({f"layer{i}": pool[i] for i in range(layers)})
    host = HostRows(pages.tensors, elements)
    rows = RowDigests(pages.tensors, [PackedRows(t, host.elements) for t in pages.tensors], blocks, bs, host)
    assert pages._host_pages is not None
    (view,), test = pages._host_pages
    assert test is not None
    per_block = layers * view.shape[2]
    copy = np.empty((layers, k, view.shape[2]), dtype=view.dtype)
    slots = np.tile(np.arange(bs, dtype=np.int64), k)
    flush = np.ones(64 << 20, dtype=np.uint8)
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object], *, cold: bool = False) -> object:
        nonlocal flush
        if cold:
            flush += 1
        start = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - start)
        return out

    def chunk(ids: np.ndarray) -> None:
        rows.record(np.repeat(ids, bs - 1), np.tile(np.arange(bs - 1), k))
        timed("copy out of the pool", lambda: np.take(view, ids, axis=1, out=copy, mode="clip"), cold=True)
        raw = timed("rows of the copy", lambda: host.page_rows(copy))
        want = timed("row digests", lambda: rowhash.digest_rows(raw, slots))  # type: ignore[arg-type]
        got = timed("rows in place", lambda: rows._copy_digests(host, copy))
        assert np.array_equal(got, want)  # type: ignore[arg-type]
        words = copy.reshape(layers * k, -1)
        timed("page digests", lambda: [pages._hash(w) for w in words.view(np.uint8)])
        timed("syndromes", lambda: finish(*parities(words.view(np.uint8))))
        lanes = words.copy()

        def nonfinite() -> object:
            np.bitwise_and(lanes, lanes.dtype.type(test[0]), out=lanes)
            return lanes.max(axis=1) >= test[1]

        timed("NaN/Inf test", nonfinite)
        word_test = EXPONENT_TESTS[dtype][:3]

        timed("syndromes + NaN/Inf", lambda: rowhash.page_facts(words, word_test))
        timed("... without NaN/Inf", lambda: rowhash.page_facts(words, None))
        earlier = rows.rows[ids]

        def fill_check(lo: int, part: np.ndarray, pages_copy: np.ndarray | None) -> None:
            rows.check_pages(part, earlier[lo : lo + len(part)], pages_copy)

        for name, by_copy in (("whole seal, copy", True), ("whole seal, in place", False)):
            timed(
                name,
                lambda by_copy=by_copy: pages.seal_host_pages(
                    ids.tolist(), check_finite=True, visit=fill_check, copy=by_copy
                ),
                cold=True,
            )

    for _ in range(a.repeats):
        chunk(np.sort(rng.choice(blocks, k, replace=False)))
    print(f"{k} blocks of {per_block * view.itemsize >> 10} KiB ({k * per_block * view.itemsize >> 20} MiB)")
    for name, spent in times.items():
        print(f"{name:22} {statistics.median(spent) * 1e6:8.0f} us")


if __name__ == "__main__":
    main()
