"""The shape of a corruption on a real engine, and single-word faults mended in place.

A bit flipped in a sealed prefix page (the memory fault of the field notes) is located by the
page's syndrome and repaired before the forward that reuses it: the reader's text is the
clean run's, nothing is recomputed or quarantined, and the log says where the bit was. The
control: the same flip without the guard changes the reader's text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import (
    INPROC,
    block_table_of,
    core_scheduler,
    engine,
    events,
    greedy,
    guard_env,
    metric,
    spy_invalid_blocks,
)
from tests.engine.scenario import PREFIX, PREFIX_BLOCKS, prompts_b

pytestmark = pytest.mark.engine
BYTE, BIT = 1, 6  # the high byte of a bf16 element: sign and exponent bits


def _flip_without_guard(worker: Any, block: int) -> None:
    """Flip the bit in vLLM's own KV tensor of the first layer (no guard in the control)."""
    import torch

    kv = worker.model_runner.kv_caches[0]
    kv[block].view(torch.uint8).reshape(-1)[BYTE] ^= 1 << BIT


def _clean_then_flip(llm: Any, flip: Any) -> tuple[list[str], list[str], int]:
    blocks = block_table_of(llm, f"{PREFIX} w398 w399")[:PREFIX_BLOCKS]  # A's prefix pages
    clean = [o.outputs[0].text for o in llm.generate(prompts_b(), greedy(16), use_tqdm=False)]
    llm.collective_rpc(flip, args=(blocks[1],))
    after = llm.generate(prompts_b(), greedy(16), use_tqdm=False)
    assert [o.num_cached_tokens for o in after] == [PREFIX_BLOCKS * 32] * 2  # the page is reused
    return clean, [o.outputs[0].text for o in after], blocks[1]


def test_control_a_flipped_bit_in_a_reused_page_changes_the_text(tiny_model: str) -> None:
    with engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}) as llm:
        clean, after, _ = _clean_then_flip(llm, _flip_without_guard)
    assert after != clean


def _flip_with_guard(worker: Any, block: int) -> None:
    from vllm_kvguard import testing

    testing.flip_bit(worker, block, 0, BYTE, BIT)


def test_single_bit_flip_is_repaired_in_place_with_the_clean_text(tiny_model: str, tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    env = {**guard_env("quarantine", log, VLLM_KVGUARD_REPAIR="1"), **INPROC}
    with engine(tiny_model, env) as llm:
        invalid = spy_invalid_blocks(core_scheduler(llm))
        clean, after, block = _clean_then_flip(llm, _flip_with_guard)
        assert after == clean
        assert invalid == []  # nothing reported unreadable: nothing recomputed
        again = [o.outputs[0].text for o in llm.generate(prompts_b(), greedy(16), use_tqdm=False)]
        assert again == clean
        assert metric(llm, "vllm:kvguard_blocks_repaired") == 1
        assert metric(llm, "vllm:kvguard_corruption_shapes", shape="single_bit") == 1
        assert metric(llm, "vllm:kvguard_tokens_recomputed") == 0
        assert metric(llm, "vllm:kvguard_verifications", trigger="reuse") >= 8  # the name is right
    (line,) = events(log, "kv_block_corrupted")  # found once: the mended page stays verified
    assert line["block_id"] == block and line["action"] == "repaired" and line["shape"] == "single_bit"
    assert line["where"]["word"] == 0 and line["where"]["bits"] == [8 * BYTE + BIT]
    assert line["where"]["element"] == [0, 0, 0] and line["where"]["device"] == "cpu"
    assert events(log, "kv_block_quarantined") == []
    assert {a["outcome"] for a in events(log, "kv_request_affected")} == {"healed"}
