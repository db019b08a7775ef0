"""Seal/verify throughput over KV-shaped CPU tensors vs raw xxh3 and a plain copy of the same bytes,
and the write-time non-finite check over the same pages.

    python benchmarks/hash_micro.py [--blocks 2048] [--layers 8] [--repeats 7]

Interleaves the three measurements in each repetition and reports medians (GB/s)
and the guard's ratio to raw xxh3, so that a noisy machine hurts all three alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import xxhash

from vllm_kvguard.digest import DigestTable, KVPages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    # CPU attention layout: (num_blocks, kv_heads, block_size, 2 * head_size), one buffer for all layers.
    shape = (a.blocks, a.kv_heads, a.block_size, 2 * a.head_size)
    backing = torch.randn(a.layers, *shape).to(torch.bfloat16)
    layers = {f"layer.{i}": backing[i] for i in range(a.layers)}
    pages = KVPages(layers)
    table = DigestTable(pages.num_blocks, pages.num_layers)
    blocks = list(range(a.blocks))
    nbytes = pages.bytes_per_block * len(blocks)
    raw = [memoryview(backing[i].view(torch.uint8).numpy()).cast("B") for i in range(a.layers)]
    page = pages.page_bytes[0]
    dst = torch.empty_like(backing)
    seal, verify, xxh, copy, finite = [], [], [], [], []
    for _ in range(a.repeats):
        t = time.perf_counter()
        table.seal(blocks, pages.digest(blocks))
        seal.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert not table.compare(blocks, pages.digest(blocks), pages.names)
        verify.append(time.perf_counter() - t)
        t = time.perf_counter()
        for view in raw:
            for b in blocks:
                xxhash.xxh3_64_intdigest(view[b * page : (b + 1) * page])
        xxh.append(time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(backing)
        copy.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert not pages.nonfinite(blocks).any()
        finite.append(time.perf_counter() - t)
    gbps = {
        k: nbytes / statistics.median(v) / 1e9
        for k, v in [
            ("seal", seal),
            ("verify", verify),
            ("raw_xxh3", xxh),
            ("copy", copy),
            ("nonfinite", finite),
        ]
    }
    mib = nbytes / 2**20
    threads = torch.get_num_threads()
    print(f"pages: {a.blocks} blocks x {a.layers} layers x {page} B = {mib:.0f} MiB, torch threads {threads}")
    for k, v in gbps.items():
        print(f"{k:9s} {v:6.2f} GB/s")
    seal_ratio = gbps["seal"] / gbps["raw_xxh3"]
    verify_ratio = gbps["verify"] / gbps["raw_xxh3"]
    print(f"seal / raw_xxh3 = {seal_ratio:.3f}; verify / raw_xxh3 = {verify_ratio:.3f}")
    # The write-time check runs on the same pages as the seal: its time per byte next to the seal's.
    print(f"nonfinite check time / seal time = {gbps['seal'] / gbps['nonfinite']:.3f}")


if __name__ == "__main__":
    main()
