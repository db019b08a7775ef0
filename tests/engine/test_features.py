"""No false alarm across vLLM's features: each run with the guard on gives the guard-off text,
request by request, and the guard reports nothing.

Sliding window: a Mistral-style model whose every layer attends to the last 64 tokens. vLLM
frees the pages behind the window while the request runs (its block table gets the null block
there) and hands them to other requests; the lifecycle audit took that for a block allocated
while held (206 violations in the default mode, 940 in paranoid, clean requests failed).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.engine.harness import engine, greedy, guard_env, read_log

pytestmark = pytest.mark.engine
INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# What the guard reports when it finds something (its own start lines aside).
FINDINGS = {
    "kv_block_corrupted",
    "kv_block_nonfinite",
    "kv_block_identity_mismatch",
    "kv_block_write_lost",
    "kv_block_lifecycle_violation",
    "kv_block_quarantined",
    "kv_request_affected",
    "kvguard_internal_error",
    "kvguard_worker_internal_error",
}


@pytest.fixture(scope="module")
def sliding_model() -> str:
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    return str(build_tiny_model(ROOT / ".cache" / "tiny-mistral", family="mistral"))


# 8 prompts of 150 tokens (5 pages, 2 of them behind the window by the end of the prompt),
# 64 tokens each, in a pool of 48 blocks: freed pages change hands while their requests run.
# The first 4 again in the same batch: prefix-cache hits (null blocks behind the window).
SLIDING_PROMPTS = [" ".join(f"w{(i * 7 + j * 31) % 400 + 17}" for i in range(150)) for j in range(8)]


def _sliding(model: str, env: dict[str, str]) -> list[str]:
    with engine(model, env, num_gpu_blocks_override=48, max_num_batched_tokens=512) as llm:
        config = llm.llm_engine.vllm_config.model_config.hf_config
        assert getattr(config, "sliding_window", None) == 64
        outs = llm.generate(
            SLIDING_PROMPTS + SLIDING_PROMPTS[:4], greedy(64, ignore_eos=True), use_tqdm=False
        )
    assert all(o.outputs[0].finish_reason == "length" for o in outs), [o.outputs[0].stop_reason for o in outs]
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def sliding_plain(sliding_model: str) -> list[str]:
    return _sliding(sliding_model, {"VLLM_KVGUARD": "0", **INPROC})


@pytest.mark.parametrize("verify", ["sampled", "paranoid"])
def test_sliding_window_pages_freed_while_running_raise_no_false_alarm(
    sliding_model: str, sliding_plain: list[str], tmp_path: Path, verify: str
) -> None:
    log = tmp_path / "guard.jsonl"
    texts = _sliding(sliding_model, guard_env("quarantine", log, **INPROC, VLLM_KVGUARD_VERIFY=verify))
    lines: list[dict[str, Any]] = read_log(log)
    assert [(line["event"], line.get("what")) for line in lines if line["event"] in FINDINGS] == []
    assert texts == sliding_plain
    assert any(line["event"] == "kvguard_started" for line in lines)
