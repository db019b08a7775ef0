"""What full-page checksums cannot see, reproduced in a real engine with a guard-off control:

1. A page still being written is corrupted (its written slots). Without row digests the guard
   sealed the page at fill with the bad slots inside, and a later request's prefix hit on it
   got wrong text: the corruption was laundered into a sealed, reusable page.
2. A forward's KV write never lands (the slot mapping sends it nowhere, as a stale mapping or
   a dropped transfer would): the page keeps its previous owner's rows.

Each workload runs with the guard off first (the fault must change the output), then with
the guard on; every request's text is the clean one, or it ended with an error, or it was
flagged, and the log and metrics say which, once per request.
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
    core_scheduler,
    engine,
    events,
    greedy,
    guard_env,
    honest,
    kv_layers,
    metric,
    run_to_end,
    words,
)
from vllm_kvguard import KVCacheCorruptionError

pytestmark = pytest.mark.engine
WRITTEN = 14  # slots of the unfilled page written by the prompt
PROMPT = words(11, 3 * BLOCK + WRITTEN, step=13)


def corrupt_written_slots(worker: Any, block: int, slots: int) -> None:
    """Negate and scale the values of the first ``slots`` slots of one page in every layer (a
    stray write, a bit-flipping DIMM under a page still being written). The slots are found
    the way the guard finds them: by probing vLLM's own CPU write op."""
    from vllm_kvguard.connector.layout import cpu_isa, cpu_slot_elements

    for t in kv_layers(worker):
        page_shape = tuple(t.shape[1:])
        isa = cpu_isa("", t.dtype, BLOCK, page_shape[-1] // 2)
        elements = cpu_slot_elements(page_shape, t.dtype, BLOCK, isa)[:slots].reshape(-1)
        flat = t[block].view(-1)
        flat[elements] = flat[elements] * -3 + 1


# ------------------------------------------------------------------ 1. an unfilled page


def _laundering(llm: Any) -> dict[str, Any]:
    """V's unfilled last page is corrupted right after its prompt is written; V decodes on and
    fills it. W's prompt then shares that page's tokens (V's prompt and what V generated), so
    W gets a prefix hit on it. The clean texts: V and W with an empty prefix cache."""
    # V must write past its page's end whatever the fault does to its tokens: a random model's
    # EOS comes early or late depending on the CPU's kernels (on one machine the corrupted V
    # stopped one token short of filling the page).
    fill = greedy(40, ignore_eos=True)
    clean_v = llm.generate([PROMPT], fill, use_tqdm=False)[0].outputs[0].text
    llm.reset_prefix_cache()
    core, scheduler = llm.llm_engine, core_scheduler(llm)
    core.add_request("v", PROMPT, fill)
    while not scheduler.running or scheduler.running[0].num_computed_tokens < len(PROMPT.split()):
        core.step()
    (v,) = scheduler.running
    block = scheduler.kv_cache_manager.get_block_ids(v.request_id)[0][3]
    llm.collective_rpc(corrupt_written_slots, args=(block, WRITTEN))
    from vllm_kvguard.connector import find_guard

    guard = find_guard(scheduler.connector) if scheduler.connector is not None else None
    corrupted_after = guard.scheduler.ledger.step if guard is not None and guard.scheduler else None
    out_v = run_to_end(core)["v"]
    generated = list(out_v.outputs[0].token_ids)
    prompt_w = {"prompt_token_ids": list(v.prompt_token_ids) + generated[: BLOCK - WRITTEN] + [7, 8, 9]}
    hits_before = metric(llm, "vllm:prefix_cache_hits")
    out_w = llm.generate([prompt_w], greedy(16), use_tqdm=False)[0]
    hits = metric(llm, "vllm:prefix_cache_hits") - hits_before
    llm.reset_prefix_cache()
    clean_w = llm.generate([prompt_w], greedy(16), use_tqdm=False)[0].outputs[0].text
    return {
        "block": block,
        "clean_v": clean_v,
        "v": out_v,
        "clean_w": clean_w,
        "w": out_w,
        "w_hits": hits,
        "filled": len(generated) >= BLOCK - WRITTEN,
        "corrupted_after": corrupted_after,
    }


def test_control_a_corrupted_unfilled_page_is_laundered_into_a_reused_page(tiny_model: str) -> None:
    with engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}) as llm:
        r = _laundering(llm)
    assert r["filled"] and r["w_hits"] >= 4 * BLOCK, "W must hit the page V filled"
    assert r["v"].outputs[0].text != r["clean_v"], "the fault must change V's text"
    assert r["w"].outputs[0].text != r["clean_w"], "and W's, through the page it reuses"


