"""Fire drills on the worker: the faults ``VLLM_KVGUARD_FAULTS`` orders, injected into real
pages (at rest, at write, into unfilled rows, or as a write that never lands).
"""

from __future__ import annotations

import random

import torch

from vllm_kvguard.connector.metadata import (
    KVGuardMetadata,
)
from vllm_kvguard.connector.worker_state import WorkerState
from vllm_kvguard.core.faults import FaultKind, FaultSite, Injection


class Drills(WorkerState):
    """Fire-drill faults carried out on this worker's pages (module docstring)."""

    def _snapshot_lost(self, meta: KVGuardMetadata) -> None:
        """Before the forward: the rows a ``lost_write`` fault will make not to land."""
        self._unlanded = {}
        if self.rows is None:
            return
        plan = meta.plan
        for injection in meta.inject:
            if injection.at != FaultSite.FORWARD:
                continue
            slots = [
                s_
                for b, s_ in zip(plan.written_blocks.tolist(), plan.written_slots.tolist(), strict=True)
                if b == injection.block_id
            ]
            if slots:
                blocks = [injection.block_id] * len(slots)
                self._unlanded[injection.fault_id] = (slots, self.rows.snapshot(blocks, slots))

    def _unland(self, meta: KVGuardMetadata, injection: Injection) -> None:
        """After the forward: put the rows back as they were before it (the write never landed).
        Unchanged if no row of the previous owner is known there (nothing to tell it by)."""
        taken = self._unlanded.pop(injection.fault_id, None)
        self._worker_meta().verified_steps.add(meta.step)
        if taken is None or self.rows is None:
            self._worker_meta().unchanged_faults.append(injection.fault_id)
            return
        slots, rows = taken
        blocks = [injection.block_id] * len(slots)
        now = self.rows.snapshot(blocks, slots)
        if (
            injection.block_id in self._invalid  # reported bad this step: rewritten next step
            or not self.rows.had_previous(injection.block_id, slots)
            or all(torch.equal(a, b) for a, b in zip(now, rows, strict=True))
        ):
            self._worker_meta().unchanged_faults.append(injection.fault_id)
            return
        self.rows.restore(blocks, slots, rows)

    def _corrupt_rows(self, injection: Injection) -> bool:
        """A ``partial`` fault: one bit flipped in every written row of an unfilled page, in one
        layer, after the rows were recorded. Returns whether any row was there to change."""
        if self.rows is None or injection.block_id in self._invalid:
            return False  # (a page reported bad this step is rewritten by its recompute)
        _, slots = self.rows.written([injection.block_id])
        if not len(slots):
            return False
        layer = injection.layer % len(self.rows.gathers)
        self.rows.flip(injection.block_id, slots.tolist(), layer, random.Random(injection.seed).randrange(8))
        return True

    def _inject(self, injection: Injection) -> bool:
        """Corrupt one page as ordered; return whether its bytes changed."""
        assert self.pages is not None and self.table is not None
        layer = injection.layer % self.pages.num_layers
        block = injection.block_id
        page = self.pages.page(block, layer)
        before = int(self.pages.digest([block])[0, layer])
        rng = random.Random(injection.seed)
        if injection.kind == FaultKind.ZERO:
            page.zero_()
        elif injection.kind == FaultKind.OVERWRITE:
            others = [b for b in self.table.sealed_only(range(self.pages.num_blocks)) if b != block]
            if others:
                page.copy_(self.pages.page(rng.choice(others), layer))
        else:
            raw = page.view(torch.uint8) if injection.kind == FaultKind.BITFLIP else page
            index = tuple(rng.randrange(n) for n in raw.shape)
            if injection.kind == FaultKind.BITFLIP:
                raw[index] = raw[index] ^ (1 << rng.randrange(8))
            else:
                raw[index] = float("nan")
        return int(self.pages.digest([block])[0, layer]) != before
