"""What the scheduler adds to the ledger's plan of a step: page identity (fingerprints recorded
and every hit checked), pages another connector loads, scrub pages, drill faults; and the
state gauges.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from vllm_kvguard.connector import patches
from vllm_kvguard.connector.metadata import KVGuardMetadata
from vllm_kvguard.core.events import (
    FaultInjected,
    FaultOutcome,
)
from vllm_kvguard.core.faults import FaultSite, Injection
from vllm_kvguard.core.plan import BlockState, IdentityMismatch, ScheduledRequest, StepPlan

if TYPE_CHECKING:
    pass

from vllm_kvguard.connector.findings import Findings


class Planning(Findings):
    """What the scheduler adds to the ledger's plan of a step (module docstring)."""

    def _check_identity(self, plan: StepPlan, meta: KVGuardMetadata) -> None:
        """Record what each page sealed this step holds; check every prefix-cache hit against
        the reader's own fingerprint for that position, before the forward that reads it."""
        for req_id, positions, blocks in plan.given_pages:
            self.ledger.record_owners(blocks, self.identity.owner_keys(req_id, positions))
        # Beside another connector only: the sealed pages' fingerprints, for the worker's store.
        keep: list[tuple[np.ndarray, np.ndarray]] | None = [] if self.beside else None
        for req_id, positions, blocks in plan.sealed_pages:
            fingerprints = self.identity.fingerprints(req_id, positions)
            self.ledger.record_identity(req_id, blocks, fingerprints)
            if keep is not None:
                keep.append((blocks, fingerprints))
        given, sealed = plan.given_decodes, plan.sealed_decodes
        if given is not None:  # a decode batch's pages: one call each for all of them
            self.ledger.record_owners(
                given.blocks, self.identity.owner_key_each(given.req_ids, given.positions)
            )
        if sealed is not None:
            fingerprints = self.identity.fingerprint_each(sealed.req_ids, sealed.positions)
            self.ledger.record_identity(sealed.req_ids, sealed.blocks, fingerprints)
            if keep is not None:
                keep.append((sealed.blocks, fingerprints))
        if keep:
            # The worker keeps these pages' digests under what they hold, for later loads.
            meta.sealed_identity = (
                np.concatenate([b for b, _ in keep]).astype(np.int64),
                np.concatenate([f for _, f in keep]).astype(np.uint64),
            )
        found: list[IdentityMismatch] = []
        hits: dict[str, int] = {}
        for req_id, blocks in plan.hit_pages:
            fingerprints = self.identity.fingerprints(req_id, np.arange(len(blocks)))
            mismatches = self.ledger.identity_mismatches(req_id, blocks, fingerprints)
            if mismatches:
                found.extend(mismatches)
                hits[req_id] = len(blocks)
        if found:
            self._handle_identity(found, hits, meta)

    def _plan_loads(self, requests: list[ScheduledRequest], meta: KVGuardMetadata) -> None:
        """The full pages another connector loaded for this step, with the fingerprint each
        reader expects (its own inputs): the worker checks them before attention reads them.
        Without a connector named beside the guard (configured by hand), they are counted as
        loaded unverified."""
        bs = self.block_size
        spans = [
            (r.req_id, r.num_computed // bs, (r.num_computed + r.loaded) // bs)
            for r in requests
            if r.loaded and (r.num_computed + r.loaded) // bs > r.num_computed // bs
        ]
        if not spans:
            return
        if not self.beside:
            self.counters.add("pages_loaded", sum(end - first for _, first, end in spans), label="no")
            return
        blocks: list[np.ndarray] = []
        fingerprints: list[np.ndarray] = []
        for req_id, first, end in spans:
            pages = self.ledger.table(req_id)[first:end].astype(np.int64)
            blocks.append(pages)
            fingerprints.append(self.identity.fingerprints(req_id, np.arange(first, end, dtype=np.int64)))
            for block in pages.tolist():
                meta.load_readers.setdefault(block, []).append(req_id)
        meta.loaded = (np.concatenate(blocks), np.concatenate(fingerprints).astype(np.uint64))

    def _plan_scrub(self, meta: KVGuardMetadata, now: float) -> None:
        assert self.scrubber is not None
        scrub = self.scrubber.select(self.ledger, now)
        if scrub:
            ids = np.asarray(scrub, dtype=np.int64)
            filling = self.ledger.state[ids] == BlockState.FILLING
            meta.scrub, meta.scrub_filling = ids[~filling].tolist(), ids[filling].tolist()
        if self.scrubber.behind and not self._scrub_behind_logged:
            self._scrub_behind_logged = True
            self.log.line(
                "kvguard_scrub_behind",
                level="warning",
                reason=(
                    "VLLM_KVGUARD_SCRUB_BUDGET cannot verify every sealed page within "
                    "VLLM_KVGUARD_SCRUB_INTERVAL at this step rate; raise the budget or the interval"
                ),
                pages_per_step_max=self.scrubber.max_pages,
            )
        if now - self._age_reported_at >= 1.0:
            self._age_reported_at = now
            self.counters.set("oldest_unverified_age", self.ledger.oldest_unverified_age(now))

    def _plan_faults(self, plan: StepPlan, meta: KVGuardMetadata) -> None:
        assert self.faults is not None and self.block_pool is not None
        for fid in self.faults.allocated(plan.given):
            self.log.event("kv_fault_outcome", FaultOutcome(fid, "not_read", plan.step))
        # A fault is read when its page is verified: reused, or walked by the scrubber; a page
        # still being written also when its rows are verified, or checked at fill.
        self.faults.verifying(
            plan.step, plan.verify + meta.scrub + meta.scrub_filling + plan.read_partial + plan.seal
        )
        blocks = self.block_pool.blocks
        candidates = self.ledger.idle_sealed(lambda b: blocks[b].ref_cnt > 0 or blocks[b].block_hash is None)
        meta.inject = self.faults.inject(plan.step, candidates, self._num_layers)
        if plan.seal and not meta.inject:
            meta.inject = self.faults.inject(plan.step, plan.seal, self._num_layers, FaultSite.WRITE)
        if len(plan.written_blocks) and not meta.inject:
            # Pages this step writes that stay unfilled after it.
            sealed = set(plan.seal)
            filling = sorted({b for b in plan.written_blocks.tolist() if b not in sealed})
            meta.inject = self.faults.inject(plan.step, filling, self._num_layers, FaultSite.FILLING)
        if len(meta.lost_write_rows) and not meta.inject:
            # A page's first writes of its new owner: what they replace is the previous owner's.
            given = set(plan.given)
            checked = sorted(set(plan.written_blocks[meta.lost_write_rows].tolist()))
            first = [b for b in checked if b in given]
            meta.inject = self.faults.inject(plan.step, first, self._num_layers, FaultSite.FORWARD)
        if meta.loaded is not None and not meta.inject:
            # A page another connector loads this step, corrupted after it lands (worker).
            meta.inject = self.faults.inject(
                plan.step, meta.loaded[0].tolist(), self._num_layers, FaultSite.LOAD
            )
        if candidates and not meta.inject:
            known = [b for b in candidates if self.ledger.fingerprint[b]]
            due = self.faults.inject(plan.step, known, 1, FaultSite.CACHE)
            meta.inject = [i for i in (self._swap(d, known) for d in due) if i is not None]
        for inj in meta.inject:
            self.counters.add("faults_injected", label=str(inj.kind))
            self.log.event(
                "kv_fault_injected",
                FaultInjected(inj.fault_id, str(inj.kind), inj.block_id, inj.layer, plan.step, str(inj.at)),
                level="warning",
            )

    def _swap(self, inj: Injection, candidates: list[int]) -> Injection | None:
        """Carry out an ``identity`` fault on vLLM's prefix cache: its page trades hashes with
        another idle cached page that holds other inputs."""
        assert self.faults is not None and self.block_pool is not None
        own = self.ledger.fingerprint[inj.block_id]
        for partner in candidates:
            different = (
                partner != inj.block_id
                and self.ledger.fingerprint[partner] != own
                and not self.faults.pending(partner)
            )
            if different and patches.swap_cached_hashes(self.block_pool, inj.block_id, partner):
                self.faults.pair(inj.fault_id, partner)
                return replace(inj, partner=partner)
        self.faults.no_change(inj.fault_id)
        return None

    def footprint(self) -> dict[str, int]:
        """Entries of every table that grows with requests or events (``STATE_TABLES``)."""
        return {
            **self.ledger.footprint(),
            "stop_messages": len(self.stop_messages),
            "affected": len(self._affected),
            "recompute_counts": len(self._nonfinite_recomputes),
            "pending_failures": len(self.pending_failures),
            "recent_steps": len(self._recent),
            "faults": self.faults.footprint() if self.faults is not None else 0,
            "identities": len(self.identity.requests),
        }

    def _report_state(self) -> None:
        """The state gauges once a second while requests run, and at every step while none do
        (so a server gone quiet shows its tables as they are: an empty step after the last
        request ended can still change one, e.g. a drill fault injected into an idle page)."""
        now = time.monotonic()
        if now - self._state_reported_at < 1.0 and self.ledger.live_requests() != 0:
            return
        self._state_reported_at = now
        for table, n in self.footprint().items():
            self.counters.set("state_entries", n, label=table)
        self.counters.set("state_bytes", self.ledger.nbytes(), label="scheduler")
