"""What sealing host pages costs, the two ways the guard can do it, side by side.

    python benchmarks/seal_micro.py [--pages 1,2,4,8,16,32,128] [--repeats 21]
                                    [--layers 4] [--kv-heads 8] [--head-size 64]

Over a bf16 pool in vLLM's CPU page layout (K packed per instruction set, probed with vLLM's own
write op), pages whose first 15 rows were recorded in an earlier step, one page sealing per
request, the CPU caches flushed before each call (as a forward leaves them); medians, µs per seal
step:

- ``pool``: the seal before 2026-12-05, and still the path where pages are not host pages of one
  shape: the fill check gathers the earlier rows out of the pool (``RowDigests.check``), then
  ``KVPages.seal_facts`` copies the pages for their syndromes and NaN/Inf test, then
  ``KVPages.digest`` hashes them in the pool again;
- ``copy``: ``KVPages.seal_in_copy``: one copy of the pages, the fill check on the rows transposed
  out of it (``RowDigests.check_copy``), the digests hashed from it.

The two calls alternate (which goes first flips every repeat), on fresh pages each repeat. Torch is
held to one thread, as vLLM's CPU worker leaves it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", default="1,2,4,8,16,32,128", help="pages sealed in one step (comma-separated)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=8000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_kvguard.connector.worker import cpu_slot_elements
    from vllm_kvguard.digest.pages import KVPages
    from vllm_kvguard.digest.rows import HostRows, PackedRows, RowDigests

    bs, dtype = 16, torch.bfloat16
    isa = str(_get_attn_isa(dtype, bs, a.head_size))
    elements = cpu_slot_elements((a.kv_heads, bs, 2 * a.head_size), dtype, bs, isa)
    pool = torch.randn(a.layers, a.blocks, a.kv_heads, bs, 2 * a.head_size).to(dtype)
    pages = KVPages({f"layer{i}": pool[i] for i in range(a.layers)})
    assert pages.seals_in_copy
    host = HostRows(pages.tensors, elements)
    gathers = [PackedRows(t, host.elements) for t in pages.tensors]
    rows = RowDigests(pages.tensors, gathers, a.blocks, bs, host)
    flush = np.ones(64 << 20, dtype=np.uint8)  # larger than the last-level cache
    rng = np.random.default_rng(0)

    def by_pool(seal: list[int]) -> None:
        blocks, slots = rows.written(seal)
        assert not len(rows.check(blocks, slots))
        pages.seal_facts(seal, check_finite=True)
        pages.digest(seal)

    def by_copy(seal: list[int]) -> None:
        earlier = rows.rows[np.asarray(seal, dtype=np.int64)]
        bad: list[np.ndarray] = []
        pages.seal_in_copy(
            seal,
            check_finite=True,
            visit=lambda lo, copy: bad.append(rows.check_copy(copy, earlier[lo : lo + copy.shape[1]])),
        )
        assert not any(len(b) for b in bad)

    print(
        f"{a.layers} layers x {a.kv_heads} KV heads x {a.head_size}, block {bs}, bf16 ({isa}): "
        f"{pages.bytes_per_block >> 10} KiB a block; us per seal step, medians of {a.repeats}"
    )
    print(f"{'pages':>6} {'pool':>9} {'copy':>9} {'pool/copy':>10}")
    for k in (int(x) for x in a.pages.split(",")):
        times: dict[str, list[float]] = {"pool": [], "copy": []}
        for rep in range(a.repeats):
            seal = np.sort(rng.choice(a.blocks, k, replace=False))
            rows.record(np.repeat(seal, bs - 1), np.tile(np.arange(bs - 1), k))
            order = [("pool", by_pool), ("copy", by_copy)]
            for name, fn in order if rep % 2 else order[::-1]:
                flush += 1
                start = time.perf_counter()
                fn(seal.tolist())
                times[name].append(time.perf_counter() - start)
        p, c = (statistics.median(times[n]) * 1e6 for n in ("pool", "copy"))
        print(f"{k:>6} {p:>9.0f} {c:>9.0f} {p / c:>10.2f}")


if __name__ == "__main__":
    main()
