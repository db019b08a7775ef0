"""What row digests cost next to today's seal-at-fill, per decode step and per page.

    python benchmarks/rows_micro.py [--layers 8] [--kv-heads 8] [--head-size 128] [--block-size 32]

A decode step writes one row per running request; every ``block_size`` steps each request
fills a page. Without row digests the guard hashes each page once, at fill (XXH3-64 over
the page, every layer). With them it also hashes every row right after the forward that
wrote it (one gather per layer, then the rows' KVG64 digests in one compiled call: rowhash; one
XXH3 call per row until 2026-12-05) and, at fill, re-hashes the rows
written in earlier steps before sealing. Measured on vLLM's real CPU page layout (the slot
map is probed from vLLM's own write op), bfloat16, interleaved, medians of ``--repeats``:

- per decode step, for 16, 64 and 256 running requests: recording their rows;
- per page: the seal alone vs the seal plus its row checks (fill), and the whole page's row
  work (block_size records of one row + the fill check) as a ratio to the seal alone;
- the device path's row digest (torch, KVG64-style) over the same rows, on the CPU here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from vllm_kvguard.connector.layout import cpu_isa, cpu_slot_elements
from vllm_kvguard.digest import KVPages
from vllm_kvguard.digest.row_access import HostRows, PackedRows
from vllm_kvguard.digest.rows import RowDigests, row_digests_torch


def _time(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    bs = a.block_size
    page_shape = (a.kv_heads, bs, 2 * a.head_size)
    backing = torch.randn(a.layers, a.blocks, *page_shape).to(torch.bfloat16)
    layers = {f"layer.{i}": backing[i] for i in range(a.layers)}
    pages = KVPages(layers)
    isa = cpu_isa("", torch.bfloat16, bs, a.head_size)
    elements = cpu_slot_elements(page_shape, torch.bfloat16, bs, isa)
    # As the worker builds them: numpy gathers for hashing, torch access for drills.
    gathers = [PackedRows(t, elements) for t in pages.tensors]
    torch_rows = RowDigests(pages.tensors, gathers, a.blocks, bs)
    rows = RowDigests(pages.tensors, gathers, a.blocks, bs, HostRows(pages.tensors, elements))
    rng = np.random.default_rng(0)
    results: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        results.setdefault(key, []).append(seconds)

    for _ in range(a.repeats):
        for running in (16, 64, 256):
            blocks = rng.choice(a.blocks, size=running, replace=False)
            slots = rng.integers(0, bs, size=running)
            add(
                f"record {running} rows (one decode step)",
                _time(lambda b=blocks, s=slots: rows.record(b, s), 20),
            )
            add(
                f"record {running} rows, torch gather (before)",
                _time(lambda b=blocks, s=slots: torch_rows.record(b, s), 20),
            )
        page = [int(rng.integers(a.blocks))]
        full_b = np.full(bs, page[0])
        all_slots = np.arange(bs)
        rows.record(full_b, all_slots)
        add("seal one page (XXH3, every layer)", _time(lambda p=page: pages.digest(p), 200))
        add(
            f"fill check: re-hash {bs - 1} rows",
            _time(lambda b=full_b[:-1], s=all_slots[:-1]: rows.check(b, s), 50),
        )
        add("record one row", _time(lambda b=full_b[:1], s=all_slots[:1]: rows.record(b, s), 200))
        gathered = torch.cat(
            [g(torch.as_tensor(full_b), torch.as_tensor(all_slots)).view(torch.uint8) for g in rows.gathers],
            dim=1,
        )
        add(
            f"device-path row digest of {bs} rows (torch, on CPU here)",
            _time(
                lambda g=gathered, s=all_slots: row_digests_torch(g.view(torch.int64), torch.as_tensor(s)), 50
            ),
        )
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"geometry: {a.layers} layers x {a.kv_heads} KV heads x head {a.head_size}, block {bs}, bfloat16,")
    print(f"  CPU layout {isa}; row {rows.row_bytes} B, page {pages.bytes_per_block} B")
    for key, value in med.items():
        print(f"  {key:52s} {value * 1e6:10.1f} us")
    seal = med["seal one page (XXH3, every layer)"]
    lifetime = bs * med["record one row"] + med[f"fill check: re-hash {bs - 1} rows"]
    batched = med["record 64 rows (one decode step)"] / 64 * bs + med[f"fill check: re-hash {bs - 1} rows"]
    print(f"  per page, row work / seal alone (rows recorded one at a time)   {lifetime / seal:6.2f}x")
    print(f"  per page, row work / seal alone (rows recorded 64 a step)       {batched / seal:6.2f}x")


if __name__ == "__main__":
    main()
