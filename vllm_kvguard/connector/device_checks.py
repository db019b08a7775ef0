"""Device checks: kept with the step's output and settled when vLLM has waited for it.

The device path never reads a check back inside a step: a check is queued here and read in
the scheduler's ``before_output`` (KVGuardWorkerMetadata.settle); what it means for the
worker (seals forgotten, shapes diagnosed) is applied at a later bind (:meth:`_apply_settled`).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from vllm_kvguard.config import Mode
from vllm_kvguard.connector.metadata import (
    DeviceCheck,
    DeviceRowCheck,
    KVGuardMetadata,
)
from vllm_kvguard.connector.worker_state import WorkerState
from vllm_kvguard.core.events import Detection
from vllm_kvguard.core.shapes import Shape
from vllm_kvguard.digest.checks import PendingCheck
from vllm_kvguard.digest.device_rows import RowCheck
from vllm_kvguard.digest.table import DeviceDigestTable


class DeviceChecks(WorkerState):
    """Device checks queued in a step and settled later (module docstring)."""

    def _defer_rows(
        self,
        check: RowCheck | None,
        meta: KVGuardMetadata,
        blocks: np.ndarray,
        slots: np.ndarray,
        trigger: str,
        kind: str = "partial_mismatch",
    ) -> None:
        """Keep a device row check for the step's output, as :meth:`_defer` does a page check."""
        if check is None:
            return
        deferred = DeviceRowCheck(
            check.pending,
            self.rank,
            blocks,
            slots,
            trigger,
            meta.step,
            meta.plan.readers if kind == "partial_mismatch" else {},
            kind,
            self.config.mode != Mode.LOG,
            lost=meta.lost_write_rows if kind == "write_lost" and len(meta.lost_write_rows) else None,
        )
        self._worker_meta().pending.append(deferred)
        if kind == "partial_mismatch":  # a lost write needs nothing of the worker once read
            self._unsettled.append(deferred)

    def _defer(
        self,
        check: PendingCheck | None,
        trigger: str,
        step: int,
        readers: dict[int, list[str]],
        kind: str,
        where: dict[str, object] | None = None,
    ) -> DeviceCheck | None:
        """Keep a device check for the step's output (see KVGuardWorkerMetadata.settle)."""
        if check is None:
            return None
        assert self.pages is not None
        deferred = DeviceCheck(
            check,
            self.rank,
            self.pages.names,
            trigger,
            step,
            readers,
            kind,
            self.config.mode != Mode.LOG,
            where=where,
        )
        self._worker_meta().pending.append(deferred)
        self._unsettled.append(deferred)
        return deferred

    def _apply_settled(self, *, wait: bool) -> None:
        """Forget the seals of pages a settled device check found bad (as _verify does at once),
        after diagnosing them: the device path learns of a bad page after the forward, so its
        shape is found here, before the next forward rewrites the page, and reported in a
        ``kv_block_diagnosed`` line of its own."""
        assert self.table is not None
        keep = []
        for deferred in self._unsettled:
            if not (wait or deferred.ready()):
                keep.append(deferred)
                continue
            found = deferred.settle()
            if isinstance(deferred, DeviceRowCheck):
                self._settled_rows(deferred, found)
                if found and self.loaded is not None:
                    self.loaded.drop({d.block_id for d in found})
                continue
            if deferred.trigger == "external_load":
                # A bad load: its seal, taken this step over the loaded bytes, goes in every mode
                # (the host path never takes it); its shape is reported as for other device checks.
                bad = {d.block_id for d in found}
                assert self.loaded is not None
                self.loaded.drop(bad)
                self.loaded.check_read(deferred.step, bad, deferred.check.block_ids)
                self._diagnose_load(deferred.step, found)
            else:
                for d in found:
                    if d.kind == "checksum_mismatch":
                        self._diagnose_late(d)
                bad = deferred.invalid()
            if bad:
                self.table.forget(sorted(bad))
        self._unsettled = keep
        if self.loaded is not None and self.loaded.on_device:
            # The sealed digests no unread check can still find bad, into the load store.
            before = min((d.step for d in keep), default=None)
            self.loaded.settle(wait=wait, before=before)

    def _settled_rows(self, deferred: DeviceRowCheck, found: list[Detection]) -> None:
        """What :meth:`_row_findings` does at once on the host, for rows checked on the device:
        the pages whose rows changed lose any seal (one taken this step over the changed rows was
        voided on the device until now), stay flagged for later readers in log mode, and
        their rows are forgotten outside it."""
        assert self.table is not None and self.rows is not None
        if not found:
            return
        blocks = sorted({d.block_id for d in found})
        self.table.forget(blocks)
        if deferred.trigger == "seal":
            for d in found:
                self._tainted[d.block_id] = d.where
        if self.config.mode != Mode.LOG:
            self.rows.forget(blocks)

    def _diagnose_load(self, step: int, found: list[Detection]) -> None:
        """Device path: the shape of each bad load (its first bad layer), from the page as it is
        now, before the next forward recomputes it (connector/loaded.py)."""
        assert self.loaded is not None and self.pages is not None
        loaded = self.loaded.checked_on_device.pop(step, None)
        seen: set[int] = set()
        for d in found:
            if d.block_id in seen or loaded is None:
                continue
            seen.add(d.block_id)
            layer = self.pages.names.index(d.layer)
            shape = str(Shape.UNDIAGNOSED)
            where: dict[str, object] = {"device": str(self.pages.tensors[layer].device)}
            try:
                if int(self.pages.digest([d.block_id])[0, layer]) == d.actual:
                    shape, where = self.loaded.shape(d.block_id, layer, d.actual, loaded[layer])
            finally:
                self._worker_meta().diagnosed.append(replace(d, readers=(), shape=shape, where=where))

    def _diagnose_late(self, d: Detection) -> None:
        assert self.pages is not None
        layer = self.pages.names.index(d.layer)
        shape = str(Shape.UNDIAGNOSED)
        where: dict[str, object] = {"device": str(self.pages.tensors[layer].device)}
        try:
            # Only the page as it was found: one vLLM already rewrote says nothing.
            if int(self.pages.digest([d.block_id])[0, layer]) == d.actual:
                shape, where, _ = self._diagnose(d.block_id, layer, d.expected, d.actual)
        finally:
            self._worker_meta().diagnosed.append(replace(d, readers=(), shape=shape, where=where))

    def _verify_on_device(self, meta: KVGuardMetadata) -> None:
        """The step's hits and scrub pages in one launch, compared on the device, read back
        with the step's output (see KVGuardWorkerMetadata.settle)."""
        assert self.pages is not None and isinstance(self.table, DeviceDigestTable)
        start = time.perf_counter()
        hits = self.table.sealed_only(meta.plan.verify)
        seen = set(hits)
        scrub = [b for b in self.table.sealed_only(meta.scrub) if b not in seen]
        seen.update(scrub)
        finish = [b for b in self.table.sealed_only(meta.finish) if b not in seen]
        blocks = hits + scrub + finish
        if blocks:
            deferred = self._defer(
                self.table.verify_async(blocks), "reuse", meta.step, meta.plan.readers, "checksum_mismatch"
            )
            if (scrub or finish) and deferred is not None:
                deferred.triggers = dict.fromkeys(scrub, "scrub") | dict.fromkeys(finish, "finish")
        self._worker_meta().verified_steps.add(meta.step)
        for label, n in (("reuse", len(hits)), ("scrub", len(scrub)), ("finish", len(finish))):
            if n:
                self.counters.add("verified", n, label=label)
        self.counters.add("bytes_hashed", len(blocks) * self.pages.bytes_per_block, label="verify")
        self.counters.observe("verify_seconds", time.perf_counter() - start)
