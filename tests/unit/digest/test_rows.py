"""Row digests (digest/rows.py): one digest per written slot, checked, rolled, compared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_kvguard.digest.row_access import AxisRows, PackedRows
from vllm_kvguard.digest.rows import RowDigests, row_digests_reference, row_digests_torch

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


def _packed_cache(num_blocks: int = 6, bs: int = BS) -> tuple[torch.Tensor, np.ndarray]:
    """A page laid out like vLLM's CPU 'vec' layout: per head, K transposed (head x slots), then
    V (slots x head); the element map lists each slot's elements."""
    heads, head = 2, 8
    cache = torch.randn(num_blocks, heads, bs, 2 * head)
    index = np.arange(heads * bs * 2 * head).reshape(heads, 2, bs * head)
    k = index[:, 0].reshape(heads, head, bs)  # K: element (d, slot)
    v = index[:, 1].reshape(heads, bs, head)  # V: element (slot, d)
    # In ascending order, as the probe finds them (cpu_slot_elements).
    elements = np.stack(
        [np.sort(np.concatenate([k[:, :, s].ravel(), v[:, s, :].ravel()])) for s in range(bs)]
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


def test_host_rows_read_the_same_bytes_as_torch_and_back_the_digests() -> None:
    from vllm_kvguard.digest.row_access import HostRows

    layers = [_packed_cache()[0] for _ in range(2)]
    _, elements = _packed_cache()
    host = HostRows(layers, elements)
    assert host.strided  # the vec layout is two strided grids: K transposed, V as rows
    # The rows' byte order is the host's (part after part); the same elements, reordered.
    assert (np.sort(host.elements, axis=1) == elements).all()
    elements = host.elements
    b, s = np.array([1, 4, 4]), np.array([0, 3, 1])
    packed = [PackedRows(t, elements) for t in layers]
    expected = torch.cat([g(torch.from_numpy(b), torch.from_numpy(s)) for g in packed], dim=1)
    assert np.array_equal(host.gather(b, s), expected.contiguous().view(torch.uint8).numpy())
    rows = RowDigests(layers, packed, 6, BS, host)
    assert rows.row_bytes == host.row_bytes == 2 * 2 * 2 * 8 * 4
    rows.record(b, s)
    assert rows.check(b, s).tolist() == []
    layers[1][4].view(-1)[int(elements[3][5])] += 1.0  # the second layer of row (4, 3)
    assert rows.check(b, s).tolist() == [1]
    # Digests are the same whichever way the rows are read.
    assert (RowDigests(layers, packed, 6, BS).hash(b, s) == rows.hash(b, s)).all()


def test_strided_and_element_map_gathers_read_the_same_rows() -> None:
    from vllm_kvguard.digest.row_access import HostRows, strided_parts

    layers = [_packed_cache(9)[0] for _ in range(3)]
    _, elements = _packed_cache(9)
    fitted = strided_parts(elements)
    assert fitted is not None
    ordered, parts = fitted
    # K: (heads, head) elements a slot apart; V: (heads, head) contiguous, a head apart per slot.
    assert [(p.shape, p.strides, p.slot_stride) for p in parts] == [
        ((2, 8), (64, 4), 1),
        ((2, 8), (64, 1), 8),
    ]
    host = HostRows(layers, elements)
    # A map whose slots are not one shift of the first: read through the map (take).
    shuffled = ordered.copy()
    shuffled[2] = shuffled[2][::-1]
    assert strided_parts(shuffled) is None
    by_map = HostRows(layers, ordered)
    by_map.parts, by_map.views = [], []  # the fallback path, on the same order
    rng = np.random.default_rng(1)
    for n in (1, 5, 300):  # 300: more than one chunk of RowDigests.CHUNK
        b, s = rng.integers(0, 9, n), rng.integers(0, BS, n)
        assert np.array_equal(host.gather(b, s), by_map.gather(b, s))
        assert np.array_equal(host.gather(b, s, reuse=True), by_map.gather(b, s))
        rows = RowDigests(layers, [PackedRows(t, ordered) for t in layers], 9, BS, host)
        digests = rows.hash(b, s)
        assert (
            digests == RowDigests(layers, [PackedRows(t, ordered) for t in layers], 9, BS).hash(b, s)
        ).all()
    assert not HostRows(layers, shuffled).strided


def test_layers_in_one_buffer_are_read_through_one_view_each_part() -> None:
    from vllm_kvguard.digest.row_access import HostRows

    _, elements = _packed_cache(9)
    # As vLLM allocates them: every layer a view into one buffer, evenly spaced.
    buffer = torch.randn(3, 9, 2, BS, 16)
    layers = [buffer[i] for i in range(3)]
    host = HostRows(layers, elements)
    assert [(start, count) for start, count, _ in host.views] == [(0, 3)]
    apart = HostRows([t.clone() for t in layers], elements)
    assert [(start, count) for start, count, _ in apart.views] == [(0, 1), (1, 1), (2, 1)]
    by_map = HostRows(layers, host.elements)
    by_map.parts, by_map.views = [], []
    rng = np.random.default_rng(2)
    b, s = rng.integers(0, 9, 40), rng.integers(0, BS, 40)
    expected = by_map.gather(b, s)
    assert np.array_equal(host.gather(b, s), expected) and np.array_equal(apart.gather(b, s), expected)
    written = expected.copy()
    probe = host.probe_of(written)
    assert host.landed(b, s, probe).all() and apart.landed(b, s, apart.probe_of(written)).all()
    # A row of the last layer that did not land: its V run still holds the old values.
    layer_bytes = written.shape[1] // 3
    v_start = 2 * layer_bytes + (written.shape[1] // 3) // 2  # V part: second half of the layer
    written[5, v_start : v_start + 4] ^= 1
    landed = host.landed(b, s, host.probe_of(written))
    assert np.flatnonzero(~landed).tolist() == [5]
    assert (apart.landed(b, s, apart.probe_of(written)) == landed).all()
    # A change to the row outside the probe (its K) is not what this check reads.
    written = expected.copy()
    written[7, 2 * layer_bytes] ^= 1
    assert host.landed(b, s, host.probe_of(written)).all()


def test_rows_kept_as_written_in_one_call_are_what_record_keeps() -> None:
    """RowDigests.record_written (the worker's usual step: one compiled call) keeps the same
    digests and reports the same previous-owner matches as record() given the written rows'
    digests and probes (landing checked in numpy): a row that did not land is digested from its
    page; rows not in the order written, or pages not on 64-bit words, are left to the caller
    (None, tables untouched)."""
    from vllm_kvguard.digest import rowhash
    from vllm_kvguard.digest.row_access import HostRows

    _, elements = _packed_cache(9)
    buffer = torch.randn(3, 9, 2, BS, 16)
    layers = [buffer[i] for i in range(3)]
    host = HostRows(layers, elements)
    assert host.land is not None and host.probe_spec is not None

    def fresh() -> RowDigests:
        return RowDigests(layers, [PackedRows(t, host.elements) for t in layers], 9, BS, host)

    rng = np.random.default_rng(3)
    flat = rng.choice(np.arange(BS, 9 * BS), size=20, replace=False).astype(np.int64)
    b, s = flat // BS, flat % BS
    handed = host.gather(b, s).copy()  # what the write op was handed: here, what landed
    # Row 5's last layer did not land: the op was handed other V values than the page holds.
    layer_bytes = handed.shape[1] // 3
    handed[5, 2 * layer_bytes + layer_bytes // 2] ^= 1
    sums = rowhash._sums_numpy(handed.view(np.uint64), s)
    probe = host.probe_of(handed)
    fast, slow = fresh(), fresh()
    # Rows 2 and 5 as their blocks' previous owners left them (lost writes, if they repeat).
    for rows in (fast, slow):
        rows.previous[b[[2, 5]], s[[2, 5]]] = rows.hash(b[[2, 5]], s[[2, 5]])
    same = fast.record_written(b, s, flat, sums, probe)
    expected = slow.record(b, s, rowhash.finish(sums), probe)
    assert same is not None and same.tolist() == expected.tolist()
    assert np.flatnonzero(same).tolist() == [2, 5]  # row 5: the page's old row, not as handed
    assert np.array_equal(fast.rows, slow.rows)
    assert fast.rows[b[5], s[5]] == fast.hash(b[5:6], s[5:6])[0] != rowhash.finish(sums[5:6])[0]
    # The next step's flags are its own (they come from a buffer kept between calls): with no
    # previous owner's rows left, none reads as one, the row that did not land included.
    first = same.copy()
    fast.previous[:] = 0
    again = fast.record_written(b, s, flat, sums, probe)
    assert again is not None and not again.any() and first.any()
    # Not in the order written: nothing kept.
    other = fresh()
    assert other.record_written(b, s, flat[::-1].copy(), sums, probe) is None and not other.rows.any()
    # Pages 4 bytes past a 64-bit word: landing is checked in numpy (record's path).
    shifted = torch.randn(buffer.numel() + 1)[1:].view(buffer.shape)
    odd = HostRows([shifted[i] for i in range(3)], elements)
    assert odd.probe_spec is not None and odd.land is None
    rows = RowDigests(list(shifted), [PackedRows(t, odd.elements) for t in shifted], 9, BS, odd)
    assert rows.record_written(b, s, flat, sums, probe) is None and not rows.rows.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_a_copy_of_whole_pages_are_the_rows_gathered_from_the_pool(dtype: torch.dtype) -> None:
    """The seal's fill check reads rows out of the pages in the pool, or out of its copy of
    them: in 16-bit pages whose K has slots side by side, in place (HostRows.copy_plan,
    rowhash's page_sums), else through HostRows.page_rows (the same bytes, in the same order,
    as gathering each row from the pool, through the strided views and through the element
    map) or, in the pool, by gathering the rows asked for; each gives every row's digest;
    check_pages, in the pool and in the copy, finds exactly the rows changed after they were
    recorded and ignores rows not asked for."""
    from vllm_kvguard.digest import rowhash
    from vllm_kvguard.digest.pages import KVPages
    from vllm_kvguard.digest.row_access import HostRows

    _, elements = _packed_cache(9)
    buffer = torch.randn(3, 9, 2, BS, 16).to(dtype)
    layers = [buffer[i] for i in range(3)]
    host = HostRows(layers, elements)
    by_map = HostRows(layers, host.elements)
    by_map.parts, by_map.views = [], []
    pages = KVPages({f"l{i}": t for i, t in enumerate(layers)})
    ids = np.array([7, 2, 5], dtype=np.int64)
    copies: list[np.ndarray] = []
    pages.seal_host_pages(
        ids.tolist(), check_finite=False, visit=lambda lo, i, c: copies.append(c.copy()), copy=True
    )
    (copy,) = copies
    b, s = np.repeat(ids, BS), np.tile(np.arange(BS), len(ids))
    assert np.array_equal(host.page_rows(copy), host.gather(b, s))
    assert np.array_equal(by_map.page_rows(copy), host.gather(b, s))
    rows = RowDigests(layers, [PackedRows(t, host.elements) for t in layers], 9, BS, host)
    in_place = rows._copy_digests(host, copy)
    if dtype == torch.bfloat16:
        lanes, runs = host.copy_plan  # type: ignore[misc]
        # K: 2 heads x 8 elements a slot, 4 to a word, slots side by side; V: one run a head.
        assert (len(lanes), runs[:, :2].tolist()) == (4, [[4, 2], [6, 2]])
        assert in_place is not None
        assert np.array_equal(in_place, rowhash.digest_rows(host.page_rows(copy), s))
        assert host.page_at is not None
        in_pool = rows._page_digests(host, host.page_at, host.page_bytes, ids)
        assert in_pool is not None and np.array_equal(in_pool, in_place)
    else:  # 32-bit K elements a slot apart: no 64-bit word of a row lies in one place
        assert host.copy_plan is None and in_place is None
    rows.record(b[:-1], s[:-1])  # every row but the last page's last
    expected = rows.rows[ids]
    assert rows.check_pages(ids, expected, copy).tolist() == []
    assert rows.check_pages(ids, expected).tolist() == []
    layers[2][2].view(-1)[int(host.elements[1][3])] += 1.0  # row (2, 1), third layer
    layers[0][5].view(-1)[int(host.elements[3][0])] += 1.0  # row (5, 3): not recorded
    copies.clear()
    pages.seal_host_pages(
        ids.tolist(), check_finite=False, visit=lambda lo, i, c: copies.append(c.copy()), copy=True
    )
    assert rows.check_pages(ids, expected, copies[0]).tolist() == [1 * BS + 1]
    assert rows.check_pages(ids, expected).tolist() == [1 * BS + 1]
    assert rows.check(b[:-1], s[:-1]).tolist() == [BS + 1]
    assert rows.check_pages(ids, np.zeros_like(expected), copies[0]).tolist() == []
    assert rows.check_pages(ids, np.zeros_like(expected)).tolist() == []
    with pytest.raises(IndexError, match="outside the pool's 9 blocks"):
        rows.check_pages(np.array([2, 9]), expected[:2])


def test_check_pages_in_one_compiled_call_finds_what_gathering_the_rows_finds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """check_pages sums each page's rows where they lie only up to its last checked row, and
    compares them, in one compiled call (rowhash's page_changes): on pages being filled (the
    leading rows checked), with gaps, and with none checked, it reports the same changed rows
    and counts the same rows and pages as gathering the checked rows out of the pool; a
    changed row that is not checked (below or past the last checked one) is never reported."""
    from vllm_kvguard.digest import rowhash
    from vllm_kvguard.digest.row_access import HostRows

    assert rowhash.compiled() is not None, rowhash.backend()
    bs = 16
    _, elements = _packed_cache(12, bs)
    buffer = torch.randn(2, 12, 2, bs, 16).to(torch.bfloat16)
    layers = [buffer[i] for i in range(2)]
    host = HostRows(layers, elements)
    assert host.copy_plan is not None and host.page_at is not None
    rows = RowDigests(layers, [PackedRows(t, host.elements) for t in layers], 12, bs, host)
    rng = np.random.default_rng(5)
    ids = np.array([3, 11, 0, 7, 5], dtype=np.int64)
    b, s = np.repeat(ids, bs), np.tile(np.arange(bs), len(ids))
    rows.record(b, s)
    expected = rows.rows[ids].copy()
    expected[0, 5:] = 0  # a page being filled: rows 0-4 written
    expected[1, :] = 0  # no row checked
    expected[2, ::3] = 0  # gaps
    expected[3, 1:] = 0  # one row
    fallback = RowDigests(layers, [PackedRows(t, host.elements) for t in layers], 12, bs, host)
    fallback.rows[:] = rows.rows

    def both(want: list[int], counts: tuple[int, int]) -> None:
        got, n, pages = rows.check_pages_counted(ids, expected)
        with monkeypatch.context() as m:
            m.setattr(rowhash, "compiled", lambda: None)  # no numba: the rows gathered
            slow, n_slow, pages_slow = fallback.check_pages_counted(ids, expected)
        assert got.tolist() == slow.tolist() == want
        assert (n, pages) == (n_slow, pages_slow) == counts

    checked = int(np.count_nonzero(expected))
    both([], (checked, 4))
    for page, slot in [(0, 2), (0, 9), (1, 4), (2, 3), (2, 4), (3, 0), (4, 15)]:
        layers[rng.integers(2)][ids[page]].view(-1)[int(host.elements[slot][rng.integers(32)])] += 1.0
    # (0, 9) past page 0's last checked row, (1, 4) on a page with none checked, (2, 3) a gap.
    both([0 * bs + 2, 2 * bs + 4, 3 * bs + 0, 4 * bs + 15], (checked, 4))
