"""Row digests (digest/rows.py): one digest per written slot, checked, rolled, compared."""

from __future__ import annotations

import numpy as np
import torch

from vllm_kvguard.digest.rows import (
    AxisRows,
    PackedRows,
    RowDigests,
    row_digests_reference,
    row_digests_torch,
)

BS = 4


def test_the_device_row_digest_matches_its_reference_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(9, 64), dtype=np.uint8)
    rows[3] = 0  # an all-zero row is still never digest 0
    slots = np.array([0, 1, 2, 3, 0, 1, 2, 3, 31])
    expected = row_digests_reference(rows, slots)
    words = torch.from_numpy(rows.copy()).view(torch.int64)
    actual = row_digests_torch(words, torch.from_numpy(slots)).numpy().view(np.uint64)
    assert (actual == expected).all() and (expected != 0).all()
    # Keyed by slot: the same bytes in another slot are another digest.
    assert expected[0] != row_digests_reference(rows[:1], [1])[0]


def _packed_cache(num_blocks: int = 6) -> tuple[torch.Tensor, np.ndarray]:
    """A page laid out like vLLM's CPU 'vec' layout: per head, K transposed (head x slots), then
    V (slots x head); the element map lists each slot's elements."""
    heads, head = 2, 8
    cache = torch.randn(num_blocks, heads, BS, 2 * head)
    index = np.arange(heads * BS * 2 * head).reshape(heads, 2, BS * head)
    k = index[:, 0].reshape(heads, head, BS)  # K: element (d, slot)
    v = index[:, 1].reshape(heads, BS, head)  # V: element (slot, d)
    # In ascending order, as the probe finds them (cpu_slot_elements).
    elements = np.stack(
        [np.sort(np.concatenate([k[:, :, s].ravel(), v[:, s, :].ravel()])) for s in range(BS)]
    )
    return cache, elements


def test_rows_of_a_packed_layout_are_recorded_checked_and_located() -> None:
    cache, elements = _packed_cache()
    rows = RowDigests([cache], [PackedRows(cache, elements)], 6, BS)
    assert rows.row_bytes == 2 * 2 * 8 * 4
    blocks, slots = np.array([1, 1, 2]), np.array([0, 1, 0])
    assert not rows.record(blocks, slots).any()
    wb, ws = rows.written([1, 2, 3])
    assert list(zip(wb.tolist(), ws.tolist(), strict=True)) == [(1, 0), (1, 1), (2, 0)]
    assert rows.check(wb, ws).tolist() == []
    # One element of slot 1's K (transposed: strided in memory) changes: that row, and only it.
    cache[1].view(-1)[int(elements[1][3])] += 1.0
    assert rows.check(wb, ws).tolist() == [1]
    # Writing an unwritten slot (slot 2 of block 1) changes no recorded row.
    cache[1].view(-1)[elements[2]] = 5.0
    assert rows.check(np.array([1]), np.array([0])).tolist() == []


def test_a_row_that_still_holds_the_previous_owners_is_a_lost_write() -> None:
    cache, elements = _packed_cache()
    rows = RowDigests([cache], [PackedRows(cache, elements)], 6, BS)
    rows.record(np.array([3, 3]), np.array([0, 1]))
    rows.roll([3])  # handed to a new owner
    assert rows.rows[3].tolist() == [0, 0, 0, 0] and rows.previous[3, 0] != 0
    cache[3].view(-1)[elements[0]] = 2.0  # the new owner's write of slot 0 lands; slot 1's does not
    lost = rows.record(np.array([3, 3]), np.array([0, 1]))
    assert lost.tolist() == [False, True]
    rows.forget([3])
    assert not rows.rows[3].any()


def test_axis_layout_gathers_the_slot_dimension() -> None:
    cache = torch.randn(5, 2, BS, 3, 8)  # block-first GPU NHD: (blocks, 2, slots, heads, head)
    rows = RowDigests([cache], [AxisRows(cache, 1)], 5, BS)
    assert rows.row_bytes == 2 * 3 * 8 * 4
    rows.record(np.array([2]), np.array([3]))
    cache[2, 1, 2] += 1  # another slot
    assert rows.check(np.array([2]), np.array([3])).tolist() == []
    cache[2, 0, 3, 1, 4] += 1
    assert rows.check(np.array([2]), np.array([3])).tolist() == [0]


def test_a_strided_layout_is_fitted_from_the_element_map_and_reads_the_same_rows() -> None:
    from vllm_kvguard.digest.rows import StridedRows, strided_parts

    cache, elements = _packed_cache()
    parts = strided_parts(elements, 2)
    assert parts is not None and len(parts) == 2
    packed, strided = PackedRows(cache, elements), StridedRows(cache, parts)
    b, s = torch.tensor([1, 4, 4]), torch.tensor([0, 3, 1])
    # The same elements (each access keeps its own order: element order, or part by part).
    assert torch.equal(packed(b, s).sort(dim=1).values, strided(b, s).sort(dim=1).values)
    strided.put(b[:1], s[:1], torch.zeros(1, elements.shape[1]))
    assert not packed(b[:1], s[:1]).any() and packed(b[1:], s[1:]).all()
    # A map that is no strided pattern (elements shuffled across the page) is not fitted.
    perm = np.random.default_rng(1).permutation(cache[0].numel())
    assert strided_parts(np.sort(perm[elements], axis=1), 2) is None
