"""No silent wrong text: vLLM's KV bug classes reproduced in a real engine, each with a control.

Every test reproduces one class the way it behaves in vLLM (a page corrupted under a running
request, a block pool that hands out a page still in use, two readers of one bad page in raise
mode, a failed request's NaN left for the next owner of its blocks), first with the guard off
(the control: the fault must change the output, else the test proves nothing), then with the
guard on. The contract checked on every request: its text equals the clean run's, or it ended
with an error, or the guard flagged it; and the log and metrics say which, once per request.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that a test drives
it step by step and patches vLLM's block pool.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import (
    BLOCK,
    INPROC,
    affected_once,
    block_table_of,
    core_scheduler,
    engine,
    events,
    greedy,
    guard_env,
    honest,
    kv_layers,
    metric,
    run_to_end,
    steal_on_next_allocation,
    words,
)

pytestmark = pytest.mark.engine
OFF = {"VLLM_KVGUARD": "0", **INPROC}


# Worker-side helpers that need no guard (the control runs have none): they reach vLLM's own
# KV tensors, one per attention layer, blocks on dim 0 in the CPU layout.


def scramble(worker: Any, block: int, seed: int = 0) -> None:
    """Overwrite one page of every layer with noise (a misdirected write, a DMA gone astray)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for t in kv_layers(worker):
        t[block].copy_((torch.randn(t[block].shape, generator=g) * 3).to(t.dtype))


def poison(worker: Any, block: int) -> None:
    """Fill one page of every layer with NaN."""
    for t in kv_layers(worker):
        t[block].fill_(float("nan"))


def nonfinite_pages(worker: Any, blocks: list[int]) -> list[int]:
    import torch

    return [b for b in blocks if any(not torch.isfinite(t[b]).all() for t in kv_layers(worker))]


# ------------------------------------------------------------- 1. corrupted while running

LONG_PROMPT = words(17, 8 * BLOCK) + " w300 w301"  # 8 full blocks, then 2 tokens
SAMPLED = {
    "VLLM_KVGUARD_VERIFY": "sampled",
    # One page (2 layers x 16 KiB) per step, on average: 4 pages on every 4th step (the default
    # VLLM_KVGUARD_VERIFY_EVERY), 9 pages read (8 full, 1 unfilled): within 12 steps.
    "VLLM_KVGUARD_VERIFY_BUDGET": "32KiB",
    "VLLM_KVGUARD_SCRUB_INTERVAL": "0",
}


def _corrupt_mid_decode(llm: Any, pick: Callable[[list[int]], int]) -> tuple[str, Any, int]:
    """The prompt's 8 pages are cached by a first run (the clean text); a second request reads
    them while it decodes, and after 3 steps one of them is scrambled."""
    clean = llm.generate([LONG_PROMPT], greedy(32), use_tqdm=False)[0].outputs[0].text
    core, scheduler = llm.llm_engine, core_scheduler(llm)
    core.add_request("victim", LONG_PROMPT, greedy(32))
    for _ in range(3):
        core.step()
    (victim,) = [r.request_id for r in scheduler.running]
    block = pick(scheduler.kv_cache_manager.get_block_ids(victim)[0][:8])
    llm.collective_rpc(scramble, args=(block,))
    return clean, run_to_end(core)["victim"], block


def _just_verified(llm: Any) -> Callable[[list[int]], int]:
    """The page the sampled verification checked last: the longest wait for the next check."""
    from vllm_kvguard.connector import find_guard

    def pick(blocks: list[int]) -> int:
        guard = find_guard(core_scheduler(llm).connector)
        assert guard is not None and guard.scheduler is not None
        steps = guard.scheduler.ledger.verified_step
        return max(blocks, key=lambda b: int(steps[b]))

    return pick


def test_control_a_page_scrambled_mid_decode_changes_the_text(tiny_model: str) -> None:
    with engine(tiny_model, OFF, num_gpu_blocks_override=64) as llm:
        clean, out, _ = _corrupt_mid_decode(llm, lambda blocks: blocks[5])
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text != clean