@pytest.mark.parametrize(
    ("mode", "verify"),
    [
        ("quarantine", "paranoid"),
        ("quarantine", "sampled"),
        ("quarantine", "reuse"),
        ("quarantine", "scrub"),
        ("log", "reuse"),
    ],
)
def test_unfilled_page_corruption_is_caught_before_the_page_is_sealed_or_reused(
    tiny_model: str, tmp_path: Path, mode: str, verify: str
) -> None:
    log = tmp_path / "guard.jsonl"
    if verify == "scrub":
        # Nothing verifies reads; the scrubber earns credit for every page (sealed and being
        # written) each step (an interval far below a step's length) and walks them all.
        extra = {"VLLM_KVGUARD_VERIFY": "reuse", "VLLM_KVGUARD_SCRUB_INTERVAL": "0.01s"}
        extra["VLLM_KVGUARD_SCRUB_BUDGET"] = "4MiB"
    else:
        extra = {"VLLM_KVGUARD_VERIFY": verify, "VLLM_KVGUARD_SCRUB_INTERVAL": "0"}
    env = {**guard_env(mode, log, **extra), **INPROC}
    with engine(tiny_model, env) as llm:
        r = _laundering(llm)
        counted = metric(llm, "vllm:kvguard_corruptions_detected", kind="checksum_mismatch")
    found = [e for e in events(log, "kv_block_corrupted") if e["block_id"] == r["block"]]
    assert found, "the corrupted unfilled page is reported"
    first = found[0]
    assert first["shape"] == "unfilled_rows" and first["where"]["slots"] == list(range(WRITTEN))
    assert first["layer"] == "all" and counted >= 1
    # Its writer rewrites it as it recomputes: evicted, not quarantined.
    assert first["action"] in ("recomputed", "requests_failed", "logged")
    assert not events(log, "kv_block_quarantined") and not events(log, "kv_block_lifecycle_violation")
    assert honest(r["v"], r["clean_v"]) and honest(r["w"], r["clean_w"])
    outcomes = affected_once(log)
    if verify == "paranoid":
        # Verified before every forward that reads it: caught before any token came from it,
        # recomputed, the clean text, and the guard says healed.
        assert first["trigger"] == "paranoid" and first["step"] == r["corrupted_after"] + 1
        assert r["v"].outputs[0].text == r["clean_v"] and outcomes["v"] == "healed"
    elif verify == "reuse":
        # Not verified while written: caught at fill, never sealed; V read the changed rows.
        assert first["trigger"] == "seal"
        assert outcomes["v"] == ("failed" if mode == "quarantine" else "suspect")
    elif verify == "scrub":
        assert first["trigger"] == "scrub" and outcomes["v"] in ("healed", "failed")
    else:
        assert first["trigger"] in ("sampled", "seal")
        assert outcomes["v"] in ("healed", "failed")
        if outcomes["v"] == "healed":
            assert r["v"].outputs[0].text == r["clean_v"]
    if mode == "log":
        # Kept in the prefix cache (log mode changes nothing) but never sealed: W's hit on it
        # is reported and W is flagged.
        assert r["w_hits"] >= 4 * BLOCK
        assert [o for rid, o in outcomes.items() if rid != "v"] == ["suspect"]  # W (generate's own id)
        assert str(r["w"].outputs[0].stop_reason).startswith(KVCacheCorruptionError.PREFIX)
    else:
        # Out of the prefix cache: W recomputes it and its text is the clean one.
        assert r["w"].outputs[0].text == r["clean_w"] and set(outcomes) == {"v"}


