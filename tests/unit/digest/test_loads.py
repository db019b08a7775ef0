"""Digests by page identity (what a loaded page is checked against), and the folder engines
share them through."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_kvguard.digest.loads import ENTRY_OVERHEAD, SET_OVERHEAD, LoadDigests, candidates
from vllm_kvguard.digest.sketch import WIDTH, sketched_layers
from vllm_kvguard.digest.store import SEGMENTS, DigestFolder


def _rows(n: int, layers: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**63, size=(n, layers), dtype=np.uint64)


def _sketches(n: int, layers: int = 3, seed: int = 0) -> np.ndarray:
    out = np.random.default_rng(seed).normal(size=(n, len(sketched_layers(layers)), WIDTH)).astype(np.float32)
    out[..., -1] = 4.0  # each page's norm (about what 16 standard projections of it give)
    return out


def test_digests_are_found_by_identity_and_unknown_ones_are_none() -> None:
    store = LoadDigests(num_layers=3, max_bytes=1 << 20)
    rows = _rows(3)
    store.remember(np.array([11, 0, 13], dtype=np.uint64), rows)  # 0: no known identity, skipped
    found = store.expected(np.array([13, 11, 12, 0], dtype=np.uint64))
    assert found[0] is not None and found[0].tolist() == [rows[2].tolist()]
    assert found[1] is not None and found[1].tolist() == [rows[0].tolist()]
    assert found[2] is None and found[3] is None and len(store) == 2


def test_an_identity_keeps_each_computation_newest_first_and_bounded() -> None:
    """The same inputs computed in other batches give other bytes: every distinct set is kept
    (up to per_identity), a set seen again moves to the front, the oldest beyond the bound goes."""
    store = LoadDigests(num_layers=2, max_bytes=1 << 20, per_identity=3)
    a, b, c, d = _rows(4, 2)
    fp = np.array([7], dtype=np.uint64)
    for row in (a, b, a, c):
        store.remember(fp, row[None])
    (sets,) = store.expected(fp)
    assert sets is not None and sets.tolist() == [c.tolist(), a.tolist(), b.tolist()]
    store.remember(fp, d[None])
    (sets,) = store.expected(fp)
    assert sets is not None and sets.tolist() == [d.tolist(), c.tolist(), a.tolist()]
    assert store.nbytes() == ENTRY_OVERHEAD + 3 * store.set_bytes
    # Two pages of one identity in one call (a batch sealed the same prompt twice).
    store.remember(np.array([9, 9], dtype=np.uint64), np.stack([a, b]))
    (sets,) = store.expected(np.array([9], dtype=np.uint64))
    assert sets is not None and sets.tolist() == [b.tolist(), a.tolist()]


def test_candidates_pad_with_the_newest_set() -> None:
    one, two = _rows(1, 2), _rows(2, 2, seed=1)
    out = candidates([one, two])
    assert out.shape == (2, 2, 2)
    assert out[0].tolist() == [one[0].tolist(), one[0].tolist()] and out[1].tolist() == two.tolist()


def test_the_store_is_bounded_least_recently_used_first_out() -> None:
    entry = ENTRY_OVERHEAD + (8 * 2 + SET_OVERHEAD)
    store = LoadDigests(num_layers=2, max_bytes=3 * entry)
    store.remember(np.array([1, 2, 3], dtype=np.uint64), _rows(3, 2))
    store.expected(np.array([1], dtype=np.uint64))  # 1 used: 2 is now the oldest
    store.remember(np.array([4], dtype=np.uint64), _rows(1, 2, seed=1))
    assert [r is not None for r in store.expected(np.array([1, 2, 3, 4], dtype=np.uint64))] == [
        True,
        False,
        True,
        True,
    ]
    assert store.nbytes() == 3 * entry
    # A second set for an identity costs its bytes too: the least recently used goes.
    store.remember(np.array([1], dtype=np.uint64), _rows(1, 2, seed=2))
    assert [r is not None for r in store.expected(np.array([1, 3, 4], dtype=np.uint64))] == [
        True,
        False,
        True,
    ]
    assert store.nbytes() <= 3 * entry


def test_a_folder_carries_digests_from_one_engine_to_another(tmp_path: Path) -> None:
    producer = DigestFolder(tmp_path, "L3-B64-xxh3_64-rank0", 3, 1 << 20)
    consumer = DigestFolder(tmp_path, "L3-B64-xxh3_64-rank0", 3, 1 << 20)
    other_layout = DigestFolder(tmp_path, "L3-B64-xxh3_64-rank1", 3, 1 << 20)
    rows, sketches = _rows(4), _sketches(4)
    producer.publish(np.array([5, 6, 0, 8], dtype=np.uint64), rows, sketches)
    fps, digests, got = consumer.fetch()
    assert fps.tolist() == [5, 6, 8] and digests.tolist() == rows[[0, 1, 3]].tolist()
    assert np.array_equal(got, sketches[[0, 1, 3]])
    assert consumer.fetch()[0].tolist() == []  # only what is new since the last look
    assert other_layout.fetch()[0].tolist() == []  # another shard: not comparable
    assert producer.fetch()[0].tolist() == []  # its own records are not read back
    producer.publish(np.array([9], dtype=np.uint64), rows[:1], sketches[:1])
    assert consumer.fetch()[0].tolist() == [9]


def test_a_writer_keeps_its_own_segments_within_its_bound(tmp_path: Path) -> None:
    record = 8 + 8 * 2 + 4 * 2 * WIDTH
    folder = DigestFolder(tmp_path, "L2", 2, SEGMENTS * 2 * record)  # 2 records a segment
    reader = DigestFolder(tmp_path, "L2", 2, 1 << 20)
    for i in range(1, 21):
        folder.publish(np.array([i], dtype=np.uint64), _rows(1, 2, seed=i), _sketches(1, 2, seed=i))
    files = sorted((tmp_path / "L2").glob("*.bin"))
    assert len(files) == SEGMENTS and all(f.stat().st_size <= 2 * record for f in files)
    # A reader sees the newest records; deleted segments are dropped, not an error.
    assert reader.fetch()[0].tolist() == list(range(13, 21))
    folder.close()


def test_an_identity_keeps_its_first_sketch_and_reports_how_far_recomputations_land() -> None:
    """The first computation's sketch is kept; each later computation with a new digest set is
    compared with it (the clean spread): a set seen again, or a page with no sketch, is not."""
    store = LoadDigests(num_layers=3, max_bytes=1 << 20)
    fp = np.array([7], dtype=np.uint64)
    first = _sketches(1)
    assert store.remember(fp, _rows(1, seed=1), first).shape == (0, 2)  # first and last layer
    near = first.copy()
    near[..., :-1] += 0.01 * first[..., -1:]  # every projection moved by 1 % of the norm
    (spread,) = store.remember(fp, _rows(1, seed=2), near)  # one page, each sketched layer's
    assert spread.shape == (2,) and all(0.005 < d < 0.02 for d in spread.tolist())
    assert len(store.remember(fp, _rows(1, seed=2), near)) == 0  # the same set again: no new spread
    (kept,) = store.sketches([7])
    assert kept is not None and np.array_equal(kept, first[0])
    assert store.sketches([8]) == [None]
    nan = np.full_like(first, np.nan)
    store.remember(np.array([8], dtype=np.uint64), _rows(1, seed=3), nan)
    assert store.sketches([8]) == [None]  # no sketch taken: none kept


def test_sketches_count_in_the_bytes_and_leave_with_their_identity() -> None:
    store = LoadDigests(num_layers=3, max_bytes=1 << 20)
    store.remember(np.array([1, 2], dtype=np.uint64), _rows(2), _sketches(2))
    assert store.nbytes() == 2 * (ENTRY_OVERHEAD + store.set_bytes + store.sketch_bytes)
    small = LoadDigests(num_layers=3, max_bytes=ENTRY_OVERHEAD + store.set_bytes + store.sketch_bytes)
    small.remember(np.array([1, 2], dtype=np.uint64), _rows(2), _sketches(2))
    assert len(small) == 1 and small.sketches([1, 2])[0] is None and small.sketches([2])[0] is not None
