"""Digests by page identity (what a loaded page is checked against), and the folder engines
share them through."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_kvguard.digest.loads import ENTRY_OVERHEAD, SET_OVERHEAD, LoadDigests, candidates
from vllm_kvguard.digest.store import SEGMENTS, DigestFolder


def _rows(n: int, layers: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**63, size=(n, layers), dtype=np.uint64)


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
    rows = _rows(4)
    producer.publish(np.array([5, 6, 0, 8], dtype=np.uint64), rows)
    fps, digests = consumer.fetch()
    assert fps.tolist() == [5, 6, 8] and digests.tolist() == rows[[0, 1, 3]].tolist()
    assert consumer.fetch()[0].tolist() == []  # only what is new since the last look
    assert other_layout.fetch()[0].tolist() == []  # another shard: not comparable
    assert producer.fetch()[0].tolist() == []  # its own records are not read back
    producer.publish(np.array([9], dtype=np.uint64), rows[:1])
    assert consumer.fetch()[0].tolist() == [9]


def test_a_writer_keeps_its_own_segments_within_its_bound(tmp_path: Path) -> None:
    record = 8 + 8 * 2
    folder = DigestFolder(tmp_path, "L2", 2, SEGMENTS * 2 * record)  # 2 records a segment
    reader = DigestFolder(tmp_path, "L2", 2, 1 << 20)
    for i in range(1, 21):
        folder.publish(np.array([i], dtype=np.uint64), _rows(1, 2, seed=i))
    files = sorted((tmp_path / "L2").glob("*.bin"))
    assert len(files) == SEGMENTS and all(f.stat().st_size <= 2 * record for f in files)
    # A reader sees the newest records; deleted segments are dropped, not an error.
    assert reader.fetch()[0].tolist() == list(range(13, 21))
    folder.close()