@pytest.mark.parametrize("suspect", ["fail", "flag"])
def test_tokens_emitted_from_a_page_corrupted_mid_decode_are_never_reported_healed(
    tiny_model: str, tmp_path: Path, suspect: str
) -> None:
    """Sampled verification catches the page some steps later; the tokens sampled meanwhile
    came from it. Default: the request fails, naming the block; with VLLM_KVGUARD_SUSPECT=flag
    it finishes flagged. Never ``healed`` (recomputing cannot take emitted tokens back)."""
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, **INPROC, **SAMPLED, VLLM_KVGUARD_SUSPECT=suspect)
    with engine(tiny_model, env, num_gpu_blocks_override=64) as llm:
        clean, out, block = _corrupt_mid_decode(llm, _just_verified(llm))
        assert llm.generate([LONG_PROMPT], greedy(32), use_tqdm=False)[0].outputs[0].text == clean
        affected_metric = metric(llm, "vllm:kvguard_requests_affected", outcome=_outcome(suspect))
    c = out.outputs[0]
    (line,) = events(log, "kv_block_corrupted")
    assert line["block_id"] == block and line["trigger"] == "sampled"
    assert line["last_good_step"] < line["step"] - 1  # read unverified in between
    assert affected_once(log) == {"victim": _outcome(suspect)}
    assert affected_metric == 1
    assert str(c.stop_reason).startswith(f"KV-cache corruption: block {block} ")
    assert "unverified" in str(c.stop_reason)
    if suspect == "fail":
        assert c.finish_reason == "error"
    else:
        assert c.finish_reason == "length" and str(c.stop_reason).endswith("(suspect)")
    assert honest(out, clean)


def _outcome(suspect: str) -> str:
    return "failed" if suspect == "fail" else "suspect"


def test_paranoid_verification_heals_the_same_corruption(tiny_model: str, tmp_path: Path) -> None:
    """Verified before every read: caught before any token came from the page, recomputed, the
    text is the clean one, and the guard says ``healed``."""
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, **INPROC, VLLM_KVGUARD_VERIFY="paranoid")
    with engine(tiny_model, env, num_gpu_blocks_override=64) as llm:
        clean, out, block = _corrupt_mid_decode(llm, lambda blocks: blocks[5])
    (line,) = events(log, "kv_block_corrupted")
    assert line["block_id"] == block and line["last_good_step"] == line["step"] - 1
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text == clean
    assert out.outputs[0].stop_reason is None
    assert affected_once(log) == {"victim": "healed"}


# ------------------------------------------------------------ 2. full page taken while read


def _steal_a_full_page(llm: Any) -> dict[str, Any]:
    """A ref-count bug in the block pool: a *full* page of a running request (in its block
    table, read by every step) goes back to the free queue and is handed to a new request,
    which writes its own KV there."""
    core, scheduler = llm.llm_engine, core_scheduler(llm)
    core.add_request("victim", words(11, 3 * BLOCK + 8), greedy(40))
    for _ in range(4):  # prefill (2 chunks) + decode: 3 full pages sealed
        core.step()
    (victim,) = [r.request_id for r in scheduler.running]
    held = scheduler.kv_cache_manager.get_block_ids(victim)[0][1]
    steal_on_next_allocation(scheduler, held)
    core.add_request("thief", words(90, 2 * BLOCK), greedy(8))
    out = run_to_end(core)
    out["held"] = held
    return out


def test_control_a_full_page_taken_from_a_running_request_changes_its_text(tiny_model: str) -> None:
    with engine(tiny_model, OFF, num_gpu_blocks_override=64) as llm:
        clean = llm.generate([words(11, 3 * BLOCK + 8)], greedy(40), use_tqdm=False)[0].outputs[0].text
        llm.llm_engine.reset_prefix_cache()
        out = _steal_a_full_page(llm)
    assert out["victim"].outputs[0].finish_reason == "length"
    assert out["victim"].outputs[0].text != clean


def test_a_full_page_taken_from_a_running_request_fails_it(tiny_model: str, tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("quarantine", log, **INPROC), num_gpu_blocks_override=64) as llm:
        out = _steal_a_full_page(llm)
        # The engine keeps serving, and the thief's page is sealed as its own.
        assert llm.generate([words(5, 50)], greedy(4), use_tqdm=False)[0].outputs[0].text
    (line,) = events(log, "kv_block_lifecycle_violation")
    assert line["block_id"] == out["held"] and line["what"] == "allocated_while_held"
    assert line["holder_request_id"].startswith("victim") and line["request_id"].startswith("thief")
    victim = out["victim"].outputs[0]
    assert victim.finish_reason == "error" and "lifecycle violation" in str(victim.stop_reason)
    assert out["thief"].outputs[0].finish_reason == "length"
    assert affected_once(log) == {"victim": "failed"}
    assert events(log, "kvguard_internal_error") == []


