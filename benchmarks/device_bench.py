"""Seal and verify GB/s of the guard's device path against a device-to-device copy of the same bytes.

    python benchmarks/device_bench.py [--blocks 4096] [--layers 8] [--dtype bfloat16] [--repeats 9]

Needs a GPU (CUDA or ROCm build of torch, and Triton); exits 2 without one.
``--device cpu`` runs the same code under ``TRITON_INTERPRET=1`` on tiny sizes: a
check that the script works (CI does it), not a measurement.

KV-shaped pages in vLLM's GPU layout ``(2, num_blocks, block_size, kv_heads,
head_size)`` per layer, so each page is two runs (K and V). It times the guard's
own calls (vllm_kvguard.digest.DeviceDigestTable): seal = one launch over every
page of every layer, digests stored into the device table, with the NaN/Inf test
fused in; verify = one launch that hashes again and compares with the table on the
device. Each is timed to completion (a synchronize), though the guard itself never
waits for them. The three measurements are interleaved in each repetition;
medians and ratios are printed. GB/s counts page bytes read once; the copy's GB/s
counts the bytes copied (it reads and writes each). Target (issue "GPU path"):
seal and verify at >= 70 % of the copy's rate.
"""

from __future__ import annotations

import argparse
import os
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
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args()
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs the kernel under Triton's interpreter: set TRITON_INTERPRET=1")
    if a.device == "cuda" and not torch.cuda.is_available():
        print(
            "device_bench: no GPU here (torch.cuda.is_available() is False); nothing measured",
            file=sys.stderr,
        )
        return 2
    from vllm_kvguard.digest import DeviceDigestTable, KVPages
    from vllm_kvguard.digest.kernel import kvg64_reference

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    dtype = getattr(torch, a.dtype)
    shape = (2, a.blocks, a.block_size, a.kv_heads, a.head_size)
    caches = {f"layer.{i}": torch.randn(shape, device=a.device).to(dtype) for i in range(a.layers)}
    pages = KVPages(caches, block_dim=1, use_kernel=True)
    if not pages.deferred:
        print("device_bench: the layers do not share one page geometry", file=sys.stderr)
        return 1
    table = DeviceDigestTable(pages)
    blocks = list(range(a.blocks))
    nbytes = pages.bytes_per_block * a.blocks
    dst = [torch.empty_like(t) for t in caches.values()]

    def seal() -> None:
        check = table.seal_async(blocks, check_finite=True)
        assert check is not None
        sync()
        assert check.settle() == []

    def verify() -> None:
        check = table.verify_async(blocks)
        sync()
        assert check.settle() == []

    seal()
    # The digest on the device is the documented one (kernel.py), checked on one page.
    page0 = pages.tensors[0][0].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    assert int(table.host_digests([0])[0, 0]) == int(kvg64_reference([page0])[0])
    times: dict[str, list[float]] = {"seal": [], "verify": [], "copy": []}
    for _ in range(a.repeats):
        sync()
        t = time.perf_counter()
        seal()
        times["seal"].append(time.perf_counter() - t)
        t = time.perf_counter()
        verify()
        times["verify"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for d, s in zip(dst, caches.values(), strict=True):
            d.copy_(s)
        sync()
        times["copy"].append(time.perf_counter() - t)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton interpreter)"
    print(f"{name}: {a.layers} layers x {a.blocks} pages, {nbytes / 2**30:.3f} GiB {a.dtype}")
    for k, v in gbps.items():
        print(f"{k:7s} {v:10.3f} GB/s")
    seal_ratio, verify_ratio = gbps["seal"] / gbps["copy"], gbps["verify"] / gbps["copy"]
    print(f"seal / copy = {seal_ratio:.3f}; verify / copy = {verify_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
