"""Why the guard's per-step work costs 5-10x more inside the engine than in isolation.

    python benchmarks/cold_calls.py [--flush-mib 256] [--repeats 21]

A forward streams the KV pages it reads (here: a buffer larger than the last-level cache is
written), which pushes numpy's, numba's and the guard's own code and data out of the caches; the
guard's work after it starts cold. Times, µs (medians), each call right after the flush ("cold")
and again at once ("warm"):

- ``numpy, 3 ops``: ``ids = blocks * 16 + slots; (ids == ref).all()`` on 128 rows (the written
  rows' order check), and the same twice in a row (the second set costs nothing more: the cost is
  per kind of call, not per call);
- ``numba, 1 call``: the same check compiled into one function;
- ``copy a layer's rows`` / ``sum a layer's rows`` / ``... by address``: the write op wrapper's
  work for one layer of 128 rows of the bench's model (K and V of 8 heads of 64, bf16, strided in
  a QKV output), the way up to 2026-12-05 (two numpy copies into the written-rows buffer), in the
  seventh round (numpy views of K and V handed to a compiled loop over arrays: the rows' KVG64
  terms summed, a 64-byte probe kept; that loop is kept here for the comparison) and since the
  eighth (``WrittenRows.observe`` as the worker calls it: the tensors' layout checked, then
  rowhash's ``add_layer`` given addresses and strides);
- ``5 torch accessors``: a tensor's shape, strides, address, device test and dtype, as the
  wrapper read them to check each layer's rows before 2026-12-05 (now once per layout);
- ``bool array .any()`` / ``np.count_nonzero``: whether any of 128 flags is set, by numpy's
  reduction machinery or by its direct count (the guard's step uses the count since
  2026-12-05).
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
    ap.add_argument("--flush-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=21)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import numba

    from vllm_kvguard.digest import rowhash

    assert rowhash.compiled() is not None, rowhash.backend()
    from vllm_kvguard.connector.layout import WrittenRows
    from vllm_kvguard.digest import _rowkernels

    @numba.njit(nogil=True)
    def add_layer_arrays(kw, vw, flat, block_size, jk, jv, sums, first, probe, spec):  # type: ignore[no-untyped-def]
        # The seventh round's loop (numpy arrays in, the same sums and probes out).
        for r in range(kw.shape[0]):
            s = numba.uint64(flat[r] % block_size) * _rowkernels._P3
            n = kw.shape[1]
            t = _rowkernels._terms(kw[r], n, s + numba.uint64(jk) * _rowkernels._P5) + _rowkernels._terms(
                vw[r], n, s + numba.uint64(jv) * _rowkernels._P5
            )
            sums[r] = t if first else sums[r] + t
            for m in range(spec.shape[0]):
                lo, at, count = spec[m, 1], spec[m, 2], spec[m, 3]
                for i in range(count):
                    probe[r, at + i] = kw[r, lo + i] if spec[m, 0] == 0 else vw[r, lo + i]

    n = 128
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 8000, n).astype(np.int64)
    slots = rng.integers(0, 16, n).astype(np.int64)
    ref = blocks * 16 + slots

    @numba.njit(nogil=True)
    def same(blocks, slots, bs, ref):  # type: ignore[no-untyped-def]
        ok = True
        for i in range(len(blocks)):
            ok &= blocks[i] * bs + slots[i] == ref[i]
        return ok

    same(blocks, slots, 16, ref)
    qkv = torch.randn(n, 1536).to(torch.bfloat16)
    key, value = qkv[:, 512:1024].view(n, 8, 64), qkv[:, 1024:].view(n, 8, 64)
    lanes = np.zeros((2048, 4, 1024), dtype=np.int16)
    sums = np.zeros(n, dtype=np.uint64)
    probe = np.zeros((n, 4, 8), dtype=np.uint64)
    spec = np.array([[1, 0, 0, 8]], dtype=np.int64)
    flat = blocks * 16 + slots
    slot_mapping = torch.from_numpy(flat)

    class Cache:  # the layer's key cache as the write op's argument: only its address is read
        def data_ptr(self) -> int:
            return 1

    cache = Cache()
    written = WrittenRows({1: 1}, 4, 1024, torch.bfloat16, 16, spec)

    def numpy_ops() -> None:
        ids = blocks * 16 + slots
        (ids == ref).all()

    def numpy_twice() -> None:
        numpy_ops()
        numpy_ops()

    def copy_layer() -> None:
        lanes[:n, 1, :512] = key.view(torch.int16).numpy().reshape(n, -1)
        lanes[:n, 1, 512:] = value.view(torch.int16).numpy().reshape(n, -1)

    def sum_layer() -> None:
        kw = key.view(torch.int16).numpy().reshape(n, -1).view(np.uint64)
        vw = value.view(torch.int16).numpy().reshape(n, -1).view(np.uint64)
        add_layer_arrays(kw, vw, flat, 16, 256, 384, sums, True, probe[:, 1], spec)

    def sum_by_address() -> None:
        written.begin()
        written.observe(key, value, cache, slot_mapping)  # type: ignore[arg-type]

    sum_layer()
    sum_by_address()
    assert np.array_equal(written.sums[:n], sums) and np.array_equal(written.probe[:n, 1], probe[:, 1])

    lost = np.zeros(n, dtype=bool)  # a step's per-row flags, tested for any set
    cases: list[tuple[str, Callable[[], object]]] = [
        ("numpy, 3 ops", numpy_ops),
        ("numpy, 3 ops twice", numpy_twice),
        ("numba, 1 call", lambda: same(blocks, slots, 16, ref)),
        ("copy a layer's rows", copy_layer),
        ("sum a layer's rows", sum_layer),
        ("... by address", sum_by_address),
        ("5 torch accessors", lambda: (key.shape, key.stride(), key.data_ptr(), key.is_cpu, key.dtype)),
        ("bool array .any()", lambda: lost.any()),
        ("np.count_nonzero", lambda: np.count_nonzero(lost)),
    ]
    flush = np.ones(a.flush_mib << 20, dtype=np.uint8)
    times: dict[str, list[float]] = {}
    for _ in range(a.repeats):
        for name, fn in cases:
            flush += 1
            qkv.mul_(1)  # the QKV output is hot, as the projection leaves it
            start = time.perf_counter()
            fn()
            times.setdefault(name + " cold", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            fn()
            times.setdefault(name + " warm", []).append(time.perf_counter() - start)
    print(f"{'':24} {'cold':>8} {'warm':>8}   (us, medians of {a.repeats})")
    for name, _ in cases:
        cold, warm = (statistics.median(times[f"{name} {k}"]) * 1e6 for k in ("cold", "warm"))
        print(f"{name:24} {cold:8.1f} {warm:8.1f}")


if __name__ == "__main__":
    main()
