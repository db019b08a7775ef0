"""Seal and verify GB/s of the KVG64 kernel against a device-to-device copy of the same bytes.

    python benchmarks/device_bench.py [--blocks 4096] [--layers 8] [--dtype bfloat16] [--repeats 9]

Needs a GPU (CUDA or ROCm build of torch, and Triton). KV-shaped pages in vLLM's
GPU layout ``(2, num_blocks, block_size, kv_heads, head_size)`` per layer, so each
page is two runs (K and V). Seal = hash every page of every layer (one launch per
layer); verify = hash again and compare with the seals on the device. The three
measurements are interleaved in each repetition; medians and ratios are printed.
Target (issue "GPU path"): seal and verify at >= 70 % of the copy's bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float8_e4m3fn"])
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            "device_bench: no GPU here (torch.cuda.is_available() is False); nothing measured",
            file=sys.stderr,
        )
        return 2
    from vllm_kvguard.digest import _page_runs
    from vllm_kvguard.kernel import kvg64_pages

    dtype = getattr(torch, a.dtype)
    shape = (2, a.blocks, a.block_size, a.kv_heads, a.head_size)
    layers = [torch.randn(shape, device="cuda").to(dtype).movedim(1, 0) for _ in range(a.layers)]
    runs = _page_runs(layers[0][0])
    blocks = list(range(a.blocks))
    nbytes = sum(t.numel() * t.element_size() for t in layers)
    dst = [torch.empty_like(t) for t in layers]

    def seal() -> list[torch.Tensor]:
        return [kvg64_pages(t, blocks, runs) for t in layers]

    sealed = seal()
    times: dict[str, list[float]] = {"seal": [], "verify": [], "copy": []}
    for _ in range(a.repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        seal()
        torch.cuda.synchronize()
        times["seal"].append(time.perf_counter() - t)
        t = time.perf_counter()
        bad = [torch.count_nonzero(d != s) for d, s in zip(seal(), sealed, strict=True)]
        torch.cuda.synchronize()
        times["verify"].append(time.perf_counter() - t)
        assert int(sum(bad)) == 0
        t = time.perf_counter()
        for d, s in zip(dst, layers, strict=True):
            d.copy_(s)
        torch.cuda.synchronize()
        times["copy"].append(time.perf_counter() - t)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    size = f"{nbytes / 2**30:.2f} GiB {a.dtype}"
    print(f"{torch.cuda.get_device_name()}: {a.layers} layers x {a.blocks} pages, {size}")
    for k, v in gbps.items():
        print(f"{k:7s} {v:8.1f} GB/s")
    seal_ratio, verify_ratio = gbps["seal"] / gbps["copy"], gbps["verify"] / gbps["copy"]
    print(f"seal / copy = {seal_ratio:.3f}; verify / copy = {verify_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
