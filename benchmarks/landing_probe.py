"""The landing check's reads of the pool after a forward: one pass, or every line touched first.

    python benchmarks/landing_probe.py [--rows 128] [--layers 4] [--pool-mib 512] [--repeats 41]

The worker checks that each row a step wrote landed (rowhash's compiled ``keep_written``): for
every row and layer it reads the row's probe words out of its page, at a random place in the
pool, and the previous owner's digest of that row, at a random place in the row table. After a
forward none of those lines are in cache (the attention streams the running requests' pages).
This times, after a cache flush, medians in µs:

- ``one pass``: the check as it was up to 2026-12-06 (each row's probes compared as they are
  read; the misses are taken nearly one by one);
- ``lines touched first``: a first pass whose loads do not depend on one another (one store a
  row), then the same check on lines now in cache (the loop ``keep_written`` runs since);
- ``keep_written``: rowhash's kernel itself, through ``RowDigests.record_written``, on a pool of
  vLLM's CPU layout (bf16, 8 KV heads of 64, 32 slots a page), every row landed.

The figures of docs/performance.md's fourteenth round of issue 15 came from it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch


@numba.njit(nogil=True)
def one_pass(bases, blocks, slots, pool, probe, page_words, slot_words, previous, flat):  # type: ignore[no-untyped-def]
    ok_all = 0
    for r in range(blocks.shape[0]):
        ok = previous[flat[r]] != 0
        for layer in range(bases.shape[0]):
            at = bases[layer] + blocks[r] * page_words + slots[r] * slot_words
            for i in range(probe.shape[2]):
                if pool[at + i] != probe[r, layer, i]:
                    ok = False
        ok_all += ok
    return ok_all


@numba.njit(nogil=True)
def touched_first(bases, blocks, slots, pool, probe, page_words, slot_words, previous, flat, scratch):  # type: ignore[no-untyped-def]
    for r in range(blocks.shape[0]):
        hit = previous[flat[r]] != 0
        for layer in range(bases.shape[0]):
            hit &= pool[bases[layer] + blocks[r] * page_words + slots[r] * slot_words] == probe[r, layer, 0]
        scratch[r] = hit
    return one_pass(bases, blocks, slots, pool, probe, page_words, slot_words, previous, flat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128, help="rows a step wrote (running requests)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pool-mib", type=int, default=512, help="the KV pool, all layers")
    ap.add_argument("--repeats", type=int, default=41)
    a = ap.parse_args()
    if a.rows < 1 or a.layers < 1 or a.pool_mib < a.layers or a.repeats < 3:
        raise SystemExit("--rows and --layers >= 1, --pool-mib >= --layers, --repeats >= 3")
    torch.set_num_threads(1)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_kvguard.connector.layout import cpu_slot_elements
    from vllm_kvguard.digest import rowhash
    from vllm_kvguard.digest.row_access import HostRows, PackedRows
    from vllm_kvguard.digest.rows import RowDigests

    if rowhash.compiled() is None:
        raise SystemExit(f"keep_written needs numba: {rowhash.backend()}")
    heads, head, bs = 8, 64, 32
    page_bytes = heads * bs * 2 * head * 2
    num_blocks = (a.pool_mib << 20) // a.layers // page_bytes
    if num_blocks < 2:
        raise SystemExit(f"--pool-mib {a.pool_mib} holds fewer than 2 pages a layer")
    layers = [torch.randn(num_blocks, heads, bs, 2 * head).to(torch.bfloat16) for _ in range(a.layers)]
    # Each slot's elements as vLLM's own CPU write op places them (the worker's start-up probe).
    isa = str(_get_attn_isa(torch.bfloat16, bs, head))
    host = HostRows(layers, cpu_slot_elements((heads, bs, 2 * head), torch.bfloat16, bs, isa))
    if host.land is None or host.probe_spec is None:
        raise SystemExit("this layout has no landing probe")
    digests = RowDigests(layers, [PackedRows(t, host.elements) for t in layers], num_blocks, bs, host)
    rng = np.random.default_rng(0)
    flush = np.zeros(32 << 20, dtype=np.uint64)  # 256 MiB: as a forward leaves the caches
    # The plain loops' pool: the same bytes, as 64-bit words.
    words = [t.view(-1).view(torch.int64).numpy().view(np.uint64) for t in layers]
    pool = np.concatenate(words)
    bases = np.arange(a.layers, dtype=np.int64) * len(words[0])
    page_words, slot_words = page_bytes // 8, 2 * head * 2 // 8
    previous = np.zeros(num_blocks * bs, dtype=np.uint64)
    scratch = np.zeros(a.rows, dtype=np.bool_)
    times: dict[str, list[float]] = {"one pass": [], "lines touched first": [], "keep_written": []}
    for _ in range(a.repeats):
        flat = rng.choice(num_blocks * bs, size=a.rows, replace=False).astype(np.int64)
        blocks, slots = flat // bs, flat % bs
        at = bases[None, :, None] + (blocks * page_words + slots * slot_words)[:, None, None]
        probe = pool[at + np.arange(8)]  # (rows, layers, 8 words): as they lie
        handed = host.gather(blocks, slots).copy()  # every row as it landed
        sums = rowhash._sums_numpy(handed.view(np.uint64), slots)
        row_probe = host.probe_of(handed)
        for name in times:
            flush += 1
            start = time.perf_counter()
            if name == "one pass":
                one_pass(bases, blocks, slots, pool, probe, page_words, slot_words, previous, flat)
            elif name == "lines touched first":
                touched_first(
                    bases, blocks, slots, pool, probe, page_words, slot_words, previous, flat, scratch
                )
            else:
                same = digests.record_written(blocks, slots, flat, sums, row_probe)
                assert same is not None
            times[name].append(time.perf_counter() - start)
    print(f"{a.rows} rows x {a.layers} layers, pool {a.pool_mib} MiB, after a 256 MiB flush (µs, medians):")
    for name, values in times.items():
        print(f"  {name:22s} {statistics.median(values[1:]) * 1e6:8.1f}")


if __name__ == "__main__":
    main()
