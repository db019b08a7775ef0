"""What the syndrome costs at seal time, against the rest of a host seal (same pages, one run).

    .venv/bin/python benchmarks/syndrome_cost.py

Per step, the worker seals the pages that filled: it gathers them once per layer (for the
NaN/Inf test, and now the syndromes), tests them, and hashes them with XXH3 straight from
memory. This times each part over the same pages, interleaved, median of repeats, and
prints microseconds per page and the syndrome's share of the seal.
"""

from __future__ import annotations

import statistics
import time

import torch

from vllm_kvguard.config import HashAlgorithm
from vllm_kvguard.digest.dtypes import nonfinite_rows
from vllm_kvguard.digest.pages import KVPages
from vllm_kvguard.digest.syndrome import syndromes


def _time(fn, repeats: int = 30) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    torch.set_num_threads(1)  # vLLM's CPU worker thread
    print("page bytes  pages  gather+nan us/page  +syndrome us/page  xxh3 us/page  syndrome share of seal")
    for heads, block, dim in ((2, 32, 64), (8, 16, 128), (8, 128, 128)):
        kv = torch.randn(256, heads, 2 * block, dim).to(torch.bfloat16)
        pages = KVPages({"l0": kv}, algorithm=HashAlgorithm.XXH3_64)
        for n in (4, 32):
            a, b, c = _measure(kv, pages, list(range(0, 8 * n, 8)))
            share = (b - a) / (b + c)
            page = kv[0].numel() * 2
            print(
                f"{page:10d}  {n:5d}  {a / n * 1e6:18.1f}  {b / n * 1e6:17.1f}  {c / n * 1e6:12.1f}"
                f"  {share:22.0%}"
            )


def _measure(kv: torch.Tensor, pages: KVPages, ids: list[int]) -> tuple[float, float, float]:
    n, index = len(ids), torch.as_tensor(ids)

    def gather_nan() -> None:
        nonfinite_rows(kv.index_select(0, index).reshape(n, -1))

    def gather_nan_syn() -> None:
        g = kv.index_select(0, index).reshape(n, -1)
        nonfinite_rows(g)
        syndromes(g.view(torch.uint8).numpy())

    def xxh3() -> None:
        pages.digest(ids)

    a, b, c = (_time(f) for f in (gather_nan, gather_nan_syn, xxh3))
    return a, b, c


if __name__ == "__main__":
    main()
