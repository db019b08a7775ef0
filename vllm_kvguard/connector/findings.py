"""What the scheduler does with each finding: a page that failed its seal, NaN/Inf written,
a lost write, a page whose inputs differ from its reader's (identity), a block misused by
vLLM's scheduler. Each is decided by :mod:`vllm_kvguard.core.policy`, logged once, and its
readers healed, failed or flagged.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from vllm_kvguard.config import Mode
from vllm_kvguard.connector.metadata import KVGuardMetadata
from vllm_kvguard.core import policy
from vllm_kvguard.core.events import (
    BlockCorrupted,
    BlockNonFinite,
    Detection,
    IdentityMismatchFound,
    LifecycleViolationFound,
    WriteLost,
)
from vllm_kvguard.core.plan import IdentityMismatch, LifecycleViolation
from vllm_kvguard.core.shapes import Shape
from vllm_kvguard.errors import KVCacheCorruptionError

if TYPE_CHECKING:
    pass

from vllm_kvguard.connector.scheduler_state import SchedulerState


def _slots(d: Detection) -> list[int]:
    slots = d.where.get("slots", [])
    return [int(s) for s in slots] if isinstance(slots, list) else []


class Findings(SchedulerState):
    """One handler per finding kind (module docstring)."""

    def _guard_ends(self, mode: Mode) -> bool:
        """Whether the guard ends a failed reader itself: outside raise mode (vLLM would recompute
        it), and in raise mode on a step whose "fail" policy is set aside for audits."""
        return mode != Mode.RAISE or self._fail_policy_of is not None

    def _handle_corruption(self, block: int, detections: list[Detection]) -> None:
        first = detections[0]
        step = min(d.step for d in detections)
        # Requests whose hit of the page was verified before the forward that read it.
        hitters = {r for d in detections for r in d.readers} | self._later_hitters(block, step)
        # A page still being written (its rows, digest/rows.py): its writer holds it past the
        # tokens it has computed.
        unfilled = any(d.kind == "partial_mismatch" for d in detections)
        holders = self._holders(block, step, computed=not unfilled)
        for r in hitters:
            holders.setdefault(r, None)
        if self.finish is not None and self.finish.held:
            # Finished requests whose final output waits for this page's check: they read it.
            for r in self.finish.readers_of(block):
                holders.setdefault(r, None)
        readers = tuple(sorted(holders))
        # Known good at this step's seal or verification, read unverified by every forward since.
        good = self.ledger.last_good_step(block, step)
        unverified_steps = max(0, step - 1 - good) if good >= 0 else step
        if unfilled and any(d.trigger == "seal" for d in detections):
            # Found at fill, after the forward that read the changed rows.
            unverified_steps = max(1, unverified_steps)
        repaired = all(d.repaired for d in detections)
        loaded = first.trigger == "external_load"
        if loaded:
            # Another connector loaded bytes that differ from what was computed here for the
            # same inputs: its readers were checked before attention read the page.
            decision = policy.on_bad_load(self.config.mode)
        elif repaired:
            read_unverified = unverified_steps > 0 and any(r not in hitters for r in readers)
            decision = policy.on_repaired(self.config.mode, read_unverified=read_unverified)
            self.counters.add("repaired")
        elif unfilled:
            decision = policy.on_unfilled_corruption(self.config.mode)
        else:
            decision = policy.on_corruption(self.config.mode)
        self.counters.add("corruptions", label="checksum_mismatch")
        if first.shape != Shape.UNDIAGNOSED:
            # Device-path findings are counted when their diagnosis arrives (kv_block_diagnosed).
            self.counters.add("shapes", label=first.shape)
        if decision.evict:
            self._evict_from_cache(block, holders)
        # Which connector loaded it: the one beside the guard (several: all their names).
        load_fields: dict[str, Any] = {"connector": "|".join(self.beside) or "unknown"} if loaded else {}
        self.log.event(
            "kv_block_corrupted",
            BlockCorrupted(
                block_id=block,
                layer=first.layer,
                layers=tuple(dict.fromkeys(d.layer for d in detections)),
                rank=first.rank,
                ranks=tuple(sorted({d.rank for d in detections})),
                expected_digest=f"{first.expected:016x}",
                actual_digest=f"{first.actual:016x}",
                request_ids=readers,
                action=decision.action,
                generation=int(self.ledger.generation[block]),
                step=self.ledger.step,
                trigger=first.trigger,
                last_good_step=good,
                shape=first.shape,
                shapes=tuple(d.shape for d in detections),
                where=first.where,
                device=str(first.where.get("device", "")),
            ),
            level="error",
            **load_fields,
        )
        if decision.quarantine:
            # After the finding's own line: the runbook reads them in this order.
            self._quarantine(block)
        if self.config.mode != Mode.LOG and not repaired:
            # Reported unreadable: vLLM drops this step's output for every reader and recomputes.
            for req_id in readers:
                self._output_dropped.setdefault(req_id, step)
        failed = set()
        for req_id in readers:
            read_unverified = req_id not in hitters and unverified_steps > 0
            outcome = policy.reader_outcome(
                self.config.mode, self.config.suspect, decision.outcome, read_unverified=read_unverified
            )
            if outcome == policy.HEALED and not repaired:
                self.counters.add("tokens_recomputed", self._tokens_to_recompute(req_id, block))
            # The request's own reads, not the page's history: a hitter verified first read nothing bad.
            own_steps = unverified_steps if read_unverified else 0
            message = KVCacheCorruptionError.describe(block, first.layer, outcome, own_steps)
            self._affect(req_id, block, outcome, message, end=self._guard_ends(self.config.mode))
            if outcome == policy.FAILED:
                failed.add(req_id)
        self._zero_after_failure(block, holders, failed)

    def _handle_nonfinite(self, block: int, detections: list[Detection]) -> None:
        """NaN/Inf in a page just sealed: keep it from spreading, recompute once (policy.on_nonfinite).

        A writer that sampled a token in the step that wrote the page computed it from the
        NaN: recomputing cannot take it back, so it is failed or flagged, never healed. Unless
        vLLM drops that step's output for it: a page it read was found bad in the same step
        (``_output_dropped``); then the NaN came from that page, nothing computed from it left,
        and the request is recomputed from before the bad page (not a model that writes NaN:
        no recompute counted against it)."""
        first = detections[0]
        holders = self._holders(block, first.step, computed=False)
        writers = tuple(sorted(holders))
        discarded = {w for w in writers if self._output_dropped.get(w) == first.step}
        again = any(self._nonfinite_recomputes.get(w, 0) >= 1 for w in writers if w not in discarded)
        decision = policy.on_nonfinite(self.config.nonfinite_mode, again)
        self.counters.add("corruptions", label="nonfinite")
        self.counters.add("shapes", label="nonfinite")
        if decision.evict:
            self._evict_from_cache(block, holders)
        if decision.invalidate:
            self._invalidate_next.append(block)
        if decision.count_recompute:
            for w in writers:
                if w not in discarded:
                    self._nonfinite_recomputes[w] = self._nonfinite_recomputes.get(w, 0) + 1
        self.log.event(
            "kv_block_nonfinite",
            BlockNonFinite(
                block_id=block,
                layers=tuple(dict.fromkeys(d.layer for d in detections)),
                ranks=tuple(sorted({d.rank for d in detections})),
                request_ids=writers,
                action=decision.action,
                step=first.step,
                reason=decision.reason,
            ),
            level="error",
        )
        mode = self.config.nonfinite_mode or Mode.LOG
        failed = set()
        for req_id in writers:
            holder = holders[req_id]
            emitted = (holder.emits if holder is not None else True) and req_id not in discarded
            outcome = policy.reader_outcome(
                mode, self.config.suspect, decision.outcome, read_unverified=emitted
            )
            message = KVCacheCorruptionError.describe_nonfinite(block, first.layer, outcome)
            # raise: vLLM fails the writers when the block is reported next step.
            self._affect(req_id, block, outcome, message, end=self._guard_ends(mode))
            if outcome == policy.FAILED:
                failed.add(req_id)
        self._zero_after_failure(block, holders, failed)

    def _handle_write_lost(self, block: int, detections: list[Detection]) -> None:
        """Rows a forward wrote still read as the block's previous owner's: the write went
        elsewhere or never happened. Like NaN written into a page (_handle_nonfinite), it is
        found after the forward that wrote it: the block is reported unreadable next step (its
        writer recomputes from it, or fails), and a writer that sampled a token in that forward
        computed it from the old rows, so it is failed or flagged, never healed."""
        first = detections[0]
        holders = self._holders(block, first.step, computed=False)
        writers = tuple(sorted(holders))
        decision = policy.on_write_lost(self.config.mode)
        self.counters.add("corruptions", label="write_lost")
        self.counters.add("shapes", label=Shape.STALE)
        if decision.evict:
            self._evict_from_cache(block, holders)
        if decision.invalidate:
            self._invalidate_next.append(block)
            self.ledger.forget_identity([block])
        slots = tuple(sorted({int(s) for d in detections for s in _slots(d)}))
        self.log.event(
            "kv_block_write_lost",
            WriteLost(block, slots, writers, decision.action, first.step),
            level="error",
        )
        failed = set()
        for req_id in writers:
            holder = holders[req_id]
            emitted = holder.emits if holder is not None else True
            outcome = policy.reader_outcome(
                self.config.mode, self.config.suspect, decision.outcome, read_unverified=emitted
            )
            message = KVCacheCorruptionError.describe_write_lost(block, slots, outcome)
            self._affect(req_id, block, outcome, message, end=self._guard_ends(self.config.mode))
            if outcome == policy.FAILED:
                failed.add(req_id)
        self._zero_after_failure(block, holders, failed)

    def _handle_identity(
        self, found: list[IdentityMismatch], hits: dict[str, int], meta: KVGuardMetadata
    ) -> None:
        by_block: dict[int, list[IdentityMismatch]] = defaultdict(list)
        for m in found:
            by_block[m.block_id].append(m)
        if self.faults is not None:
            found_at = self._identity_found
            found_at.setdefault(self.ledger.step, set()).update(by_block)
            for old in [s for s in found_at if s < self.ledger.step - 8]:
                del found_at[old]
        for block, mismatches in sorted(by_block.items()):
            readers = {m.req_id for m in mismatches}
            others = [h for h in self.ledger.holders_of(block) if h not in readers]
            decision = policy.on_identity_mismatch(self.config.mode, shared=bool(others))
            self.counters.add("corruptions", label="identity_mismatch")
            if decision.evict:
                self._evict_from_cache(block, dict.fromkeys(sorted(readers)))
            if decision.invalidate:
                meta.invalidate.append(block)
                self.ledger.forget_identity([block])
            for m in mismatches:
                self.log.event(
                    "kv_block_identity_mismatch",
                    IdentityMismatchFound(
                        block_id=block,
                        position=m.position,
                        request_id=m.req_id,
                        sealed_by=m.sealed_by,
                        expected_fingerprint=f"{m.expected:016x}",
                        found_fingerprint=f"{m.found:016x}",
                        other_holders=len(others),
                        action=decision.action,
                        step=self.ledger.step,
                        reason=decision.reason,
                    ),
                    level="error",
                )
                if decision.outcome == policy.HEALED:
                    self.counters.add(
                        "tokens_recomputed", (hits.get(m.req_id, 0) - m.position) * self.block_size
                    )
                message = KVCacheCorruptionError.describe_identity(
                    block, m.position, m.sealed_by, decision.outcome
                )
                self._affect(m.req_id, block, decision.outcome, message, end=not decision.invalidate)

    def _handle_violation(self, v: LifecycleViolation, meta: KVGuardMetadata) -> None:
        """A block misused by the scheduler: report it and protect the requests it touches."""
        self.counters.add("lifecycle_violations", label=str(v.what))
        decision = policy.on_violation(self.config.mode, v.what, v.holder is not None)
        subject = v.holder if decision.subject == "holder" else v.req_id if decision.subject else None
        if decision.invalidate:
            meta.invalidate.append(v.block_id)
        if subject is not None:
            message = KVCacheCorruptionError.describe_violation(
                v.block_id, str(v.what), subject, decision.outcome
            )
            # The holder of a stolen block cannot recompute into it: the guard ends it in
            # every mode (vLLM's fail policy may too; ending it twice is a no-op).
            self._affect(subject, v.block_id, decision.outcome, message, end=decision.fail_holder)
        self.log.event(
            "kv_block_lifecycle_violation",
            LifecycleViolationFound(
                v.block_id, str(v.what), v.req_id, v.holder, decision.action, self.ledger.step
            ),
            level="error",
        )
