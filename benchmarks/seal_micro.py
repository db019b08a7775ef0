"""What sealing host pages costs, the three ways the guard can do it, side by side.

    python benchmarks/seal_micro.py [--pages 1,2,4,8,16,32,128] [--repeats 21]
                                    [--layers 4] [--kv-heads 8] [--head-size 64]

Over a bf16 pool in vLLM's CPU page layout (K packed per instruction set, probed with vLLM's own
write op), pages whose first 15 rows were recorded in an earlier step, one page sealing per
request, the CPU caches flushed before each call (as a forward leaves them); medians, µs per seal
step:

- ``gather``: the seal before 2026-12-05, and still the path where pages are not host pages of
  one shape: the fill check gathers the earlier rows out of the pool (``RowDigests.check``), then
  ``KVPages.seal_facts`` reads the pages for their syndromes and NaN/Inf test, then
  ``KVPages.digest`` hashes them in the pool again;
- ``copy``: ``KVPages.seal_host_pages(copy=True)``: one copy of the pages, the digests hashed
  from it, the fill check on its rows (``RowDigests.check_pages`` with the copy), the
  syndromes and NaN/Inf test over it (the seal from 2026-12-05 until the in-place seal; still
  the path where the pages cannot be read by address);
- ``in place``: ``KVPages.seal_host_pages``: the pages read where they lie in the pool, a 4 MiB
  chunk at a time: hashed, then the fill check (``RowDigests.check_pages``), then the syndromes
  and NaN/Inf test, the last two from the CPU's cache.

The calls rotate (which goes first changes every repeat), on fresh pages each repeat. Torch is
held to one thread, as vLLM's CPU worker leaves it.
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
    ap.add_argument("--pages", default="1,2,4,8,16,32,128", help="pages sealed in one step (comma-separated)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=8000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_kvguard.connector.layout import cpu_slot_elements
    from vllm_kvguard.digest.pages import KVPages
    from vllm_kvguard.digest.row_access import HostRows, PackedRows
    from vllm_kvguard.digest.rows import RowDigests

    bs, dtype = 16, torch.bfloat16
    isa = str(_get_attn_isa(dtype, bs, a.head_size))
    elements = cpu_slot_elements((a.kv_heads, bs, 2 * a.head_size), dtype, bs, isa)
    pool = torch.randn(a.layers, a.blocks, a.kv_heads, bs, 2 * a.head_size).to(dtype)
    pages = KVPages({f"layer{i}": pool[i] for i in range(a.layers)})
    assert pages.seals_host_pages
    host = HostRows(pages.tensors, elements)
    gathers = [PackedRows(t, host.elements) for t in pages.tensors]
    rows = RowDigests(pages.tensors, gathers, a.blocks, bs, host)
    flush = np.ones(64 << 20, dtype=np.uint8)  # larger than the last-level cache
    rng = np.random.default_rng(0)

    def by_gather(seal: list[int]) -> None:
        blocks, slots = rows.written(seal)
        assert not len(rows.check(blocks, slots))
        pages.seal_facts(seal, check_finite=True)
        pages.digest(seal)

    def sealer(copy: bool) -> Callable[[list[int]], None]:
        def seal_host_pages(seal: list[int]) -> None:
            earlier = rows.rows[np.asarray(seal, dtype=np.int64)]
            bad: list[np.ndarray] = []

            def fill_check(lo: int, ids: np.ndarray, pages_copy: np.ndarray | None) -> None:
                bad.append(rows.check_pages(ids, earlier[lo : lo + len(ids)], pages_copy))

            pages.seal_host_pages(seal, check_finite=True, visit=fill_check, copy=copy)
            assert not any(len(b) for b in bad)

        return seal_host_pages

    assert pages.reads_in_place
    ways: list[tuple[str, Callable[[list[int]], None]]] = [
        ("gather", by_gather),
        ("copy", sealer(True)),
        ("in place", sealer(False)),
    ]
    print(
        f"{a.layers} layers x {a.kv_heads} KV heads x {a.head_size}, block {bs}, bf16 ({isa}): "
        f"{pages.bytes_per_block >> 10} KiB a block; us per seal step, medians of {a.repeats}"
    )
    print(f"{'pages':>6} {'gather':>9} {'copy':>9} {'in place':>9} {'copy/in place':>14}")
    for k in (int(x) for x in a.pages.split(",")):
        times: dict[str, list[float]] = {name: [] for name, _ in ways}
        for rep in range(a.repeats):
            seal = np.sort(rng.choice(a.blocks, k, replace=False))
            rows.record(np.repeat(seal, bs - 1), np.tile(np.arange(bs - 1), k))
            turn = rep % len(ways)
            for name, fn in ways[turn:] + ways[:turn]:
                flush += 1
                start = time.perf_counter()
                fn(seal.tolist())
                times[name].append(time.perf_counter() - start)
        g, c, i = (statistics.median(times[n]) * 1e6 for n, _ in ways)
        print(f"{k:>6} {g:>9.0f} {c:>9.0f} {i:>9.0f} {c / i:>14.2f}")


if __name__ == "__main__":
    main()
