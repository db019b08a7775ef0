"""The guard on vLLM 0.34's own scheduler and Model Runner V2 connector driver, without a GPU.

Run as a script by tests/compat/test_vllm034.py with vLLM 0.34.0's Python source first on
``PYTHONPATH`` (the GPU wheel's compiled kernels are left out: nothing here needs them).
Real parts: 0.34's ``Scheduler`` (prefix cache, preemption, invalid-block handling) with the
guard's scheduler half, and 0.34's ``ActiveKVConnector`` (what ``GPUModelRunner`` V2 calls:
``pre_forward`` -> ``finish_forward`` -> ``post_forward``) driving the guard's worker half
over a KV tensor in 0.34's GPU layout. Only the forward is simulated: each step writes, for
every scheduled token, bytes determined by (the tokens up to it, position) into its KV slot, so
shared prefix pages are identical and a recomputed page is restored. Row digests are on (0.34's
GPU layout in host memory: rows along the slot axis; kept on the device, by the row kernel, in
the kvg64 variant). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

BS, NB, HEADS, HEAD = 16, 24, 2, 8


def main() -> int:
    model, log_file = sys.argv[1], sys.argv[2]
    # "full_graph": the forward is one CUDA graph replay, so no per-layer hook runs, and the
    # step's output is collected before wait_for_save (as with a speculator).
    layer_hooks = sys.argv[3] != "full_graph"
    os.environ["VLLM_KVGUARD"] = "1"
    os.environ["VLLM_KVGUARD_LOG_FILE"] = log_file
    os.environ.setdefault("VLLM_KVGUARD_VERIFY", "sampled")
    # The case counts steps ("caught in the first step after the flip"): every step verifies
    # its sample (the default batches them every 4 steps: tests/unit/core/test_ledger.py).
    os.environ["VLLM_KVGUARD_VERIFY_EVERY"] = "1"
    # The case flips single bits to drive 0.34's bad-block handling (recompute); with repair on
    # the host path would mend them in place instead (tests/engine/test_shapes.py covers that).
    os.environ["VLLM_KVGUARD_REPAIR"] = "0"
    import vllm
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from tests.engine.harness import spy_invalid_blocks
    from vllm_kvguard.config import load_config
    from vllm_kvguard.connector import KVGuardConnector
    from vllm_kvguard.plugin import compose_kv_transfer_config, register

    register()
    page = 2 * BS * HEADS * HEAD * 2
    vc = VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=512),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, is_encoder_decoder=False
        ),
        kv_transfer_config=compose_kv_transfer_config(None, load_config()),
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = NB
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    kcc = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[
            KVCacheTensor(size=NB * page, layers=["l0"], layer_stride=NB * page, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    scheduler = Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
        log_stats=True,
    )
    worker = KVGuardConnector(vc, KVConnectorRole.WORKER, kcc)
    kv_transfer_state._KV_CONNECTOR_AGENT = worker
    # vLLM's GPU layout: (2, num_blocks, block_size, kv_heads, head_size), K and V apart.
    kv = torch.zeros((2, NB, BS, HEADS, HEAD), dtype=torch.bfloat16)
    runner = ActiveKVConnector(vc, {"l0": kv})

    invalid_sets = spy_invalid_blocks(scheduler)

    def handled() -> list[list[int]]:
        return [sorted(blocks) for blocks in invalid_sets]

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    stats: Counter[str] = Counter()
    seen: set[str] = set()

    def forward(so: Any) -> None:
        """What the model's attention would write: one KV slot per scheduled token."""
        for req_id, n in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            table = scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            end = request.num_computed_tokens
            for pos in range(end - n, end):
                # As in a model with more than one layer, a slot's K and V depend on every
                # token up to it, not only on its own (row digests would otherwise take two
                # requests' equal (token, position) slots for a write that never landed).
                context = hash((pos, *request.all_token_ids[: pos + 1])) & 0xFFFFFFFF
                g = torch.Generator().manual_seed(context)
                value = torch.randn((2, HEADS, HEAD), generator=g)
                kv[:, table[pos // BS], pos % BS] = value.to(torch.bfloat16)
        if layer_hooks:
            worker.wait_for_layer_load("l0")  # the attention layer's hook (eager, piecewise)

    def step() -> None:
        so = scheduler.schedule()
        stats["preempted"] += len(so.preempted_req_ids or ())
        stats["resumed_in_full"] += sum(1 for r in so.scheduled_new_reqs if r.req_id in seen)
        seen.update(r.req_id for r in so.scheduled_new_reqs)
        runner.pre_forward(so)
        forward(so)
        runner.finish_forward()
        # With a speculator (and here with the full-graph variant) the runner collects the
        # output before wait_for_save (defer_finalize) and finalizes after the drafter.
        kco = runner.post_forward(so.finished_req_ids, defer_finalize=not layer_hooks)
        if not layer_hooks:
            runner.finalize_step()
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids], kv_connector_output=kco)
        scheduler.update_from_output(so, out)

    def run(requests: list[Request]) -> None:
        for r in requests:
            scheduler.add_request(r)
        for _ in range(400):
            if not scheduler.get_num_unfinished_requests():
                return
            step()
        raise RuntimeError("requests did not finish")

    def req(name: str, tokens: list[int], n: int) -> Request:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return Request(name, tokens, params, None, block_hasher=hasher)

    prefix = list(range(100, 100 + 4 * BS))
    run([req("a", [*prefix, 1, 2], 4)])
    sealed = sorted(int(b) for b in torch.nonzero(torch.from_numpy(worker.worker.table.sealed)).flatten())
    # One bit of a sealed prefix page (V part: K and V are separate runs of the page).
    kv.view(torch.uint8).view(2, NB, -1)[1, sealed[1], 5] ^= 0x40
    run([req("b", [*prefix, 3, 4], 4), req("c", [*prefix, 5], 4)])
    after_flip = handled()
    # A running request's page corrupted mid-decode: read-time verification.
    scheduler.add_request(req("d", list(range(600, 600 + 3 * BS + 2)), 12))
    for _ in range(6):
        step()
    d_table = scheduler.kv_cache_manager.get_block_ids("d")[0]
    kv.view(torch.uint8).view(2, NB, -1)[0, d_table[1], 9] ^= 0x40
    before = len(invalid_sets)
    step()
    mid_decode = handled()[before:]
    run([])
    run([req(f"p{i}", list(range(300 + 60 * i, 360 + 60 * i)), 40) for i in range(4)])
    lines = [json.loads(line) for line in Path(log_file).read_text().splitlines()]
    print(
        json.dumps(
            {
                "vllm": vllm.__version__,
                "scheduler_connector": type(scheduler.connector).__name__,
                "requires_kv_delivery": scheduler.requires_kv_delivery,
                "deferred": worker.worker.pages.deferred,
                "rows": type(worker.worker.rows).__name__,
                "row_kernel": getattr(worker.worker.rows, "geometry", None) is not None,
                "sealed_by_a": sealed,
                "flipped": sealed[1],
                "handled_after_flip": after_flip,
                "handled": handled(),
                "mid_decode_block": d_table[1],
                "handled_mid_decode": mid_decode,
                "events": Counter(line["event"] for line in lines),
                "corrupted": [
                    {k: line[k] for k in ("block_id", "trigger", "action", "request_ids", "step")}
                    for line in lines
                    if line["event"] == "kv_block_corrupted"
                ],
                "stats": stats,
                "internal_errors": worker.worker.internal_errors,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