# ------------------------------------------------------------------------ 2. lost writes

LOST = {"num_gpu_blocks_override": 8, "max_model_len": 192}
FIRST = words(5, 5 * BLOCK, step=3)  # fills the small pool; its blocks are freed, kept cached
SECOND = words(301, 4 * BLOCK + 10, step=17)  # chunked: the first 96 tokens emit nothing


def drop_writes_into(blocks: set[int], *, beneath_guard: bool = False) -> Callable[[bool], None]:
    """Wrap vLLM's CPU KV write op: while armed, writes into ``blocks`` get slot -1 (vLLM's
    padding slot: not written). Returns the switch. ``beneath_guard``: the op the guard's
    wrapper calls is the one replaced, so the guard sees the rows it was asked to write, to
    the slots they were meant for (a write op that fails silently); else the slot mapping is
    wrong before anything sees it (a stale mapping)."""
    import torch
    from vllm import _custom_ops as ops

    if beneath_guard:
        wrapper = ops.cpu_attn_reshape_and_cache
        assert getattr(wrapper, "_kvguard", False), "the guard observes vLLM's CPU write op"
        owner: Any = wrapper
        name = "_kvguard_original"
    else:
        owner, name = ops, "cpu_attn_reshape_and_cache"
    original = getattr(owner, name)
    state = {"armed": False, "dropped": 0}
    ids = torch.tensor(sorted(blocks), dtype=torch.int64)

    def dropping(
        key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any, *a: Any, **k: Any
    ) -> Any:
        if state["armed"]:
            hit = torch.isin(torch.div(slot_mapping, BLOCK, rounding_mode="floor"), ids)
            if bool(hit.any()):
                slot_mapping = slot_mapping.clone()
                slot_mapping[hit] = -1
                state["dropped"] += int(hit.sum())
        return original(key, value, key_cache, value_cache, slot_mapping, *a, **k)

    setattr(owner, name, dropping)

    def switch(on: bool) -> None:
        state["armed"] = on

    switch.state = state  # type: ignore[attr-defined]
    switch.restore = lambda: setattr(owner, name, original)  # type: ignore[attr-defined]
    return switch


def _lost_write(llm: Any, *, beneath_guard: bool = False, worker: Any = None) -> dict[str, Any]:
    from tests.engine.harness import block_table_of

    clean = llm.generate([SECOND], greedy(16), use_tqdm=False)[0].outputs[0].text
    llm.reset_prefix_cache()
    first_blocks = set(block_table_of(llm, FIRST))
    switch = drop_writes_into(first_blocks, beneath_guard=beneath_guard)
    try:
        core = llm.llm_engine
        core.add_request("second", SECOND, greedy(16))
        switch(True)
        before = worker.rows_as_written if worker is not None else 0
        core.step()  # the first prefill chunk: its writes into FIRST's old blocks are dropped
        chunk_as_written = (worker.rows_as_written - before) if worker is not None else 0
        switch(False)
        out = run_to_end(core)["second"]
    finally:
        switch.restore()  # type: ignore[attr-defined]
    dropped = switch.state["dropped"]  # type: ignore[attr-defined]
    return {"clean": clean, "out": out, "dropped": dropped, "chunk_as_written": chunk_as_written}


def test_control_a_write_that_never_lands_changes_the_text(tiny_model: str) -> None:
    with engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, **LOST) as llm:
        r = _lost_write(llm)
    assert r["dropped"] > 0, "the first chunk must write into blocks FIRST left behind"
    assert r["out"].outputs[0].text != r["clean"], "the lost write must change the text"


