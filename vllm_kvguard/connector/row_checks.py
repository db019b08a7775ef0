"""Row checks: the written rows of unfilled pages re-hashed and compared (digest/rows.py).

An unfilled page has no seal yet; its rows are digested as they are written and checked
when it is scrubbed, read, finished or sealed. Findings name each changed row.
"""

from __future__ import annotations

import time

import numpy as np

from vllm_kvguard.config import Mode
from vllm_kvguard.connector.device_checks import DeviceChecks
from vllm_kvguard.connector.metadata import (
    KVGuardMetadata,
    row_detections,
)
from vllm_kvguard.core.events import Detection
from vllm_kvguard.core.shapes import Shape
from vllm_kvguard.digest.device_rows import DeviceRowDigests


class RowChecks(DeviceChecks):
    """Unfilled pages' rows checked on the host or queued on the device (module docstring)."""

    def _verify_rows(self, meta: KVGuardMetadata, block_ids: list[int], trigger: str) -> set[int]:
        """Unfilled pages: re-hash their written rows (digest/rows.py) and compare. Returns the
        pages that changed (reported unreadable outside log mode, their rows forgotten)."""
        assert self.rows is not None and self.pages is not None
        if not block_ids:
            return set()
        start = time.perf_counter()
        if self.rows.host is not None and not isinstance(self.rows, DeviceRowDigests):
            # The pages' rows summed where they lie, compared, in one compiled call
            # (RowDigests.check_pages; it gathers the rows where it cannot).
            ids = np.asarray(block_ids, dtype=np.int64)
            expected = self.rows.rows[ids]
            changed, rows, pages = self.rows.check_pages_counted(ids, expected)
            found = self._page_findings(meta, ids, expected, changed, trigger)
        else:
            blocks, slots = self.rows.written(block_ids)
            rows, pages = len(blocks), len(np.unique(blocks))
            if isinstance(self.rows, DeviceRowDigests):
                self._defer_rows(self.rows.check_async(blocks, slots), meta, blocks, slots, trigger)
                self._worker_meta().verified_steps.add(meta.step)
                found = set()
            else:
                found = self._row_findings(meta, blocks, slots, self.rows.check(blocks, slots), trigger)
        self.counters.add("verified", pages, label=trigger)
        self.counters.add("bytes_hashed", rows * self.rows.row_bytes, label="verify")
        self.counters.observe("verify_seconds", time.perf_counter() - start)
        return found

    def _page_findings(
        self, meta: KVGuardMetadata, ids: np.ndarray, expected: np.ndarray, changed: np.ndarray, trigger: str
    ) -> set[int]:
        """:meth:`_row_findings` of :meth:`RowDigests.check_pages`' result: ``changed``, flat
        indices (page x slots + slot) among the pages ``ids`` whose rows ``expected`` (pages x
        slots, 0: not checked) were checked."""
        if not len(changed):
            self._worker_meta().verified_steps.add(meta.step)
            return set()
        written = np.flatnonzero(expected)
        bs = self.block_size
        return self._row_findings(
            meta, ids[written // bs], written % bs, np.searchsorted(written, changed), trigger
        )

    def _row_findings(
        self, meta: KVGuardMetadata, blocks: np.ndarray, slots: np.ndarray, bad: np.ndarray, trigger: str
    ) -> set[int]:
        """Detections for the rows ``bad`` (indices into blocks/slots) that changed, one per block."""
        assert self.rows is not None
        out = self._worker_meta()
        out.verified_steps.add(meta.step)
        if not len(bad):
            return set()
        actual = self.rows.hash(blocks[bad], slots[bad])
        expected = self.rows.rows[blocks[bad], slots[bad]]
        detections = row_detections(
            self.rank, blocks, slots, bad, expected, actual, meta.plan.readers, trigger, meta.step
        )
        out.detections.extend(detections)
        found = {d.block_id: d.where for d in detections}
        if trigger == "seal":
            # Never sealed: in log mode its later readers are still told (_tainted_hits).
            self._tainted.update(found)
        if self.config.mode != Mode.LOG:
            self._invalid.update(found)
            self.rows.forget(list(found))
        return set(found)

    def _tainted_hits(self, meta: KVGuardMetadata) -> None:
        """Prefix-cache hits on pages whose rows changed before they could be sealed (log mode
        keeps them cached): each hit is reported again, so every reader is flagged."""
        for block in meta.plan.verify:
            where = self._tainted.get(block)
            if where is not None:
                self._worker_meta().detections.append(
                    Detection(
                        self.rank,
                        block,
                        "all",
                        0,
                        0,
                        tuple(meta.plan.readers.get(block, ())),
                        "reuse",
                        meta.step,
                        "partial_mismatch",
                        shape=str(Shape.UNFILLED_ROWS),
                        where=where,
                    )
                )
