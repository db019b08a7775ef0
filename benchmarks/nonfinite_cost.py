"""What the write-time NaN/Inf check costs per sealed page on the host, next to XXH3.

    python benchmarks/nonfinite_cost.py

Over the same bf16 pages (vLLM's CPU page shape), interleaved, medians of repeats, in µs per page:

- ``xxh3``: the seal's digest, straight from memory (what the check is measured against);
- ``gather``: the pages copied out once per layer (what the separate check pays first);
- ``torch words``: the exponent test on int64 words with torch, on that copy (the seal's test
  before 2026-12-04, and still the test where the numpy path does not apply);
- ``lanes``: the test the seal runs now on that copy (numpy on the element lanes, sign bit
  cleared, at or above the exponent mask);
- ``seal's test``: ``KVPages.nonfinite`` itself, gather included (on the host the seal's gather is
  shared with the syndromes, so the check adds ``lanes`` to a seal, not a gather).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from vllm_kvguard.digest.dtypes import EXPONENT_TESTS
from vllm_kvguard.digest.pages import KVPages


def _time(fn: Callable[[], object], repeats: int = 30) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _torch_words(rows: torch.Tensor) -> torch.Tensor:
    mask, low, sign, _ = EXPONENT_TESTS[rows.dtype]
    return torch.bitwise_and(rows.view(torch.int64), mask).add_(low).bitwise_and_(sign).any(dim=1)


SEAL = "seal's test"


def _lanes(lanes: np.ndarray) -> np.ndarray:
    return np.bitwise_and(lanes, np.int16(0x7FFF)).max(axis=1) >= 0x7F80  # bf16


def _measure(kv: torch.Tensor, pages: KVPages, n: int, block: int) -> dict[str, float]:
    ids = list(range(0, 8 * n, 8))
    index = torch.as_tensor(ids)
    gathered = kv.index_select(0, index).reshape(n, -1)
    lanes = gathered.view(torch.int16).numpy()
    tests: dict[str, Callable[[], object]] = {
        "xxh3": lambda: pages.digest(ids),
        "gather": lambda: kv.index_select(0, index).reshape(n, -1),
        "torch words": lambda: _torch_words(gathered),
        "lanes": lambda: _lanes(lanes),
        SEAL: lambda: pages.nonfinite(ids),
    }
    times: dict[str, list[float]] = {k: [] for k in tests}
    for _ in range(5):
        for k, fn in tests.items():
            times[k].append(_time(fn, 10))
    return {k: statistics.median(v) / n * 1e6 for k, v in times.items()}


def main() -> None:
    torch.set_num_threads(1)  # vLLM's CPU worker thread
    print("page bytes  pages     xxh3   gather  torch words    lanes  seal's test   (us per page)")
    for heads, block, dim in ((8, 32, 64), (8, 16, 128), (8, 128, 128)):
        kv = torch.randn(256, heads, block, 2 * dim).to(torch.bfloat16)
        pages = KVPages({"l0": kv})
        for n in (4, 32):
            us = _measure(kv, pages, n, block)
            page = kv[0].numel() * 2
            print(
                f"{page:10d}  {n:5d}  {us['xxh3']:7.1f}  {us['gather']:7.1f}  {us['torch words']:11.1f}"
                f"  {us['lanes']:7.1f}  {us[SEAL]:11.1f}"
            )


if __name__ == "__main__":
    main()
