"""Device checks settled with the step's output (the pure part: no kernel, no engine).

The kernel and the whole path on a real engine are tested under Triton's interpreter
(tests/unit/digest/kernel_cases.py, tests/engine/device_path_cases.py); here: what the
worker metadata does with settled results, and that a check that cannot be read
back fails open.
"""

from __future__ import annotations

import pickle
import threading

import torch

from vllm_kvguard.connector.metadata import DeviceCheck, KVGuardWorkerMetadata
from vllm_kvguard.digest import PendingCheck
from vllm_kvguard.digest.kernel import MISMATCH, NONFINITE


def _check(flags: list[list[int]], actual: list[list[int]], expected: list[list[int]]) -> PendingCheck:
    return PendingCheck(
        [10, 11],
        torch.tensor(flags, dtype=torch.int8),
        torch.tensor(actual, dtype=torch.int64).view(torch.uint64),
        torch.tensor(expected, dtype=torch.int64).view(torch.uint64),
    )


def _deferred(check: PendingCheck, kind: str = "checksum_mismatch", report: bool = True) -> DeviceCheck:
    return DeviceCheck(check, 1, ["l0", "l1"], "reuse", 7, {11: ["req-a"]}, kind, report)


def test_settled_mismatches_become_detections_and_bad_blocks() -> None:
    check = _check([[0, 0], [0, MISMATCH]], [[1, 2], [3, 4]], [[1, 2], [3, 5]])
    meta = KVGuardWorkerMetadata(pending=[_deferred(check)])
    meta.settle()
    [d] = meta.detections
    assert (d.rank, d.block_id, d.layer, d.expected, d.actual, d.readers) == (1, 11, "l1", 5, 4, ("req-a",))
    assert (d.trigger, d.step, d.kind) == ("reuse", 7, "checksum_mismatch")
    assert meta.invalid == {11} and meta.pending == []
    assert meta.settle().detections == [d]  # idempotent


def test_log_mode_and_nonfinite_report_no_bad_block() -> None:
    mismatch = _check([[MISMATCH, 0], [0, 0]], [[1, 2], [3, 4]], [[9, 2], [3, 4]])
    nan = _check([[0, NONFINITE], [0, 0]], [[1, 2], [3, 4]], [[0, 0], [0, 0]])
    meta = KVGuardWorkerMetadata(
        pending=[_deferred(mismatch, report=False), _deferred(nan, kind="nonfinite")]
    )
    meta.settle()
    assert [(d.block_id, d.layer, d.kind) for d in meta.detections] == [
        (10, "l0", "checksum_mismatch"),
        (10, "l1", "nonfinite"),
    ]
    assert meta.invalid == set()


def test_pickling_settles_first_and_carries_no_tensor() -> None:
    check = _check([[0, 0], [MISMATCH, 0]], [[1, 2], [3, 4]], [[1, 2], [8, 4]])
    meta = KVGuardWorkerMetadata(pending=[_deferred(check)])
    other = pickle.loads(pickle.dumps(meta))
    assert other.pending == [] and other.invalid == {11}
    assert [(d.block_id, d.expected, d.actual) for d in other.detections] == [(11, 8, 3)]


def test_aggregate_settles_both_ranks() -> None:
    a = KVGuardWorkerMetadata(
        pending=[_deferred(_check([[MISMATCH, 0], [0, 0]], [[1, 2], [3, 4]], [[0, 2], [3, 4]]))]
    )
    b = KVGuardWorkerMetadata(
        pending=[_deferred(_check([[0, 0], [0, 0]], [[1, 2], [3, 4]], [[1, 2], [3, 4]]))]
    )
    merged = a.aggregate(b)
    assert isinstance(merged, KVGuardWorkerMetadata)
    assert merged.invalid == {10} and len(merged.detections) == 1 and merged.pending == []


class _Broken(PendingCheck):
    def __init__(self) -> None:
        self.block_ids = [1]

    def settle(self) -> list[tuple[int, int, int, int, int]]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_check_that_cannot_be_read_back_fails_open() -> None:
    good = _check([[0, 0], [0, MISMATCH]], [[1, 2], [3, 4]], [[1, 2], [3, 5]])
    meta = KVGuardWorkerMetadata(pending=[_deferred(_Broken()), _deferred(good)])
    meta.settle()
    assert meta.invalid == {11} and len(meta.detections) == 1
    [error] = meta.internal_errors
    assert "settle device check (reuse)" in error and "illegal memory access" in error


def test_two_threads_settling_one_check_agree() -> None:
    check = _check([[MISMATCH, 0], [0, MISMATCH]], [[1, 2], [3, 4]], [[0, 2], [3, 0]])
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(check.settle())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r == [(10, 0, 1, 1, 0), (11, 1, 1, 4, 0)] for r in results)


def test_one_launch_for_hits_and_scrub_pages_keeps_each_trigger() -> None:
    check = _check([[MISMATCH, 0], [0, MISMATCH]], [[1, 2], [3, 4]], [[0, 2], [3, 0]])
    deferred = _deferred(check)
    deferred.triggers = {11: "scrub"}
    assert [(d.block_id, d.trigger, d.readers) for d in deferred.settle()] == [
        (10, "reuse", ()),
        (11, "scrub", ("req-a",)),
    ]


