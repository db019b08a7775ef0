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
from tests.engine.servers import serve, wait
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


SERVER_PREFIX = words(5, 128)  # exactly 4 blocks of 32 one-token words


def _complete(client: Any, prompt: str) -> Any:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0]


@pytest.mark.parametrize("mode", ["quarantine", "log"])
def test_tensor_parallel_server_names_the_rank_and_exports_its_figures(
    tiny_model: str, tmp_path: Path, mode: str
) -> None:
    """``vllm serve --tensor-parallel-size 2``: a drill zeroes one page on worker 1 only. The
    guard names rank 1, and the figures reach the server's own /metrics. Quarantine: the reader
    recomputes and gets the clean text. Log mode is the control: the same fault changes the
    text, and the response is flagged."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    guard = {
        "VLLM_KVGUARD": "1",
        "VLLM_KVGUARD_MODE": mode,
        "VLLM_KVGUARD_INJECT": "zero:count=1,rank=1,layer=0",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    args = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    with serve(tiny_model, tmp_path, guard, args=args) as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = SERVER_PREFIX + " w401 w402"
        clean = _complete(client, prompt)  # seals the prefix's 4 pages on both workers
        _complete(client, "w1 w2 w3")  # its first step: the drill zeroes an idle sealed page on rank 1
        (injected,) = events(server.log, "kv_fault_injected")
        again = _complete(client, prompt)  # reuses the prefix: the page is verified on both workers
        # Quarantine: one line. Log mode leaves the page in place: each verification of it logs again.
        lines = events(server.log, "kv_block_corrupted")
        assert len(lines) == 1 or (mode == "log" and len({(e["block_id"], e["rank"]) for e in lines}) == 1)
        line = lines[0]
        assert line["block_id"] == injected["block_id"]
        assert line["ranks"] == [1] and line["rank"] == 1 and line["layer"].startswith("model.layers.0.")
        (affected,) = events(server.log, "kv_request_affected")
        if mode == "quarantine":
            assert line["action"] == "quarantined_and_recomputed"
            assert affected["outcome"] == "healed" and again.text == clean.text
        else:
            assert affected["outcome"] == "suspect"
            assert again.text != clean.text  # the control: the zeroed page changed the text
            assert str(getattr(again, "stop_reason", "")).startswith("KV-cache corruption: block ")

        def samples() -> dict[tuple[str, str], float]:
            out = {}
            for family in text_string_to_metric_families(server.metrics()):
                for s in family.samples:
                    if s.name.startswith("vllm:kvguard"):
                        own = [v for k, v in s.labels.items() if k not in ("model_name", "engine")]
                        label = own[0] if own else ""
                        out[(s.name, label)] = s.value
            return out

        seen = wait(
            lambda: (s := samples()).get(("vllm:kvguard_requests_affected_total", affected["outcome"])) and s,
            30,
            "the guard's figures on /metrics",
        )
        assert seen[("vllm:kvguard_corruptions_detected_total", "checksum_mismatch")] == len(lines)
        assert seen[("vllm:kvguard_faults_injected_total", "zero")] == 1
        assert seen[("vllm:kvguard_blocks_quarantined", "")] == (1 if mode == "quarantine" else 0)
        # Worker-side figures of both workers arrive through the scheduler's stats.
        assert seen[("vllm:kvguard_bytes_hashed_total", "seal")] > 0
        assert seen[("vllm:kvguard_overhead_seconds_total", "worker")] > 0
        assert seen[("vllm:kvguard_state_bytes", "worker")] > 0
    started = [e for e in events(server.log, "kvguard_started") if e["role"] == "worker"]
    assert sorted(e["rank"] for e in started) == [0, 1]