@pytest.mark.parametrize("mode", ["quarantine", "raise", "log"])
def test_a_write_that_never_landed_is_reported_and_recomputed(
    tiny_model: str, tmp_path: Path, mode: str
) -> None:
    log = tmp_path / "guard.jsonl"
    env = {**guard_env(mode, log, VLLM_KVGUARD_VERIFY="reuse", VLLM_KVGUARD_SCRUB_INTERVAL="0"), **INPROC}
    with engine(tiny_model, env, **LOST) as llm:
        r = _lost_write(llm)
        counted = metric(llm, "vllm:kvguard_corruptions_detected", kind="write_lost")
    assert r["dropped"] > 0
    found = events(log, "kv_block_write_lost")
    assert found and counted == len(found)
    assert all(line["request_ids"] and line["request_ids"][0].startswith("second") for line in found)
    assert all(line["slots"] for line in found)
    out, clean = r["out"].outputs[0], r["clean"]
    assert honest(r["out"], clean)
    outcomes = affected_once(log)
    if mode == "quarantine":
        # Found after the chunk that emitted nothing: recomputed next step, the clean text.
        assert found[0]["action"] == "recomputed"
        assert out.text == clean and outcomes == {"second": "healed"}
    elif mode == "raise":
        assert out.finish_reason == "error" and outcomes == {"second": "failed"}
    else:
        assert out.text != clean and outcomes == {"second": "suspect"}
        assert str(out.stop_reason).startswith(KVCacheCorruptionError.PREFIX)


def _worker() -> Any:
    """This process's guard worker (the engine runs in-process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_kvguard.connector import find_guard

    guard = find_guard(get_kv_transfer_group())
    assert guard is not None and guard.worker is not None
    return guard.worker


# A first chunk that ends inside a page: 80 tokens, two full pages and 16 rows of a third.
PARTIAL_CHUNK = {**LOST, "max_num_batched_tokens": 80}


def test_control_a_write_lost_in_a_chunk_ending_mid_page_changes_the_text(tiny_model: str) -> None:
    with engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, **PARTIAL_CHUNK) as llm:
        r = _lost_write(llm)
    assert r["dropped"] > 0
    assert r["out"].outputs[0].text != r["clean"], "the lost write must change the text"


def test_a_write_op_that_fails_under_the_guard_is_caught_by_the_landing_check(
    tiny_model: str, tmp_path: Path
) -> None:
    """The guard digests the rows vLLM's write op is handed (not read back out of the packed
    pages) and checks that they landed. Here the op itself drops the writes while the guard
    sees the right rows for the right slots: for the 16 rows of the page the chunk leaves
    unfilled (not sealed this step, so not hashed from the page by the seal) only the landing
    check can tell. Quarantine: found, recomputed, the clean text. Control: the test above."""
    log = tmp_path / "guard.jsonl"
    env = {
        **guard_env("quarantine", log, VLLM_KVGUARD_VERIFY="reuse", VLLM_KVGUARD_SCRUB_INTERVAL="0"),
        **INPROC,
    }
    with engine(tiny_model, env, **PARTIAL_CHUNK) as llm:
        worker = _worker()
        (started,) = [e for e in events(log, "kvguard_started") if e.get("role") == "worker"]
        how = str(started["details"]["row_digests"])
        as_written = worker.written is not None
        if as_written:
            # Rows digested as written, kept in one compiled call that reads the landing probes
            # by address; the seal's fill check reads the rows of its copy of the pages in place.
            assert worker.rows.host.land is not None and worker.rows.host.copy_plan is not None
        else:
            # vLLM's AMX layout packs K and V two slots to a word: no contiguous run to probe,
            # so rows are read back out of the pages after the forward (the start-up line says
            # so), where the dropped writes read as the previous owner's rows. The guard does
            # not wrap the write op there: the op itself drops them.
            assert "CPU layout amx" in how and "digested as written" not in how, how
        r = _lost_write(llm, beneath_guard=as_written, worker=worker)
    assert r["dropped"] > 0
    # Every row of the chunk (the 16 of the unfilled page and the 64 of the pages being sealed)
    # went through the written-rows path, and the landing check found them not landed; or, on
    # AMX, none did and the rows read back found them.
    assert r["chunk_as_written"] == (80 if as_written else 0), how
    found = events(log, "kv_block_write_lost")
    assert found and all(line["request_ids"][0].startswith("second") for line in found)
    assert any(line["slots"] == list(range(16)) for line in found), found
    assert found[0]["action"] == "recomputed"
    assert r["out"].outputs[0].text == r["clean"] and affected_once(log) == {"second": "healed"}
