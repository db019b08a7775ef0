"""The guard's own µs per engine step, scheduler side and worker side, without an engine.

    python benchmarks/step_micro.py [--running 16,256,1024] [--blocks 10000,100000,1000000]
                                    [--verify reuse,sampled] [--json out.json]

Drives the real role objects (``KVGuardScheduler``, ``KVGuardWorker``) in vLLM's call order
with vLLM's own ``CachedRequestData`` per step, over a KV tensor in vLLM's CPU page layout
(bfloat16; small pages, so that a million-block pool fits in memory). Every request has a
prompt of 8 full pages plus one token and then decodes one token per step. Two step kinds:

- ``quiet``: a decode step where no page fills, nothing is hit and (``reuse``) nothing is
  due for sampling or scrubbing: all requests are at the same place in their pages;
- ``mixed``: requests spread over their pages, so that 1 in ``block_size`` of them fills a
  page every step (a steady decode batch).

Scheduler side: ``build_connector_meta``, ``update_connector_output`` and
``get_kv_connector_stats`` (what vLLM calls every step). Worker side:
``bind_connector_metadata``, ``wait_for_layer_load`` per layer, ``wait_for_save`` and
``build_connector_worker_meta``. Medians (and means) over the measured steps, in µs per step:
with sampled reads batched every N steps (``--every``, ``VLLM_KVGUARD_VERIFY_EVERY``) the
median is a step with nothing due, the mean includes the due steps' share.
Scrubbing is off (``VLLM_KVGUARD_SCRUB_INTERVAL=0``): its cost is its budget, on the steps it
is due. It runs against older versions of the package too (``PYTHONPATH=<worktree>``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.core.sched.output import CachedRequestData

from vllm_kvguard.config import load_config
from vllm_kvguard.connector.scheduler import KVGuardScheduler
from vllm_kvguard.connector.worker import KVGuardWorker
from vllm_kvguard.logs import GuardLog

PROMPT_PAGES = 8


class _Manager:
    """The one call the scheduler side makes on vLLM's KV cache manager."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int]]:
        return (self.tables[req_id],)


def _output(new: list[Any], cached: CachedRequestData, ntok: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=ntok,
        total_num_scheduled_tokens=sum(ntok.values()),
        scheduled_spec_decode_tokens={},
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )


class Bench:
    def __init__(
        self,
        running: int,
        blocks: int,
        verify: str,
        bs: int,
        layers: int,
        heads: int,
        head: int,
        rows: str = "on",
        every: str | None = None,
    ):
        env = {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_VERIFY": verify, "VLLM_KVGUARD_SCRUB_INTERVAL": "0"}
        if every is not None:  # (unset for trees older than the variable)
            env["VLLM_KVGUARD_VERIFY_EVERY"] = every
        env["VLLM_KVGUARD_ROWS"] = "1" if rows == "on" else "0"
        env["VLLM_KVGUARD_LOG_LEVEL"] = "WARNING"
        config = load_config(env)
        self.bs = bs
        page = (heads, bs, 2 * head)
        self.kv_backing = torch.zeros((layers, blocks, *page), dtype=torch.bfloat16)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        kv = {n: self.kv_backing[i] for i, n in enumerate(self.names)}
        self.worker = KVGuardWorker(config, blocks, 0, GuardLog(config, role="worker", rank=0), block_size=bs)
        self.worker.register_kv_caches(kv)
        self.manager = _Manager()
        bytes_per_block = layers * self.kv_backing[0, 0].numel() * 2
        self.scheduler = KVGuardScheduler(
            config,
            GuardLog(config, role="scheduler", rank=0),
            num_blocks=blocks,
            block_size=bs,
            bytes_per_block=bytes_per_block,
            num_layers=layers,
            model_name="micro",
            details={},
        )
        self.scheduler.kv_cache_manager = self.manager  # type: ignore[assignment]
        self.running = running
        self.ids = [f"req-{i}" for i in range(running)]
        # Each request's table: its prompt's pages, then one page per block_size decode tokens.
        per = PROMPT_PAGES + 4
        if running * per > blocks - 1:
            raise SystemExit(f"{running} requests x {per} pages do not fit {blocks} blocks")
        self.next_block = 1
        self.nc: dict[str, int] = {}
        self.seq = 0

        from vllm_kvguard.connector import patches
        from vllm_kvguard.connector.layout import cpu_isa

        # vLLM's op itself (not timed), then the guard's observer of it (timed: worker side).
        self._write_op = patches.original_cpu_kv_write()
        self._observer = patches._KV_WRITE_OBSERVER
        self._observed = 0.0
        self._isa = cpu_isa(self.names[0], torch.bfloat16, bs, head)
        self.head_shape = (heads, head)

    def _blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def _note(self, req_id: str, tokens: int) -> None:
        request = SimpleNamespace(
            request_id=req_id,
            all_token_ids=[(hash(req_id) + i) % 30000 for i in range(tokens + 64)],
            lora_request=None,
            mm_features=None,
            prompt_embeds=None,
            cache_salt=None,
        )
        self.scheduler.note_request(request)  # type: ignore[arg-type]

    def prefill(self, offsets: list[int]) -> None:
        """Schedule every request's prompt (8 pages + 1 + offset tokens) in one step."""
        new, ntok = [], {}
        for req_id, extra in zip(self.ids, offsets, strict=True):
            tokens = PROMPT_PAGES * self.bs + 1 + extra
            table = self._blocks(-(-tokens // self.bs))
            self.manager.tables[req_id] = table
            self._note(req_id, tokens)
            new.append(SimpleNamespace(req_id=req_id, block_ids=(table,), num_computed_tokens=0))
            ntok[req_id] = tokens
            self.nc[req_id] = tokens
        slots = [x for r in self.ids for x in self._slots(r, 0, self.nc[r])]
        self.step(_output(new, CachedRequestData.make_empty(), ntok), slots)

    def _slots(self, req_id: str, start: int, end: int) -> list[int]:
        table = self.manager.tables[req_id]
        return [table[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]

    def _forward(self, slots: list[int]) -> None:
        """What the model's forward does to the KV cache: write each token's K and V, every
        layer, with vLLM's own CPU write op (new values every step; not timed)."""
        n = len(slots)
        mapping = torch.tensor(slots, dtype=torch.int64)
        self.seq += 1
        gen = torch.Generator().manual_seed(self.seq)
        for i in range(len(self.names)):
            heads, head = self.head_shape
            key = torch.randn((n, heads, head), generator=gen).to(torch.bfloat16)
            value = torch.randn((n, heads, head), generator=gen).to(torch.bfloat16)
            layer = self.kv_backing[i]
            key_cache, value_cache = layer.view(layer.shape[0], heads, 2 * self.bs, head).chunk(2, dim=2)
            self._write_op(key, value, key_cache, value_cache, mapping, self._isa)
            if self._observer is not None:
                start = time.perf_counter()
                self._observer(key, value, key_cache, mapping)
                self._observed += time.perf_counter() - start

    def decode(self) -> tuple[float, float]:
        """One decode step for every request; returns (scheduler s, worker s)."""
        new_blocks: list[tuple[list[int]] | None] = []
        for req_id in self.ids:
            table = self.manager.tables[req_id]
            if self.nc[req_id] // self.bs >= len(table):
                added = self._blocks(1)
                table.extend(added)
                new_blocks.append((added,))
            else:
                new_blocks.append(None)
        cached = CachedRequestData(
            req_ids=list(self.ids),
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=new_blocks,
            num_computed_tokens=[self.nc[r] for r in self.ids],
            num_output_tokens=[self.nc[r] for r in self.ids],
        )
        ntok = dict.fromkeys(self.ids, 1)
        slots = [x for r in self.ids for x in self._slots(r, self.nc[r], self.nc[r] + 1)]
        out = self.step(_output([], cached, ntok), slots)
        for req_id in self.ids:
            self.nc[req_id] += 1
        return out

    def step(self, so: SimpleNamespace, slots: list[int]) -> tuple[float, float]:
        s, w = self.scheduler, self.worker
        t0 = time.perf_counter()
        meta = s.build_connector_meta(so)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        w.bind_connector_metadata(meta)
        t_bind = time.perf_counter()
        self._observed = 0.0
        self._forward(slots)
        t_fwd = time.perf_counter() - self._observed  # the observer's time stays the worker's
        for name in self.names:
            w.wait_for_layer_load(name)
        w.wait_for_save()
        w.get_block_ids_with_load_errors()
        out = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        t2 = time.perf_counter()
        if out is not None:
            s.update_connector_output(out)
        s.stats()
        t3 = time.perf_counter()
        return (t1 - t0) + (t3 - t2), (t2 - t1) - (t_fwd - t_bind)


def measure(args: argparse.Namespace, running: int, blocks: int, verify: str) -> dict[str, Any]:
    bench = Bench(
        running,
        blocks,
        verify,
        args.block_size,
        args.layers,
        args.kv_heads,
        args.head_size,
        args.rows,
        args.every,
    )
    bs = args.block_size
    result: dict[str, Any] = {"running": running, "blocks": blocks, "verify": verify, "rows": args.rows}
    # quiet: everyone at position 8*bs+1 of its table; steps up to the page's last slot are quiet.
    bench.prefill([0] * running)
    quiet = [bench.decode() for _ in range(bs - 3)]
    # mixed: those finish; a fresh batch, spread over the slots of their last page, reuses the pool.
    for req_id in bench.ids:
        bench.scheduler.request_finished(req_id)
    bench.ids, bench.next_block = [f"mix-{i}" for i in range(running)], 1
    bench.prefill([i % bs for i in range(running)])
    mixed = [bench.decode() for _ in range(2 * bs)]
    for kind, samples in (("quiet", quiet[2:]), ("mixed", mixed[2:])):
        result[f"{kind}_scheduler_us"] = statistics.median(x[0] for x in samples) * 1e6
        result[f"{kind}_worker_us"] = statistics.median(x[1] for x in samples) * 1e6
        # Means too: sampled reads batched every N steps (VLLM_KVGUARD_VERIFY_EVERY) cost on
        # one step in N, which the median leaves out.
        result[f"{kind}_scheduler_mean_us"] = statistics.fmean(x[0] for x in samples) * 1e6
        result[f"{kind}_worker_mean_us"] = statistics.fmean(x[1] for x in samples) * 1e6
    del bench
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", default="16,256,1024", help="running requests (comma-separated)")
    ap.add_argument("--blocks", default="10000,100000,1000000", help="KV blocks in the pool")
    ap.add_argument("--verify", default="reuse,sampled", help="VLLM_KVGUARD_VERIFY values")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-size", type=int, default=32)
    ap.add_argument("--rows", choices=["on", "off"], default="on", help="row digests (VLLM_KVGUARD_ROWS)")
    ap.add_argument("--every", help="VLLM_KVGUARD_VERIFY_EVERY (default: the package's)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    print(
        f"{a.layers} layers x {a.kv_heads} KV heads x head {a.head_size}, block {a.block_size}, bfloat16, "
        f"rows {a.rows}; guard us per decode step: median (mean)"
    )
    print(
        f"{'verify':8s} {'running':>7s} {'blocks':>8s}   quiet: sched (mean)  worker (mean)"
        "   mixed: sched (mean)  worker (mean)"
    )
    for verify in a.verify.split(","):
        for blocks in (int(b) for b in a.blocks.split(",")):
            for running in (int(r) for r in a.running.split(",")):
                if running * (PROMPT_PAGES + 4) > blocks - 1:
                    continue
                r = measure(a, running, blocks, verify)
                results.append(r)
                quiet, mixed = (
                    f"{r[k + '_scheduler_us']:12.1f} ({r[k + '_scheduler_mean_us']:5.1f})"
                    f" {r[k + '_worker_us']:7.1f} ({r[k + '_worker_mean_us']:5.1f})"
                    for k in ("quiet", "mixed")
                )
                print(f"{verify:8s} {running:7d} {blocks:8d}   {quiet}   {mixed}", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
