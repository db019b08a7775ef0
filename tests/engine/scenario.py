"""Shared test scenarios: a clean prefix-sharing workload and a targeted corruption."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.engine.harness import BLOCK, greedy, words
from vllm_kvguard import testing
from vllm_kvguard.tools.workload import Workload

CLEAN = Workload(prefixes=3, per_prefix=6, prefix_words=150, suffix_words=6, max_tokens=40, seed=3)
PREFIX_BLOCKS = 4
PREFIX = words(11, PREFIX_BLOCKS * BLOCK)


def run_clean(llm: Any) -> tuple[list[str], list[int]]:
    """All waves in one batch (to force preemption), then again wave by wave (reuse)."""
    prompts = [p for wave in CLEAN.waves() for p in wave]
    texts, cached = [], []
    for batch in [prompts, *CLEAN.waves()]:
        for out in llm.generate(batch, greedy(CLEAN.max_tokens), use_tqdm=False):
            texts.append(out.outputs[0].text)
            cached.append(out.num_cached_tokens)
    return texts, cached


@dataclass
class Corruption:
    block_id: int
    layers: list[str]
    clean: list[str]
    readers: list[str]


def prompts_b() -> list[str]:
    return [f"{PREFIX} w401 w402", f"{PREFIX} w403 w404 w405"]


def seal_prefix_and_corrupt(llm: Any, *, which: int = 1) -> Corruption:
    """Write a 4-block prefix (request A), reuse it cleanly (B), then flip one bit in it.

    A's prompt is the prefix plus two words and A generates 4 tokens, so the only
    blocks A fills are the 4 prefix blocks: exactly the pages B will reuse.
    """
    before = llm.collective_rpc(testing.seal_snapshot)[0]
    llm.generate([f"{PREFIX} w398 w399"], greedy(4), use_tqdm=False)
    after = llm.collective_rpc(testing.seal_snapshot)[0]
    sealed = sorted(b for b, d in after.items() if before.get(b) != d)
    assert len(sealed) == PREFIX_BLOCKS, sealed
    outs = llm.generate(prompts_b(), greedy(16), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [PREFIX_BLOCKS * BLOCK] * 2
    block = sealed[which]
    # Byte 1 of a bf16 element holds the sign and high exponent bits.
    layers = llm.collective_rpc(testing.flip_bit, args=(block, 0, 1, 6))[0]
    return Corruption(block, layers, [o.outputs[0].text for o in outs], [])
