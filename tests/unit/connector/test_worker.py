"""The worker side on its own: seal after the forward, verify before the read, report bad blocks.

No engine here (tests/engine has those): the role object is driven in vLLM's call order
with the metadata the scheduler side would send, over a CPU KV tensor in vLLM's CPU
layout, to pin down what the worker does with each part of the plan.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from vllm_kvguard.config import load_config
from vllm_kvguard.connector.metadata import KVGuardMetadata
from vllm_kvguard.connector.worker import KVGuardWorker
from vllm_kvguard.core.plan import StepPlan
from vllm_kvguard.digest import rowhash
from vllm_kvguard.digest.rows import row_digests_reference
from vllm_kvguard.logs import GuardLog

BLOCKS = 6


def _worker(**env: str) -> tuple[KVGuardWorker, torch.Tensor]:
    config = load_config({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_SCRUB_INTERVAL": "0", **env})
    worker = KVGuardWorker(config, BLOCKS, rank=0, log=GuardLog(config, role="worker", rank=0))
    # vLLM's CPU layout: (num_blocks, kv_heads, 2 * block_size, head_size).
    kv = torch.randn(BLOCKS, 2, 2 * 32, 64).to(torch.bfloat16)
    worker.register_kv_caches({"model.layers.0.self_attn.attn": kv})
    return worker, kv


def _step(worker: KVGuardWorker, meta: KVGuardMetadata) -> tuple[set[int], object]:
    worker.bind_connector_metadata(meta)
    worker.wait_for_layer_load("model.layers.0.self_attn.attn")
    worker.wait_for_save()
    bad = worker.get_block_ids_with_load_errors()
    out = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return bad, out


def test_sealed_page_that_changed_is_reported_on_reuse() -> None:
    worker, kv = _worker(VLLM_KVGUARD_REPAIR="0")
    bad, _ = _step(worker, KVGuardMetadata(StepPlan(1, seal=[2, 3])))
    assert bad == set() and worker.table is not None and worker.table.sealed[[2, 3]].all()
    kv[3].view(torch.uint8).view(-1)[17] ^= 0x10
    bad, out = _step(worker, KVGuardMetadata(StepPlan(2, verify=[2, 3], readers={3: ["req-b"]})))
    assert bad == {3}
    [d] = out.detections  # type: ignore[attr-defined]
    assert (d.block_id, d.readers, d.trigger, d.step) == (3, ("req-b",), "reuse", 2)
    # Its readers recompute it: the old seal means nothing now.
    assert not worker.table.sealed[3] and worker.table.sealed[2]


def test_read_verification_covers_pages_running_requests_read() -> None:
    worker, kv = _worker(VLLM_KVGUARD_VERIFY="paranoid", VLLM_KVGUARD_REPAIR="0")
    _step(worker, KVGuardMetadata(StepPlan(1, seal=[1, 4])))
    kv[4, 1, 5, 7] = -kv[4, 1, 5, 7] - 1
    meta = KVGuardMetadata(StepPlan(2, read_verify=[1, 4]), read_trigger="paranoid")
    bad, out = _step(worker, meta)
    assert bad == {4}
    assert [(d.block_id, d.trigger) for d in out.detections] == [(4, "paranoid")]  # type: ignore[attr-defined]


def test_log_mode_reports_nothing_to_vllm() -> None:
    worker, kv = _worker(VLLM_KVGUARD_MODE="log")
    _step(worker, KVGuardMetadata(StepPlan(1, seal=[0])))
    kv[0].zero_()
    bad, out = _step(worker, KVGuardMetadata(StepPlan(2, verify=[0])))
    assert bad == set() and len(out.detections) == 1  # type: ignore[attr-defined]


def test_nan_written_into_a_page_as_it_is_sealed_is_flagged_and_zeroed() -> None:
    worker, kv = _worker()
    kv[5, 0, 3, 3] = float("nan")
    _, out = _step(worker, KVGuardMetadata(StepPlan(1, seal=[5])))
    assert [(d.block_id, d.kind) for d in out.detections] == [(5, "nonfinite")]  # type: ignore[attr-defined]
    assert torch.isfinite(kv[5]).all()


def test_a_hook_without_new_metadata_does_not_replay_the_last_step() -> None:
    worker, kv = _worker()
    _step(worker, KVGuardMetadata(StepPlan(1, seal=[2])))
    sealed_digest = int(worker.table.digests[2, 0])  # type: ignore[union-attr]
    kv[2].zero_()
    worker.wait_for_save()  # vLLM cleared the metadata: nothing to seal again
    assert int(worker.table.digests[2, 0]) == sealed_digest  # type: ignore[union-attr]


def test_internal_error_is_forwarded_to_the_scheduler_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    worker, _ = _worker()
    with caplog.at_level(logging.ERROR, logger="vllm.kvguard"):
        worker.internal_error("wait_for_save", RuntimeError("boom"))
    out = worker.build_connector_worker_meta()
    assert out is not None and out.internal_errors == ["wait_for_save: RuntimeError('boom')"]
    assert "kvguard_internal_error" in caplog.text


def test_single_bit_flip_is_located_and_repaired_before_the_read() -> None:
    worker, kv = _worker()
    _step(worker, KVGuardMetadata(StepPlan(1, seal=[2, 3])))
    clean = kv[3].clone()
    kv[3].view(torch.uint8).view(-1)[17] ^= 0x10  # byte 17: word 2, bit 1 * 8 + 4
    bad, out = _step(worker, KVGuardMetadata(StepPlan(2, verify=[2, 3], readers={3: ["req-b"]})))
    assert bad == set()  # nothing to recompute: the page is mended
    [d] = out.detections  # type: ignore[attr-defined]
    assert (d.shape, d.repaired) == ("single_bit", True)
    assert d.where["word"] == 2 and d.where["bits"] == [12] and d.where["flipped_bits"] == f"{1 << 12:016x}"
    assert d.where["element"] == [0, 0, 8]  # bf16: byte 17 is element 8 of row 0 of head 0
    assert torch.equal(kv[3].view(torch.int16), clean.view(torch.int16))
    assert worker.table is not None and worker.table.sealed[3]  # still sealed, still right
    bad, out = _step(worker, KVGuardMetadata(StepPlan(3, verify=[3])))
    assert bad == set() and (out is None or not out.detections)  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_no_repair_outside_quarantine_mode(mode: str) -> None:
    worker, kv = _worker(VLLM_KVGUARD_MODE=mode)
    _step(worker, KVGuardMetadata(StepPlan(1, seal=[3])))
    kv[3].view(torch.uint8).view(-1)[100] ^= 0x01
    bad, out = _step(worker, KVGuardMetadata(StepPlan(2, verify=[3])))
    [d] = out.detections  # type: ignore[attr-defined]
    assert (d.shape, d.repaired) == ("single_bit", False) and d.where["word"] == 12
    assert bad == (set() if mode == "log" else {3})


def _seal_and(worker_kv: tuple[KVGuardWorker, torch.Tensor], change) -> object:
    worker, kv = worker_kv
    _step(worker, KVGuardMetadata(StepPlan(1, seal=[1, 2, 3])))
    change(kv)
    _, out = _step(worker, KVGuardMetadata(StepPlan(2, verify=[3])))
    [d] = out.detections  # type: ignore[attr-defined]
    return d


def test_shapes_of_whole_page_changes() -> None:
    def words(kv: torch.Tensor) -> None:
        kv[3].view(torch.uint8).view(-1)[[5, 300, 4000]] ^= 0x04

    d = _seal_and(_worker(), words)
    assert (d.shape, d.repaired) == ("multi_word", False)  # type: ignore[attr-defined]
    d = _seal_and(_worker(), lambda kv: kv[3].zero_())
    assert d.shape == "zeroed"  # type: ignore[attr-defined]
    d = _seal_and(_worker(), lambda kv: kv[3].copy_(kv[1]))
    assert d.shape == "copy_of_block" and d.where["source_block"] == 1  # type: ignore[attr-defined]
    d = _seal_and(_worker(), lambda kv: kv[3].view(-1).__setitem__(9, float("nan")))
    assert d.shape == "nonfinite"  # type: ignore[attr-defined]


def test_a_page_that_reverts_to_its_previous_seal_is_stale() -> None:
    worker, kv = _worker()
    _step(worker, KVGuardMetadata(StepPlan(1, seal=[3])))
    old = kv[3].clone()
    # The block is freed and written again by its next owner, then sealed...
    _step(worker, KVGuardMetadata(StepPlan(2, forget=[3])))
    kv[3] = torch.randn_like(kv[3].float()).to(kv.dtype)
    _step(worker, KVGuardMetadata(StepPlan(3, seal=[3])))
    # ...and a lost write (a stale copy landing late) puts the old generation back.
    kv[3] = old
    _, out = _step(worker, KVGuardMetadata(StepPlan(4, verify=[3])))
    [d] = out.detections  # type: ignore[attr-defined]
    assert d.shape == "stale"


def test_a_bit_flip_in_a_sealed_all_zero_page_is_located_too() -> None:
    """An all-zero page has an all-zero syndrome, which is still a syndrome."""
    worker, kv = _worker()
    kv[4].zero_()
    _step(worker, KVGuardMetadata(StepPlan(1, seal=[4])))
    kv[4].view(torch.uint8).view(-1)[4099] ^= 0x02
    bad, out = _step(worker, KVGuardMetadata(StepPlan(2, verify=[4])))
    [d] = out.detections  # type: ignore[attr-defined]
    assert (d.shape, d.repaired, d.where["word"]) == ("single_bit", True, 512) and bad == set()
    assert not kv[4].view(torch.uint8).any()


def _rows_worker() -> tuple[KVGuardWorker, torch.Tensor]:
    """A worker with row digests on: vLLM's CPU page (kv_heads, block_size, 2 x head_size)."""
    config = load_config({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_SCRUB_INTERVAL": "0"})
    worker = KVGuardWorker(config, BLOCKS, rank=0, log=GuardLog(config, role="worker", rank=0), block_size=16)
    kv = torch.randn(BLOCKS, 1, 16, 2 * 32).to(torch.bfloat16)
    worker.register_kv_caches({"model.layers.0.self_attn.attn": kv})
    assert worker.rows is not None and worker.rows.host is not None
    return worker, kv


def _written(step: int, block: int, slots: list[int], seal: list[int]) -> KVGuardMetadata:
    plan = StepPlan(step, seal=seal)
    plan.written_blocks = np.full(len(slots), block, dtype=np.int64)
    plan.written_slots = np.asarray(slots, dtype=np.int64)
    return KVGuardMetadata(plan)


@pytest.mark.parametrize("nan_slot", [1, 15])
def test_nan_in_a_page_is_found_on_its_row_gathers_without_another_pass(
    nan_slot: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, kv = _rows_worker()
    assert worker.pages is not None and worker.rows is not None and worker.rows.host is not None
    slot_elements = worker.rows.host.elements
    _step(worker, _written(1, 2, list(range(14)), []))
    # Slot 1's NaN is in a row recorded a step before the seal (re-hashed by the fill check); slot
    # 15's in a row written by the sealing step itself (hashed by its record).
    kv[2].view(-1)[int(slot_elements[nan_slot][5])] = float("nan")
    if nan_slot == 1:
        worker.rows.rows[2, 1] = worker.rows.hash(np.array([2]), np.array([1]))[0]  # as if written so
    calls: list[object] = []
    monkeypatch.setattr(worker.pages, "nonfinite", lambda blocks: calls.append(blocks))
    _, out = _step(worker, _written(2, 2, [14, 15], [2]))
    assert [(d.block_id, d.kind) for d in out.detections] == [(2, "nonfinite")]  # type: ignore[attr-defined]
    assert calls == [] and torch.isfinite(kv[2]).all()  # every slot's row was tested: no page pass


def test_a_page_with_rows_never_recorded_is_tested_at_the_seal() -> None:
    worker, kv = _rows_worker()
    _step(worker, _written(1, 4, list(range(13)), []))  # slots 13, 14: no row digest (drafts)
    kv[4].view(-1)[int(worker.rows.host.elements[13][0])] = float("nan")  # type: ignore[union-attr]
    _, out = _step(worker, _written(2, 4, [15], [4]))
    assert [(d.block_id, d.kind) for d in out.detections] == [(4, "nonfinite")]  # type: ignore[attr-defined]
    assert torch.isfinite(kv[4]).all()


def _write(worker: KVGuardWorker, kv: torch.Tensor, block: int, slots: list[int], seed: int) -> None:
    """What a forward does to the KV cache: vLLM's own CPU write op, as the attention calls it
    (through the guard's wrapper, which keeps the rows it is handed)."""
    from vllm import _custom_ops as ops

    from vllm_kvguard.connector.layout import cpu_isa

    gen = torch.Generator().manual_seed(seed)
    key = torch.randn((len(slots), 1, 32), generator=gen).to(torch.bfloat16)
    value = torch.randn((len(slots), 1, 32), generator=gen).to(torch.bfloat16)
    key_cache, value_cache = kv.view(BLOCKS, 1, 32, 32).chunk(2, dim=2)
    mapping = torch.tensor([block * 16 + s for s in slots], dtype=torch.int64)
    isa = cpu_isa("", kv.dtype, 16, 32)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, mapping, isa)


def _forward_step(worker: KVGuardWorker, kv: torch.Tensor, meta: KVGuardMetadata, seed: int) -> object:
    plan = meta.plan
    worker.bind_connector_metadata(meta)
    _write(worker, kv, int(plan.written_blocks[0]), plan.written_slots.tolist(), seed)
    worker.wait_for_layer_load("model.layers.0.self_attn.attn")
    worker.wait_for_save()
    out = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return out


def test_rows_are_digested_as_written_and_equal_the_rows_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    worker, kv = _rows_worker()
    assert worker.written is not None and worker.rows is not None and worker.rows.host is not None

    def numpy_landing(*args: object) -> None:
        raise AssertionError("the usual step keeps its rows in one compiled call")

    monkeypatch.setattr(worker.rows.host, "landed", numpy_landing)
    _forward_step(worker, kv, _written(1, 2, [0, 1, 2], []), seed=1)
    assert worker.rows_as_written == 3
    # The same digests as the rows gathered back out of the page.
    assert (worker.rows.rows[2, :3] == worker.rows.hash(np.array([2, 2, 2]), np.array([0, 1, 2]))).all()
    # The rows of a page being sealed too (its seal, syndromes and NaN/Inf test read the page).
    _forward_step(worker, kv, _written(2, 3, list(range(16)), [3]), seed=2)
    assert worker.rows_as_written == 3 + 16 and worker.table is not None and worker.table.sealed[3]
    assert (worker.rows.rows[3] == worker.rows.hash(np.full(16, 3), np.arange(16))).all()


def test_rows_written_in_another_order_than_planned_are_kept_as_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's CPU runner writes decodes before prefills; the plan lists its views first. The same
    rows in another order still take the one compiled call (no numpy landing check, no search),
    keep the page's digests, and a row that did not land is reported at its own slot."""
    from vllm import _custom_ops as ops

    worker, kv = _rows_worker()
    assert worker.rows is not None and worker.rows.host is not None

    def numpy_landing(*args: object) -> None:
        raise AssertionError("rows written in another order keep their rows in one compiled call")

    monkeypatch.setattr(worker.rows.host, "landed", numpy_landing)
    monkeypatch.setattr(worker.written, "find", numpy_landing)
    meta = _written(1, 2, [4, 0, 7, 1], [])
    plan = meta.plan
    worker.bind_connector_metadata(meta)
    _write(worker, kv, 2, [0, 1, 4, 7], seed=1)  # the same rows, in the runner's order
    worker.wait_for_layer_load("model.layers.0.self_attn.attn")
    worker.wait_for_save()
    worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    assert worker.rows_as_written == 4
    assert (
        worker.rows.rows[2, [0, 1, 4, 7]] == worker.rows.hash(np.full(4, 2), np.array([0, 1, 4, 7]))
    ).all()
    # Block 2 to a new owner, which writes slots 7 and 0 (planned in that order, written 0 then
    # 7); the write of slot 7 goes nowhere: the new owner's slot 7 still holds the old row.
    monkeypatch.undo()
    worker.rows.roll([2])
    wrapper = ops.cpu_attn_reshape_and_cache
    original = wrapper._kvguard_original  # type: ignore[attr-defined]

    def write_but_slot_7(key, value, key_cache, value_cache, mapping, *args):  # type: ignore[no-untyped-def]
        keep = mapping != 2 * 16 + 7
        original(key[keep], value[keep], key_cache, value_cache, mapping[keep], *args)

    meta = _written(2, 2, [7, 0], [])
    meta.lost_write_rows = np.ones(2, dtype=bool)
    wrapper._kvguard_original = write_but_slot_7  # type: ignore[attr-defined]
    try:
        worker.bind_connector_metadata(meta)
        _write(worker, kv, 2, [0, 7], seed=2)
        worker.wait_for_layer_load("model.layers.0.self_attn.attn")
        worker.wait_for_save()
        out = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
    finally:
        wrapper._kvguard_original = original  # type: ignore[attr-defined]
    assert worker.rows_as_written == 6
    [d] = out.detections  # type: ignore[union-attr]
    assert (d.block_id, d.kind, d.where) == (2, "write_lost", {"slots": [7]})
    assert plan.written_slots.tolist() == [4, 0, 7, 1]


def test_a_write_that_did_not_land_under_the_wrapper_is_a_lost_write() -> None:
    from vllm import _custom_ops as ops

    worker, kv = _rows_worker()
    assert worker.rows is not None
    _forward_step(worker, kv, _written(1, 2, [0, 1], []), seed=1)
    worker.rows.roll([2])  # block 2 handed to a new owner
    wrapper = ops.cpu_attn_reshape_and_cache
    original = wrapper._kvguard_original  # type: ignore[attr-defined]
    # The op beneath the guard's wrapper writes nothing (the guard sees the rows and slots).
    wrapper._kvguard_original = lambda *a, **k: None  # type: ignore[attr-defined]
    try:
        meta = _written(2, 2, [0, 1], [])
        meta.lost_write_rows = np.ones(2, dtype=bool)
        out = _forward_step(worker, kv, meta, seed=2)
    finally:
        wrapper._kvguard_original = original  # type: ignore[attr-defined]
    assert worker.rows_as_written == 4  # both steps' rows went the written path...
    [d] = out.detections  # type: ignore[attr-defined]
    assert (d.block_id, d.kind, d.where) == (2, "write_lost", {"slots": [0, 1]})  # ...and did not land


def test_an_error_keeping_written_rows_is_internal_and_the_rows_are_read_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker, kv = _rows_worker()
    assert worker.written is not None and worker.rows is not None

    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(worker.written, "observe", broken)
    with caplog.at_level(logging.ERROR):
        out = _forward_step(worker, kv, _written(1, 2, [0, 1, 2], []), seed=1)
    assert worker.internal_errors == 1 and worker.rows_as_written == 0
    assert any("kv_write" in e for e in out.internal_errors)  # type: ignore[attr-defined]
    # The rows were recorded from the page all the same.
    assert (worker.rows.rows[2, :3] == worker.rows.hash(np.array([2, 2, 2]), np.array([0, 1, 2]))).all()


def test_without_numba_rows_are_read_back_and_the_start_up_line_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/design/decisions.md: where numba cannot be used, numpy computes the same digests and
    every row is read back out of its page after the forward; the worker's start-up line names
    the reason."""
    monkeypatch.setattr(rowhash, "_compiled", None)
    monkeypatch.setattr(rowhash, "_why_not", "ImportError: No module named 'numba'")
    with caplog.at_level(logging.INFO):
        worker, kv = _rows_worker()
    assert worker.written is None and worker.rows is not None
    assert any(
        "read back (row sums need numba: numpy (ImportError: No module named 'numba'))" in r.getMessage()
        for r in caplog.records
    )
    _forward_step(worker, kv, _written(1, 2, [0, 1, 2], []), seed=1)
    assert worker.rows_as_written == 0
    want = row_digests_reference(
        worker.rows.host.gather(np.array([2, 2, 2]), np.array([0, 1, 2])),
        [0, 1, 2],  # type: ignore[union-attr]
    )
    assert np.array_equal(worker.rows.rows[2, :3], want)


def test_the_written_rows_buffer_is_the_documented_size() -> None:
    """docs/performance.md, "Memory": 16 MiB (per row its sum and its slot, 8 bytes each, and
    its landing probe: 64 bytes a layer), or 256 rows where that is larger."""
    from vllm_kvguard.connector.layout import WrittenRows
    from vllm_kvguard.digest.row_access import HostRows

    one_line = np.array([[1, 0, 0, HostRows.PROBE_WORDS]])
    # kvguard bench's model: 4 layers: 272 bytes a row, 61,680 rows.
    bench = WrittenRows({}, 4, 2 * 8 * 64, torch.bfloat16, 16, one_line)
    assert (bench.capacity, bench.nbytes()) == (61680, 61680 * 272)
    # Llama-3-8B class: 32 layers: 2,064 bytes a row, 8,128 rows.
    llama = WrittenRows({}, 32, 2 * 8 * 128, torch.bfloat16, 16, one_line)
    assert (llama.capacity, llama.nbytes()) == (8128, 8128 * 2064)
    # Rows over 64 KiB: 256 rows all the same.
    huge = WrittenRows({}, 1100, 2 * 8 * 128, torch.bfloat16, 16, one_line)
    assert huge.capacity == 256


@pytest.mark.parametrize("in_place", [True, False])
def test_the_seal_checks_earlier_rows_as_it_reads_them_and_seals_only_unchanged_pages(in_place: bool) -> None:
    """Pages 1, 2, 3 fill over two steps and seal together: a row page 2 got in the first step
    changes before the seal (found as the seal reads the pages, in place in the pool or in its
    copy of them, located to its slot, page 2 not sealed), page 3 holds a NaN (flagged, zeroed,
    sealed with the digest of what it holds now), page 1 is sealed as it is."""
    worker, kv = _rows_worker()
    assert worker.rows is not None and worker.rows.host is not None and worker.table is not None
    assert worker.pages is not None and worker.pages.seals_host_pages and worker.pages.reads_in_place
    if not in_place:
        worker.pages._page_at = None  # (as where the pages are not 8-byte aligned)
    elements = worker.rows.host.elements

    def written(step: int, rows: list[tuple[int, int]], seal: list[int]) -> KVGuardMetadata:
        plan = StepPlan(step, seal=seal)
        plan.written_blocks = np.asarray([b for b, _ in rows], dtype=np.int64)
        plan.written_slots = np.asarray([s for _, s in rows], dtype=np.int64)
        return KVGuardMetadata(plan)

    _step(worker, written(1, [(b, s) for b in (1, 2, 3) for s in range(15)], []))
    kv[2].view(-1)[int(elements[6][9])] += 1.0
    kv[3].view(-1)[int(elements[15][2])] = float("nan")
    bad, out = _step(worker, written(2, [(1, 15), (2, 15), (3, 15)], [1, 2, 3]))
    found = sorted((d.block_id, d.kind, d.trigger) for d in out.detections)  # type: ignore[attr-defined]
    assert found == [(2, "partial_mismatch", "seal"), (3, "nonfinite", "seal")]
    [row] = [d for d in out.detections if d.block_id == 2]  # type: ignore[attr-defined]
    assert row.where == {"slots": [6], "rows_written": 15}
    assert bad == {2} and worker.table.sealed[[1, 3]].all() and not worker.table.sealed[2]
    assert torch.isfinite(kv[3]).all()
    assert (worker.table.digests[[1, 3]] == worker.pages.digest([1, 3])).all()
    assert (worker.pages._scratch is None) == in_place


@pytest.mark.parametrize("layout", ["qkv", "apart", "one_row"])
def test_written_rows_keep_key_then_value_whatever_the_tensors_memory(layout: str) -> None:
    """vLLM hands the write op K and V as column ranges of one QKV output (strided rows, V right
    after K); tests and other callers hand separate tensors. The rows kept are each row's key
    then value, whichever."""
    from vllm_kvguard.connector.layout import WrittenRows

    n = 1 if layout == "one_row" else 5
    qkv = torch.randn(n, 3 * 16).to(torch.bfloat16)
    _, k, v = qkv.split(16, dim=1)
    key, value = k.view(n, 2, 8), v.view(n, 2, 8)
    if layout == "apart":
        key, value = key.clone(), value.clone()
    # Probe: words 1..2 of V (elements 4..11).
    rows = WrittenRows({123: 1}, 2, 32, torch.bfloat16, 16, np.array([[1, 1, 0, 2]]))
    rows.begin()

    class Cache:  # the layer's key cache, as the write op's argument: only its address is read
        def data_ptr(self) -> int:
            return 123

    flat = torch.arange(n, dtype=torch.int64) * 7  # slots 0, 7, 14, 5, 12
    rows.observe(key, value, Cache(), flat)  # type: ignore[arg-type]
    want = torch.cat([key.reshape(n, -1), value.reshape(n, -1)], dim=1).view(torch.int16).numpy()
    words = want.view(np.uint64)  # layer 1: the row's words 8..15
    assert rows.seen == {1}
    assert np.array_equal(rows.sums[:n], rowhash._sums_numpy(words, flat.numpy() % 16, first_word=8))
    assert np.array_equal(rows.probe[:n, 1], words[:, 5:7]) and not rows.probe[:n, 0].any()
    # The same layer again in one step would count its words twice: the step's rows are not used.
    rows.observe(key, value, Cache(), flat)  # type: ignore[arg-type]
    assert rows.broken


@pytest.mark.parametrize("case", ["heads_apart", "unaligned", "other_dtype", "short", "int32_slots"])
def test_written_rows_are_read_only_where_the_compiled_loop_can_read_them(case: str) -> None:
    """The wrapper's compiled loop reads rows by address: it is handed only n rows of whole,
    aligned 64-bit words a row (K and V each). Anything else (heads not side by side, an
    address off an 8-byte boundary, another dtype, fewer rows than slots) leaves the tables
    untouched and the step's rows to be read back out of the pages; a slot mapping of another
    integer type is converted first."""
    from vllm_kvguard.connector.layout import WrittenRows

    n = 5
    qkv = torch.randn(n, 56).to(torch.bfloat16)  # rows of 112 bytes: whole words
    key, value = qkv[:, 16:32].reshape(n, 2, 8), qkv[:, 32:48].reshape(n, 2, 8)
    slots = torch.arange(n, dtype=torch.int64) * 3
    if case == "heads_apart":  # (n, 2, 8) whose heads interleave
        key = qkv[:, 16:32].reshape(n, 8, 2).transpose(1, 2)
    elif case == "unaligned":  # starts one bf16 element past a word
        key = qkv[:, 17:33].reshape(n, 2, 8)
    elif case == "other_dtype":
        key = key.to(torch.float16)
    elif case == "short":
        key = key[: n - 1]
    elif case == "int32_slots":
        slots = slots.to(torch.int32)
    rows = WrittenRows({123: 0}, 1, 32, torch.bfloat16, 16, np.array([[1, 1, 0, 2]]))

    class Cache:
        def data_ptr(self) -> int:
            return 123

    rows.begin()
    rows.observe(key, value, Cache(), slots)  # type: ignore[arg-type]
    if case != "int32_slots":
        assert rows.broken and not rows.sums[:n].any() and not rows.probe[:n].any()
        assert rows.find(np.zeros(n, dtype=np.int64), np.arange(n) * 3, 16) is None
        return
    words = torch.cat([key.reshape(n, -1), value.reshape(n, -1)], dim=1).view(torch.int16).numpy()
    assert not rows.broken and rows.slots is not None and rows.slots.tolist() == [0, 3, 6, 9, 12]
    want = rowhash._sums_numpy(words.view(np.uint64), np.arange(n) * 3)
    assert np.array_equal(rows.sums[:n], want)
    assert rows.find(np.zeros(n, dtype=np.int64), np.arange(n) * 3, 16) == (None, None)


@pytest.mark.parametrize("case", ["heads_apart", "unaligned", "other_dtype", "short", "on_meta"])
def test_a_layer_written_unlike_the_layer_before_it_is_checked_in_full(case: str) -> None:
    """The wrapper checks the rows' layout in full once, and compares the next layers' with it
    (shapes, strides, dtypes, host or not): a layer laid out otherwise, or at an address off an
    8-byte boundary with the same layout, is checked in full and refused; layers laid out
    alike give the sums of every layer's words."""
    from vllm_kvguard.connector.layout import WrittenRows

    n = 5
    qkv = torch.randn(2, n, 56).to(torch.bfloat16)  # two layers' QKV outputs
    good = [(qkv[i, :, 16:32].reshape(n, 2, 8), qkv[i, :, 32:48].reshape(n, 2, 8)) for i in range(2)]
    key, value = good[1]
    if case == "heads_apart":
        key = qkv[1, :, 16:32].reshape(n, 8, 2).transpose(1, 2)
    elif case == "unaligned":  # the same shape and strides, one element past a word
        key = qkv[1, :, 17:33].reshape(n, 2, 8)
    elif case == "other_dtype":
        key = key.to(torch.float16)
    elif case == "short":
        key = key[: n - 1]
    elif case == "on_meta":  # alike in every way but where it lives
        key = torch.empty_strided(key.shape, key.stride(), dtype=key.dtype, device="meta")

    class Cache:
        def __init__(self, at: int) -> None:
            self.at = at

        def data_ptr(self) -> int:
            return self.at

    slots = torch.arange(n, dtype=torch.int64) * 3
    rows = WrittenRows({10: 0, 20: 1}, 2, 32, torch.bfloat16, 16, np.array([[1, 1, 0, 2]]))
    rows.begin()
    rows.observe(*good[0], Cache(10), slots)  # type: ignore[arg-type]
    assert not rows.broken and rows.seen == {0}
    rows.observe(key, value, Cache(20), slots)  # type: ignore[arg-type]
    assert rows.broken and rows.seen == {0}
    rows.begin()  # the next step, laid out alike: every layer's rows kept
    for layer, (k, v) in enumerate(good):
        rows.observe(k, v, Cache(10 * (layer + 1)), slots)  # type: ignore[arg-type]
    assert not rows.broken and rows.complete()
    words = torch.cat([torch.cat([k.reshape(n, -1), v.reshape(n, -1)], dim=1) for k, v in good], dim=1)
    want = rowhash._sums_numpy(words.view(torch.int16).numpy().view(np.uint64), np.arange(n) * 3)
    assert np.array_equal(rows.sums[:n], want)


@pytest.mark.parametrize(("heads", "head", "block_size"), [(1, 32, 16), (2, 64, 16), (4, 128, 32)])
def test_the_fill_check_reads_vllms_cpu_pages_in_place_with_the_digests_of_the_rows_copied_out(
    heads: int, head: int, block_size: int
) -> None:
    """On vLLM's CPU page layout (bf16, the instruction set this machine's vLLM picks), the
    seal's fill check reads every row of the pages in place, in the pool and in a copy of them
    (rowhash's page_sums), and gets each row's digest as copying the rows out
    (HostRows.page_rows) does; a changed element is found in its row."""
    from vllm_kvguard.connector.layout import cpu_isa, cpu_slot_elements
    from vllm_kvguard.digest.pages import KVPages
    from vllm_kvguard.digest.row_access import HostRows, PackedRows
    from vllm_kvguard.digest.rows import RowDigests

    page_shape = (heads, block_size, 2 * head)
    isa = cpu_isa("model.layers.0.self_attn.attn", torch.bfloat16, block_size, head)
    elements = cpu_slot_elements(page_shape, torch.bfloat16, block_size, isa)
    pool = torch.randn(2, 6, *page_shape).to(torch.bfloat16)
    layers = [pool[0], pool[1]]
    host = HostRows(layers, elements)
    # AMX packs K two slots' elements side by side (pairs, not one slot's run or four slots'
    # lanes per word): no plan, the rows are copied out instead (the same digests, slower).
    assert host.copy_plan is not None or isa == "amx", isa
    rows = RowDigests(layers, [PackedRows(t, host.elements) for t in layers], 6, block_size, host)
    pages = KVPages({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)})
    ids = [4, 1, 2]
    b, s = np.repeat(ids, block_size), np.tile(np.arange(block_size), len(ids))

    def copy() -> np.ndarray:
        copies: list[np.ndarray] = []
        pages.seal_host_pages(
            ids, check_finite=False, visit=lambda lo, i, c: copies.append(c.copy()), copy=True
        )
        return copies[0]

    first = copy()
    if host.copy_plan is not None:
        got = rows._copy_digests(host, first)
        assert got is not None and np.array_equal(got, rowhash.digest_rows(host.page_rows(first), s))
        assert np.array_equal(got, rows.hash(b, s))
        assert host.page_at is not None
        in_pool = rows._page_digests(host, host.page_at, host.page_bytes, np.array(ids))
        assert in_pool is not None and np.array_equal(in_pool, got)
    else:
        assert rows._copy_digests(host, first) is None
        assert np.array_equal(rowhash.digest_rows(host.page_rows(first), s), rows.hash(b, s))
    rows.record(b, s)
    layers[1][1].view(-1)[int(host.elements[5][2])] += 1.0  # a K element of row (1, 5), layer 1
    assert rows.check_pages(np.array(ids), rows.rows[ids], copy()).tolist() == [block_size + 5]
    assert rows.check_pages(np.array(ids), rows.rows[ids]).tolist() == [block_size + 5]
