"""Hybrid models (several KV cache groups): guarded when vLLM can run them with one group,
a clear line and unchanged serving when they need vLLM's hybrid KV cache manager.

The model is a tiny Gemma-2 built by the test: sliding-window and full-attention layers
alternate, which vLLM's hybrid manager keeps in two KV cache groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.engine.harness import INPROC, engine, events, guard_env, words
from vllm_kvguard import testing
from vllm_kvguard.tools.tinymodel import build_tiny_model

pytestmark = pytest.mark.engine
PROMPT = words(17, 128) + " w300 w301"  # 4 full blocks of 32; longer than the 64-token window


@pytest.fixture(scope="module")
def gemma2() -> str:
    return str(build_tiny_model(ROOT / ".cache" / "tiny-gemma2", family="gemma2"))


def _text(llm: Any) -> str:
    from vllm import SamplingParams

    return (
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
        .outputs[0]
        .text
    )


def _started(log: Path) -> dict[str, Any]:
    (line,) = [e for e in events(log, "kvguard_started") if e["role"] == "scheduler"]
    return line["details"]


def test_by_default_the_guard_keeps_one_kv_cache_group_and_guards_it(gemma2: str, tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    with engine(gemma2, guard_env("quarantine", log, **INPROC), num_gpu_blocks_override=64) as llm:
        before = llm.collective_rpc(testing.seal_snapshot)[0]
        reference = _text(llm)
        after = llm.collective_rpc(testing.seal_snapshot)[0]
        blocks = sorted(b for b, d in after.items() if before.get(b) != d)
        assert len(blocks) == 4
        llm.collective_rpc(testing.flip_bit, args=(blocks[1], 0, 1, 6))
        text = _text(llm)
    assert _started(log)["kv_cache_groups"] == 1 and _started(log)["active"] is True
    (line,) = events(log, "kv_block_corrupted")
    assert line["block_id"] == blocks[1] and line["action"] == "quarantined_and_recomputed"
    assert text == reference


def test_with_the_hybrid_manager_the_guard_stands_aside_and_serving_is_unchanged(
    gemma2: str, tmp_path: Path
) -> None:
    log = tmp_path / "guard.jsonl"
    hybrid = {"disable_hybrid_kv_cache_manager": False}  # --no-disable-hybrid-kv-cache-manager
    with engine(gemma2, {**INPROC}, num_gpu_blocks_override=64, **hybrid) as llm:
        plain = _text(llm)
    with engine(gemma2, guard_env("quarantine", log, **INPROC), num_gpu_blocks_override=64, **hybrid) as llm:
        guarded = _text(llm)
        sealed = sum(m.value for m in llm.get_metrics() if m.name == "vllm:kvguard_blocks_sealed")
    assert _started(log)["kv_cache_groups"] == 2 and _started(log)["active"] is False
    (inactive,) = events(log, "kvguard_inactive")
    assert inactive["level"] == "warning" and "2 KV cache groups" in inactive["reason"]
    assert guarded == plain
    assert sealed == 0
    assert events(log, "kvguard_internal_error") == []