# -------------------------------------------------- 3. raise mode: pages written from a bad page

PREFIX = words(23, 4 * BLOCK)
READERS = [f"{PREFIX} " + words(200 + 50 * i, 40) for i in range(2)]  # 4 shared pages + 40 tokens


def _two_readers_of_a_bad_page(llm: Any) -> tuple[list[Any], int]:
    """A caches the prefix; one of its pages is scrambled; two requests read it in one step,
    each writing a full page of its own from it in that step."""
    block = block_table_of(llm, f"{PREFIX} w398 w399")[1]
    llm.collective_rpc(scramble, args=(block, 7))
    return llm.generate(READERS, greedy(8), use_tqdm=False), block


def test_control_two_readers_of_a_bad_page_get_wrong_text(tiny_model: str) -> None:
    with engine(tiny_model, OFF, num_gpu_blocks_override=64) as llm:
        clean = [o.outputs[0].text for o in llm.generate(READERS, greedy(8), use_tqdm=False)]
        llm.llm_engine.reset_prefix_cache()
        outs, _ = _two_readers_of_a_bad_page(llm)
    assert [o.outputs[0].text for o in outs] != clean


def test_raise_mode_evicts_the_pages_every_failed_reader_wrote(tiny_model: str, tmp_path: Path) -> None:
    """vLLM's fail policy evicts only the first reader's later pages; the second reader's page,
    computed from the bad page in the same step, would stay cached and be served, intact and
    sealed, to the next request with that prompt."""
    with engine(tiny_model, OFF, num_gpu_blocks_override=64) as llm:
        clean = [o.outputs[0].text for o in llm.generate(READERS, greedy(8), use_tqdm=False)]
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("raise", log, **INPROC), num_gpu_blocks_override=64) as llm:
        outs, block = _two_readers_of_a_bad_page(llm)
        assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
        # The bad page is recomputed by the next request with the prefix...
        llm.generate([f"{PREFIX} w398 w399"], greedy(1), use_tqdm=False)
        # ...and each reader's prompt again gets the 4 prefix pages from the cache, not the
        # page it wrote from the bad one.
        again = [llm.generate([p], greedy(8), use_tqdm=False)[0] for p in READERS]
    assert [o.outputs[0].text for o in again] == clean
    assert [o.num_cached_tokens for o in again] == [4 * BLOCK, 4 * BLOCK]
    (line,) = events(log, "kv_block_corrupted")
    assert line["block_id"] == block and line["action"] == "requests_failed"
    assert sorted(affected_once(log).values()) == ["failed", "failed"]


# ----------------------------------------------------- 4. a failed request's NaN, next owner


def _nan_then_next_owner(llm: Any) -> tuple[Any, list[int], Any]:
    """A NaN page is read by B (its forward writes NaN into its own pages, the unfilled last
    one included); B's pages go back to the pool; C is given B's unfilled last page and writes
    fewer slots than B did. Returns (B's output, B's pages, C's output)."""
    scheduler = core_scheduler(llm)
    llm.collective_rpc(poison, args=(block_table_of(llm, f"{PREFIX} w398 w399")[1],))
    tables: dict[str, list[int]] = {}
    manager = scheduler.kv_cache_manager
    free = manager.free

    def recording_free(request: Any) -> None:
        tables[request.request_id.rsplit("-", 1)[0]] = list(manager.get_block_ids(request.request_id)[0])
        free(request)

    manager.free = recording_free
    core = llm.llm_engine
    core.add_request("b", f"{PREFIX} " + words(250, 60), greedy(4))
    b = run_to_end(core)["b"]
    manager.free = free
    b_pages = tables["b"]
    last = b_pages[-1]  # B's unfilled last page: 28 of its 32 slots written by B
    pool = scheduler.kv_cache_manager.block_pool
    allocate = pool.get_new_blocks

    def next_owner(num_blocks: int) -> list[Any]:
        # The free queue's order is vLLM's business: any freed block may come next.
        pool.get_new_blocks = allocate
        blk = pool.blocks[last]
        pool.free_block_queue.remove(blk)
        pool._maybe_evict_cached_block(blk)
        blk.ref_cnt += 1
        return [blk, *allocate(num_blocks - 1)]

    pool.get_new_blocks = next_owner
    core.add_request("c", C_PROMPT, greedy(4))
    return b, b_pages, run_to_end(core)["c"]


C_PROMPT = words(333, 10)


