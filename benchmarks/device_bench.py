"""Seal and verify GB/s of the guard's device path against a device-to-device copy of the same bytes.

    python benchmarks/device_bench.py [--blocks 4096] [--layers 8] [--dtype bfloat16] [--repeats 9]
                                      [--sweep] [--json FILE]

Needs a GPU (CUDA or ROCm build of torch, and Triton); exits 2 without one.
``--device cpu`` runs the same code under ``TRITON_INTERPRET=1`` on tiny sizes: a
check that the script works (CI does it), not a measurement.

KV-shaped pages in vLLM's GPU layout ``(2, num_blocks, block_size, kv_heads,
head_size)`` per layer, so each page is two runs (K and V). It times the guard's
own calls (vllm_kvguard.digest.DeviceDigestTable): seal = one launch over every
page of every layer, digests and syndromes stored into the device tables, with the
NaN/Inf test fused in; verify = one launch that hashes again and compares with the
table on the device. ``seal, torch syndromes`` is the seal as it was before the
syndromes moved into the launch (a torch pass over gathered pages first), for the
before/after. Each is timed to completion (a synchronize), though the guard itself
never waits for them. The measurements are interleaved in each repetition; medians
and ratios are printed. GB/s counts page bytes read once; the copy's GB/s counts
the bytes copied (it reads and writes each). Target (issue "GPU path"): seal and
verify at >= 70 % of the copy's rate.

``--sweep`` also times the raw verify and seal launches for each words-per-iteration
(``BLOCK``) and warps-per-program pair, to choose kernel.py's ``BLOCK_WORDS`` and
``NUM_WARPS``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

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
    ap.add_argument("--sweep", action="store_true", help="time the raw launches for each BLOCK x num_warps")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--block", type=int, help="words per iteration (kernel.BLOCK_WORDS) for this run")
    ap.add_argument("--num-warps", type=int, help="warps per program (kernel.NUM_WARPS) for this run")
    ap.add_argument("--seal-block", type=int, help="kernel.SEAL_BLOCK_WORDS for this run")
    ap.add_argument("--seal-num-warps", type=int, help="kernel.SEAL_NUM_WARPS for this run")
    ap.add_argument(
        "--step-rows",
        help="also time the row digests of one step (RowDigests.record) for these row counts, e.g. 16,256",
    )
    ap.add_argument(
        "--step-pages",
        help="also time the host side of one step's calls (launch, no wait) for these page counts, e.g. 8,64",
    )
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
    from vllm_kvguard.digest import kernel as kernel_module
    from vllm_kvguard.digest.kernel import kvg64_reference
    from vllm_kvguard.digest.syndrome import syndromes, width

    for flag, value, name in (
        ("--block", a.block, "BLOCK_WORDS"),
        ("--seal-block", a.seal_block, "SEAL_BLOCK_WORDS"),
    ):
        if value:
            if value < 16 or value & (value - 1):
                ap.error(f"{flag} {value}: expected a power of two, at least 16")
            setattr(kernel_module, name, value)
    if a.num_warps:
        kernel_module.NUM_WARPS = a.num_warps
    if a.seal_num_warps:
        kernel_module.SEAL_NUM_WARPS = a.seal_num_warps

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
    unfused = DeviceDigestTable(pages)
    unfused.fused_syndromes = False  # the seal as it was: syndromes by a torch pass first
    blocks = list(range(a.blocks))
    nbytes = pages.bytes_per_block * a.blocks
    dst = [torch.empty_like(t) for t in caches.values()]

    def seal(t: DeviceDigestTable = table) -> None:
        check = t.seal_async(blocks, check_finite=True)
        assert check is not None
        sync()
        assert check.settle() == []

    def verify() -> None:
        check = table.verify_async(blocks)
        sync()
        assert check.settle() == []

    def copy() -> None:
        for d, s in zip(dst, caches.values(), strict=True):
            d.copy_(s)
        sync()

    seal()
    seal(unfused)
    verify()  # every kernel built before timing
    # The digest and syndrome on the device are the documented ones (kernel.py, syndrome.py),
    # checked on two pages of two layers, and both seal paths store the same syndromes.
    for layer in (0, a.layers - 1):
        for block in (0, a.blocks - 1):
            raw = pages.tensors[layer][block].contiguous().view(torch.uint8).cpu().numpy()
            assert int(table.host_digests([block])[0, layer]) == int(kvg64_reference([raw.tobytes()])[0])
            want = syndromes(raw[None])[0, : width(raw.size)].tolist()
            assert table.seal_record(block, layer)[2].tolist() == want
            assert unfused.seal_record(block, layer)[2].tolist() == want
    runs: dict[str, Callable[[], None]] = {
        "seal": seal,
        "seal, torch syndromes": lambda: seal(unfused),
        "verify": verify,
        "copy": copy,
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.repeats):
        for name, run in runs.items():
            sync()
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton interpreter)"
    print(f"{name}: {a.layers} layers x {a.blocks} pages, {nbytes / 2**30:.3f} GiB {a.dtype}")
    for k, v in gbps.items():
        median = statistics.median(times[k])
        spread = (max(times[k]) - min(times[k])) / median
        print(f"{k:22s} {v:10.3f} GB/s   (median {median * 1e3:.3f} ms, spread {spread:.0%})")
    seal_ratio, verify_ratio = gbps["seal"] / gbps["copy"], gbps["verify"] / gbps["copy"]
    print(f"seal / copy = {seal_ratio:.3f}; verify / copy = {verify_ratio:.3f}")
    print(f"seal, torch syndromes / copy = {gbps['seal, torch syndromes'] / gbps['copy']:.3f}")
    result: dict[str, object] = {
        "device": name,
        "shape": list(shape),
        "layers": a.layers,
        "dtype": a.dtype,
        "bytes": nbytes,
        "repeats": a.repeats,
        "gbps": gbps,
        "seconds": times,
        "block_words": kernel_module.BLOCK_WORDS,
        "num_warps": kernel_module.NUM_WARPS,
        "seal_block_words": kernel_module.SEAL_BLOCK_WORDS,
        "seal_num_warps": kernel_module.SEAL_NUM_WARPS,
    }
    if a.sweep:
        result["sweep"] = sweep(a, table, pages, nbytes, sync)
    if a.step_pages:
        result["step"] = step_calls(a, table, sync)
    if a.step_rows:
        result["rows"] = step_rows(a, caches, sync)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def sweep(a, table, pages, nbytes, sync) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    """Raw launches (no settle) for each BLOCK x num_warps, interleaved, median GB/s."""
    from vllm_kvguard.digest.kernel import SEAL, VERIFY

    geometry = pages.geometry
    ids = torch.arange(a.blocks, dtype=torch.int64, device=geometry.device)
    configs = {
        "verify": [(b, w) for b in (512, 1024, 2048) for w in (4, 8)],
        "seal": [(b, w) for b in (256, 512, 1024) for w in (4, 8)],
    }
    if a.device == "cpu":
        configs = {k: v[:2] for k, v in configs.items()}
    cases = {
        "verify": dict(mode=VERIFY, table=table.device_digests),
        "seal": dict(
            mode=SEAL, table=table.device_digests, check_finite=True, syndromes=table.device_syndromes
        ),
    }
    times: dict[tuple[str, int, int], list[float]] = {}
    for case, kwargs in cases.items():
        for b, w in configs[case]:  # build every variant before timing
            geometry.launch(ids, block=b, num_warps=w, **kwargs)
    sync()
    for _ in range(max(3, a.repeats // 2)):
        for case, kwargs in cases.items():
            for b, w in configs[case]:
                sync()
                t = time.perf_counter()
                geometry.launch(ids, block=b, num_warps=w, **kwargs)
                sync()
                times.setdefault((case, b, w), []).append(time.perf_counter() - t)
    rows = []
    print("sweep (raw launches, median GB/s):")
    for (case, b, w), v in times.items():
        gbps = nbytes / statistics.median(v) / 1e9
        rows.append({"case": case, "block": b, "num_warps": w, "gbps": gbps})
        print(f"  {case:7s} BLOCK={b:5d} num_warps={w:2d} {gbps:10.3f} GB/s")
    return rows


def step_calls(a, table, sync) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    """What a serving step's calls cost the host: seal_async / verify_async of a few pages
    (launch and return, as the guard does: no wait), and settling them once the device is done
    (as the guard does after vLLM's own end-of-step wait). Medians of 200 calls, µs."""
    rows = []
    print("one step's calls, host side (median us; the device work is not waited for):")
    for n in (int(x) for x in a.step_pages.split(",")):
        ids = list(range(n))
        seal_us, verify_us, settle_us = [], [], []
        for i in range(220):
            sync()
            t = time.perf_counter()
            check = table.seal_async(ids, check_finite=True)
            t1 = time.perf_counter()
            verify = table.verify_async(ids)
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
            check.settle()
            verify.settle()
            t4 = time.perf_counter()
            if i >= 20:
                seal_us.append((t1 - t) * 1e6)
                verify_us.append((t2 - t1) * 1e6)
                settle_us.append((t4 - t3) * 1e6)
        row = {
            "pages": n,
            "seal_us": statistics.median(seal_us),
            "verify_us": statistics.median(verify_us),
            "settle_us": statistics.median(settle_us),
        }
        rows.append(row)
        print(
            f"  {n:5d} pages x {a.layers} layers: seal_async {row['seal_us']:7.1f}  "
            f"verify_async {row['verify_us']:7.1f}  settle both {row['settle_us']:7.1f}"
        )
    return rows


def step_rows(a, caches, sync) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    """The row digests of one step on the device (digest/rows.py, what the worker runs in
    wait_for_save with VLLM_KVGUARD_ROWS on), host time, with the device idle and right after
    ~20 ms of queued device work (as after a forward): a call that waits for the device takes
    about that much longer. Two ways side by side, interleaved: ``read back`` is RowDigests.record
    (the digests copied to the host: what GPU workers ran before), ``on device`` is
    DeviceRowDigests (what they run now): the step's record with the lost-write compare, plus
    the check of the same number of earlier rows at seal, results left on the device; by the
    row kernel (``kernel``, one launch a call) and by torch (``torch``, the fallback)."""
    import numpy as np

    from vllm_kvguard.digest.device_rows import DeviceRowDigests
    from vllm_kvguard.digest.kernel import RowGeometry
    from vllm_kvguard.digest.row_access import AxisRows
    from vllm_kvguard.digest.rows import RowDigests

    tensors = [t.movedim(1, 0) for t in caches.values()]  # block-first: (blocks, 2, slots, heads, head)
    gathers = [AxisRows(t, 1) for t in tensors]
    read_back = RowDigests(tensors, gathers, a.blocks, a.block_size)
    by_torch = DeviceRowDigests(tensors, gathers, a.blocks, a.block_size)
    by_kernel = DeviceRowDigests(tensors, gathers, a.blocks, a.block_size, RowGeometry(tensors, 1))
    side = 8192 if a.device == "cuda" else 64
    x = torch.randn((side, side), device=tensors[0].device, dtype=torch.bfloat16)

    def busy() -> None:  # about 20 ms of matrix products on an H200, queued, not waited for
        for _ in range(12):
            torch.mm(x, x)

    sync()
    t = time.perf_counter()
    busy()
    sync()
    busy_ms = (time.perf_counter() - t) * 1e3
    out = []
    print(f"one step's row digests, host ms; queued work alone {busy_ms:.1f} ms:")
    for n in (int(v) for v in a.step_rows.split(",")):
        blocks = np.arange(n, dtype=np.int64) % a.blocks
        slots = (np.arange(n, dtype=np.int64) // a.blocks) % a.block_size

        def kernel_step(blocks: np.ndarray = blocks, slots: np.ndarray = slots) -> None:
            by_kernel.record_async(blocks, slots, compare=True)
            by_kernel.check_async(blocks, slots)

        def torch_step(blocks: np.ndarray = blocks, slots: np.ndarray = slots) -> None:
            by_torch.record_async(blocks, slots, compare=True)
            by_torch.check_async(blocks, slots)

        def read_back_step(blocks: np.ndarray = blocks, slots: np.ndarray = slots) -> None:
            read_back.record(blocks, slots)

        ways = {"read_back": read_back_step, "torch": torch_step, "kernel": kernel_step}
        times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ways}
        for call in ways.values():  # build the kernel, warm the allocator
            call()
        for _ in range(12):
            for name, call in ways.items():
                idle, after = times[name]
                sync()
                t = time.perf_counter()
                call()
                idle.append(time.perf_counter() - t)
                busy()
                t = time.perf_counter()
                call()
                after.append(time.perf_counter() - t)
                sync()
        for name, (idle, after) in times.items():
            row = {
                "way": name,
                "rows": n,
                "idle_ms": statistics.median(idle[2:]) * 1e3,
                "after_work_ms": statistics.median(after[2:]) * 1e3,
            }
            out.append(row)
            print(
                f"  {name:9s} {n:5d} rows x {a.layers} layers: device idle {row['idle_ms']:7.3f}   "
                f"after queued work {row['after_work_ms']:7.3f}"
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
