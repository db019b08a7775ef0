"""Tensor and pipeline parallelism: each worker guards its own shard or layers.

Two CPU workers (vLLM's multiprocessing executor), one core each. A page is
corrupted on one worker only; the guard finds it there, reports it once, and the
readers recompute on every worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import engine, events, guard_env, words
from vllm_kvguard import testing

pytestmark = pytest.mark.engine
PROMPT = words(17, 128) + " w300 w301"  # 4 full blocks of 32, then 2 tokens


def _text(llm: Any, n: int) -> str:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize(
    ("layout", "rank", "layer_prefix"),
    [
        # Both workers hold both layers, one KV head each.
        ("tensor_parallel_size", 1, "model.layers.0."),
        # Worker 0 holds layer 0, worker 1 layer 1; corrupt the first stage, whose
        # output is not the one the executor returns to the scheduler.
        ("pipeline_parallel_size", 0, "model.layers.0."),
    ],
)
def test_corruption_on_one_worker_is_found_and_handled_once(
    tiny_model: str, tmp_path: Path, layout: str, rank: int, layer_prefix: str
) -> None:
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, VLLM_CPU_OMP_THREADS_BIND="0|1")
    overrides: dict[str, Any] = {layout: 2, "distributed_executor_backend": "mp"}
    overrides["num_gpu_blocks_override"] = 64
    if layout == "pipeline_parallel_size":
        # vllm-cpu 0.32 allocates the pipeline's intermediate buffers only in the
        # compile warm-up: eager mode fails at the first step, guard or not.
        overrides["enforce_eager"] = False
    with engine(tiny_model, env, **overrides) as llm:
        before = llm.collective_rpc(testing.seal_snapshot)
        _text(llm, 1)
        after = llm.collective_rpc(testing.seal_snapshot)
        pairs = zip(before, after, strict=True)
        per_rank = [sorted(b for b, d in a.items() if bf.get(b) != d) for bf, a in pairs]
        assert len(per_rank) == 2 and per_rank[0] == per_rank[1] and len(per_rank[0]) == 4
        block = per_rank[0][2]
        reference = _text(llm, 16)  # reuses the prompt's pages: verified clean on both workers
        names = llm.collective_rpc(testing.flip_bit, args=(block, 0, 5, 3), kwargs={"rank": rank})
        assert names[rank][0].startswith(layer_prefix)
        text = _text(llm, 16)
    (line,) = events(log, "kv_block_corrupted")
    assert line["block_id"] == block and line["ranks"] == [rank]
    assert line["layer"].startswith(layer_prefix)
    assert line["action"] == "quarantined_and_recomputed"
    assert len(events(log, "kv_block_quarantined")) == 1
    assert text == reference
    started = [e for e in events(log, "kvguard_started") if e["role"] == "worker"]
    assert sorted(e["rank"] for e in started) == [0, 1]