def test_control_nan_left_by_a_reader_poisons_the_next_owner(tiny_model: str) -> None:
    with engine(tiny_model, OFF, num_gpu_blocks_override=64) as llm:
        clean_c = llm.generate([C_PROMPT], greedy(4), use_tqdm=False)[0].outputs[0].text
        llm.llm_engine.reset_prefix_cache()
        _, _, c = _nan_then_next_owner(llm)
    assert c.outputs[0].text != clean_c


def test_a_failed_request_leaves_no_nan_for_the_next_owner(tiny_model: str, tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, OFF, num_gpu_blocks_override=64) as llm:
        clean_c = llm.generate([C_PROMPT], greedy(4), use_tqdm=False)[0].outputs[0].text
    with engine(tiny_model, guard_env("raise", log, **INPROC), num_gpu_blocks_override=64) as llm:
        b, b_pages, c = _nan_then_next_owner(llm)
        left = llm.collective_rpc(nonfinite_pages, args=(b_pages[2:],))[0]
    assert b.outputs[0].finish_reason == "error"
    assert c.outputs[0].text == clean_c and c.outputs[0].finish_reason == "length"
    # Every page B wrote from the bad one was zeroed before anyone else got it.
    assert left == []
    assert affected_once(log) == {"b": "failed"}


# ------------------------------------- 5. NaN from a bad prefix page, in a forward vLLM discards
# A storm at rest once failed a request that returned nothing from bad data: its hit of a cached
# page was found bad (reported unreadable: vLLM drops that step's output for it and recomputes),
# but the forward of that step, run anyway, had written a page of the request's own from the bad
# one (NaN attention: NaN keys and values in the next layer), and that page's kv_block_nonfinite,
# taken as tokens emitted from NaN, ended the request failed.

NAN_READER = f"{PREFIX} " + words(250, 60)  # 4 cached pages, then 60 tokens: one full page of its own


def _prefix_cached(llm: Any) -> list[int]:
    """The prefix's 4 pages in the prefix cache (A's prompt adds 2 tokens: no other page filled)."""
    return block_table_of(llm, f"{PREFIX} w398 w399")[:4]


def _nan_reader_clean(model: str) -> str:
    """The reader as the healed run computes it: the prefix's first page cached, the rest (its
    pages 1-3 and its own 60 tokens) computed in one step, then decoded alone. The healed run's
    recompute restarts at the bad page (page 1) with nothing else running: the same batches."""
    with engine(model, OFF, num_gpu_blocks_override=64) as llm:
        blocks = _prefix_cached(llm)
        core_scheduler(llm).kv_cache_manager.block_pool.evict_blocks(set(blocks[1:]))
        out = llm.generate([NAN_READER], greedy(8), use_tqdm=False)[0]
    assert out.num_cached_tokens == BLOCK
    return out.outputs[0].text


def test_control_a_nan_prefix_page_changes_the_readers_text(tiny_model: str) -> None:
    clean = _nan_reader_clean(tiny_model)
    with engine(tiny_model, OFF, num_gpu_blocks_override=64) as llm:
        blocks = _prefix_cached(llm)
        llm.collective_rpc(poison, args=(blocks[1],))
        out = llm.generate([NAN_READER], greedy(8), use_tqdm=False)[0]
    assert out.num_cached_tokens == 4 * BLOCK  # it read the NaN page
    assert out.outputs[0].text != clean


def test_nan_written_by_a_discarded_forward_does_not_fail_a_healed_request(
    tiny_model: str, tmp_path: Path
) -> None:
    clean = _nan_reader_clean(tiny_model)
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("quarantine", log, **INPROC), num_gpu_blocks_override=64) as llm:
        blocks = _prefix_cached(llm)
        llm.collective_rpc(poison, args=(blocks[1],))
        out = llm.generate([NAN_READER], greedy(8), use_tqdm=False)[0]
    # The bad page was found on the reader's hit, and the page the discarded forward wrote from
    # it was found non-finite in the same step: both findings are there...
    (bad,) = events(log, "kv_block_corrupted")
    assert bad["block_id"] == blocks[1] and bad["trigger"] == "reuse"
    (nan,) = events(log, "kv_block_nonfinite")
    assert nan["block_id"] not in blocks and nan["request_ids"] == bad["request_ids"]
    # ...and the request, which returned nothing computed from either, is healed, once.
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == clean
    assert list(affected_once(log).values()) == ["healed"]