class _Once(PendingCheck):
    """Reads back once; a second read would fail (the device buffers are gone)."""

    def __init__(self, inner: PendingCheck) -> None:
        self.block_ids = inner.block_ids
        self._inner, self.reads = inner, 0

    def settle(self) -> list[tuple[int, int, int, int, int]]:
        self.reads += 1
        if self.reads > 1:
            raise RuntimeError("read back twice")
        return self._inner.settle()

    def ready(self) -> bool:
        return True


def test_a_check_is_settled_once_and_every_reader_gets_the_kept_result() -> None:
    once = _Once(_check([[0, 0], [0, MISMATCH]], [[1, 2], [3, 4]], [[1, 2], [3, 5]]))
    deferred = _deferred(once)
    assert not deferred.settled and deferred.ready()
    # The worker (forgetting bad seals) and the scheduler side (the step's output) both read it.
    assert deferred.invalid() == {11}
    meta = KVGuardWorkerMetadata(pending=[deferred])
    meta.settle()
    assert deferred.settled and once.reads == 1
    assert meta.invalid == {11} and [d.block_id for d in meta.detections] == [11]
    assert meta.internal_errors == []


def test_a_failed_read_back_is_kept_and_reported_once() -> None:
    deferred = _deferred(_Broken())
    assert deferred.invalid() == set() and deferred.error is not None
    meta = KVGuardWorkerMetadata(pending=[deferred])
    meta.settle()
    meta.settle()
    assert len(meta.internal_errors) == 1 and meta.detections == []


def _rows(flags: list[int], actual: list[int], expected: list[int]) -> PendingCheck:
    """A device row check's results: one line per row, the row's place standing as its id."""
    return PendingCheck(
        range(len(flags)),
        torch.tensor(flags, dtype=torch.uint8)[:, None],
        torch.tensor(actual, dtype=torch.int64)[:, None],
        torch.tensor(expected, dtype=torch.int64)[:, None],
    )


def test_changed_rows_settle_into_one_detection_per_block_with_their_slots() -> None:
    import numpy as np

    from vllm_kvguard.connector.metadata import DeviceRowCheck

    blocks, slots = np.array([4, 4, 4, 9, 9]), np.array([0, 1, 2, 5, 6])
    check = _rows([0, 1, 1, 0, 1], [1, 20, 21, 3, 40], [1, 2, 3, 3, 4])
    deferred = DeviceRowCheck(check, 2, blocks, slots, "seal", 8, {9: ["req-b"]}, "partial_mismatch", True)
    meta = KVGuardWorkerMetadata(pending=[deferred])
    meta.settle()
    four, nine = meta.detections
    assert (four.block_id, four.layer, four.expected, four.actual, four.kind) == (
        4,
        "all",
        2,
        20,
        "partial_mismatch",
    )
    assert four.where == {"slots": [1, 2], "rows_written": 3} and four.shape == "unfilled_rows"
    assert (nine.block_id, nine.readers, nine.trigger, nine.step, nine.rank) == (9, ("req-b",), "seal", 8, 2)
    assert nine.where == {"slots": [6], "rows_written": 2}
    assert meta.invalid == {4, 9}
    # Log mode: the same detections, nothing reported unreadable.
    logged = DeviceRowCheck(
        _rows([1], [7], [6]), 0, blocks[:1], slots[:1], "scrub", 1, {}, "partial_mismatch", False
    )
    assert [d.block_id for d in logged.settle()] == [4] and logged.invalid() == set()


def test_lost_writes_settle_only_where_the_previous_owner_computed_something_else() -> None:
    import numpy as np

    from vllm_kvguard.connector.metadata import DeviceRowCheck

    blocks, slots = np.array([3, 3, 6]), np.array([0, 1, 0])
    lost = np.array([True, True, False])  # block 6's previous owner wrote the same tokens there
    check = _rows([1, 1, 1], [11, 12, 13], [11, 12, 13])
    deferred = DeviceRowCheck(check, 0, blocks, slots, "write", 5, {}, "write_lost", True, lost=lost)
    [d] = deferred.settle()
    assert (d.block_id, d.kind, d.shape, d.trigger, d.expected, d.actual) == (
        3,
        "write_lost",
        "stale",
        "write",
        11,
        11,
    )
    assert d.where == {"slots": [0, 1]}
    assert deferred.invalid() == set()  # the scheduler acts on write_lost detections themselves


def test_a_row_check_that_cannot_be_read_back_fails_open() -> None:
    import numpy as np

    from vllm_kvguard.connector.metadata import DeviceRowCheck

    check = _rows([1], [2], [3])
    check._host_flags = None  # type: ignore[assignment]  # as if the copy never arrived
    deferred = DeviceRowCheck(check, 0, np.array([1]), np.array([0]), "seal", 3, {}, "partial_mismatch", True)
    meta = KVGuardWorkerMetadata(pending=[deferred])
    meta.settle()
    assert meta.detections == [] and meta.invalid == set()
    [error] = meta.internal_errors
    assert error.startswith("settle device row check (seal)")
