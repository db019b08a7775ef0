"""Where a decode step's guard time goes, hook by hook and function by function, without an engine.

    python benchmarks/step_parts.py [--running 16] [--kind mixed|quiet] [--verify reuse]
                                    [--time module:qualname,...] [--repeats 2]

Drives the same role objects in vLLM's call order as ``benchmarks/step_micro.py`` (its ``Bench``)
and prints, for the measured steps of one kind (``quiet``: no page fills, nothing is hit;
``mixed``: 1 in ``block_size`` requests fills a page and one begins a page every step), the
median µs a step of each hook (scheduler: ``build_connector_meta``, ``update_connector_output``,
``stats``; worker: ``bind_connector_metadata``, ``wait_for_layer_load`` (all layers),
``wait_for_save``, ``build_connector_worker_meta`` with the calls around it, and the write op's
observer inside the forward), then the mean µs a step of each function named with ``--time``
(wrapped for the measured steps only; each wrapper adds about half a microsecond), e.g.

    --time vllm_kvguard.core.ledger:BlockLedger._grow,vllm_kvguard.digest.table:DigestTable.seal

The figures of docs/performance.md's thirteenth round of issue 15 came from it. Run it against
another tree with ``PYTHONPATH=<worktree>``.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_micro  # (the benchmark beside this one: its Bench drives the roles)

HOOKS = ("build_connector_meta", "bind", "wait_for_layer_load", "wait_for_save", "worker_meta", "observer")
HOOKS_AFTER = ("update_connector_output", "stats")


class PartsBench(step_micro.Bench):
    """step_micro's Bench, timing each hook of a step apart (``parts``, one dict a step)."""

    measuring = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parts: list[dict[str, float]] = []

    def step(self, so: Any, slots: list[int]) -> tuple[float, float]:
        s, w = self.scheduler, self.worker
        t = [time.perf_counter()]
        meta = s.build_connector_meta(so)
        t.append(time.perf_counter())
        w.bind_connector_metadata(meta)
        t.append(time.perf_counter())
        self._observed = 0.0
        self._forward(slots)
        observed = self._observed
        t.append(time.perf_counter())
        for name in self.names:
            w.wait_for_layer_load(name)
        t.append(time.perf_counter())
        w.wait_for_save()
        t.append(time.perf_counter())
        w.get_block_ids_with_load_errors()
        out = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        t.append(time.perf_counter())
        if out is not None:
            s.update_connector_output(out)
        t.append(time.perf_counter())
        s.stats()
        t.append(time.perf_counter())
        spans = [(t[i + 1] - t[i]) * 1e6 for i in range(len(t) - 1)]
        if self.measuring:
            self.parts.append(
                {
                    "build_connector_meta": spans[0],
                    "bind": spans[1],
                    "wait_for_layer_load": spans[3],
                    "wait_for_save": spans[4],
                    "worker_meta": spans[5],
                    "observer": observed * 1e6,
                    "update_connector_output": spans[6],
                    "stats": spans[7],
                }
            )
        return spans[0] + spans[6] + spans[7], spans[1] + spans[3] + spans[4] + spans[5] + observed * 1e6


def _timed(targets: list[str], totals: dict[str, float], counts: collections.Counter[str]) -> None:
    """Wrap each ``module:qualname`` so that its time counts while PartsBench is measuring."""
    for target in targets:
        module, _, qualname = target.partition(":")
        if not qualname:
            raise SystemExit(f"--time: {target!r} is not module:qualname")
        owner: Any = importlib.import_module(module)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)

        def wrapper(
            *args: Any, _original: Callable[..., Any] = original, _name: str = qualname, **kw: Any
        ) -> Any:
            if not PartsBench.measuring:
                return _original(*args, **kw)
            start = time.perf_counter()
            try:
                return _original(*args, **kw)
            finally:
                totals[_name] += time.perf_counter() - start
                counts[_name] += 1

        setattr(owner, name, wrapper)


def run(a: argparse.Namespace) -> tuple[list[dict[str, float]], int]:
    bench = PartsBench(a.running, a.blocks, a.verify, a.block_size, a.layers, a.kv_heads, a.head_size)
    bs = a.block_size
    steps = 0
    if a.kind == "quiet":
        bench.prefill([0] * a.running)
        for i in range(bs - 3):  # (as step_micro: all at the same place in their pages)
            PartsBench.measuring = i >= 2
            bench.decode()
            steps += PartsBench.measuring
    else:
        bench.prefill([i % bs for i in range(a.running)])
        for i in range(2 * bs):
            PartsBench.measuring = i >= 2
            bench.decode()
            steps += PartsBench.measuring
    PartsBench.measuring = False
    return bench.parts, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--kind", choices=["mixed", "quiet"], default="mixed")
    ap.add_argument("--verify", default="reuse", help="VLLM_KVGUARD_VERIFY")
    ap.add_argument("--blocks", type=int, default=100000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="fresh role objects, one line each")
    ap.add_argument("--time", default="", help="functions to time, comma-separated module:qualname")
    a = ap.parse_args()
    torch.set_num_threads(1)
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    _timed([t for t in a.time.split(",") if t], totals, counts)
    print(f"{a.verify}, {a.running} running, {a.kind} decode steps: guard µs a step (median)")
    steps = 0
    for _ in range(a.repeats):
        parts, n = run(a)
        steps += n
        medians = {k: statistics.median(p[k] for p in parts) for k in HOOKS + HOOKS_AFTER}
        scheduler = medians["build_connector_meta"] + sum(medians[k] for k in HOOKS_AFTER)
        worker = sum(medians[k] for k in HOOKS[1:])
        line = "  ".join(f"{k} {medians[k]:.1f}" for k in HOOKS + HOOKS_AFTER)
        print(f"  scheduler {scheduler:.1f}  worker {worker:.1f}  |  {line}")
    if totals:
        print(f"functions timed, mean µs a step over {steps} steps (calls a step):")
        for name in sorted(totals, key=lambda k: -totals[k]):
            print(f"  {name:48s} {totals[name] / steps * 1e6:8.1f}  ({counts[name] / steps:.2f})")


if __name__ == "__main__":
    main()
