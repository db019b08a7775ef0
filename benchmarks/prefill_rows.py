"""What recording the rows of a long prefill costs the guard, on a model whose rows are large.

    python benchmarks/prefill_rows.py [--layers 32] [--heads 8] [--head-size 128] [--tokens 1024]
                                      [--prompts 4]

Builds a random-weight model (Llama-3-8B's KV shape by default: 32 layers, 8 KV heads of 128, so a
row, one token's K and V in every layer, is 128 KiB), runs the engine in this process with the
guard on (``sampled``), and prefills ``--prompts`` prompts of ``--tokens`` tokens, one at a time
(one token generated each). Prints the guard's time in ``wait_for_save`` (where the rows the
forward wrote are recorded) and in the write op's wrapper (where they are summed as written) per
prefill, and whether the step's rows were taken as written or read back out of the pages.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4)
    a = ap.parse_args()
    os.environ.update(
        VLLM_KVGUARD="1",
        VLLM_KVGUARD_VERIFY="sampled",
        VLLM_KVGUARD_LOG_LEVEL="WARNING",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
    )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    import vllm_kvguard.connector as connector
    import vllm_kvguard.connector.patches as patches
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    hidden = a.heads * a.head_size
    model = build_tiny_model(
        Path(tempfile.gettempdir()) / f"kvguard-prefill-{a.layers}x{a.heads}x{a.head_size}",
        layers=a.layers,
        hidden=hidden,
        heads=a.heads,
        kv_heads=a.heads,
    )
    llm = LLM(
        model=str(model),
        max_model_len=a.tokens + 16,
        max_num_batched_tokens=a.tokens + 16,
        max_num_seqs=1,
        enforce_eager=True,
    )
    spent = {"wait_for_save": 0.0, "kv write": 0.0}
    original = connector.KVGuardConnector.wait_for_save

    def timed(self: Any, *args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kw)
        finally:
            spent["wait_for_save"] += time.perf_counter() - start

    connector.KVGuardConnector.wait_for_save = timed  # type: ignore[method-assign]
    observer = patches._KV_WRITE_OBSERVER
    assert observer is not None, "rows are not digested as written here"
    worker = observer.__self__  # type: ignore[attr-defined]

    def observed(*args: Any) -> None:
        start = time.perf_counter()
        try:
            observer(*args)
        finally:
            spent["kv write"] += time.perf_counter() - start

    patches._KV_WRITE_OBSERVER = observed
    params = SamplingParams(max_tokens=1, temperature=0.0)
    vocab = 200  # the tiny model knows a few hundred words
    for i in range(a.prompts + 1):  # the first warms up
        prompt = {"prompt_token_ids": [(7 * i + 13 * t) % vocab + 1 for t in range(a.tokens)]}
        spent.update({"wait_for_save": 0.0, "kv write": 0.0})
        as_written = worker.rows_as_written
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        total = time.perf_counter() - start
        if i:
            print(
                f"prefill {i}: {a.tokens} tokens, generate() {total * 1e3:.0f} ms, "
                f"wait_for_save {spent['wait_for_save'] * 1e3:.1f} ms, "
                f"kv write {spent['kv write'] * 1e3:.1f} ms, "
                f"rows taken as written {worker.rows_as_written - as_written}"
            )


if __name__ == "__main__":
    main()
