"""The scheduler side of the guard: plan each step, act on what the workers found.

One instance in the engine core process, behind the
:class:`~vllm_kvguard.connector.facade.KVGuardConnector` facade. ``build_connector_meta``
turns vLLM's ``SchedulerOutput`` into ledger views, lets the ledger plan the step
(seal, forget, verify) and adds scrub pages and drill faults; ``update_connector_output``
takes the workers' detections, asks :mod:`vllm_kvguard.core.policy` what to do and does
it against vLLM's block pool (evict, pin, report unreadable, end requests), with one log
line and the counters for each finding.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_kvguard.config import Mode
from vllm_kvguard.connector import patches
from vllm_kvguard.connector.finish import Held
from vllm_kvguard.connector.metadata import (
    KVGuardMetadata,
    KVGuardWorkerMetadata,
    guard_meta,
    guard_worker_meta,
)
from vllm_kvguard.connector.planning import Planning
from vllm_kvguard.connector.scheduler_state import Holder, RecentStep
from vllm_kvguard.connector.views import request_inputs, step_views
from vllm_kvguard.core import policy
from vllm_kvguard.core.events import (
    BlockDiagnosed,
    Detection,
    FaultOutcome,
    RequestAffected,
)
from vllm_kvguard.core.plan import StepPlan
from vllm_kvguard.logs import power_of_two

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class KVGuardScheduler(Planning):
    """The guard in the engine core: vLLM's scheduler-side hooks (module docstring)."""

    # ------------------------------------------------------------------ the step's plan

    def empty_metadata(self) -> KVGuardMetadata:
        return KVGuardMetadata(StepPlan(self.ledger.step))

    def note_local_hits(self, req_id: str, num_computed_tokens: int) -> None:
        """A waiting request's local prefix-cache hits, as vLLM asks the KV connectors for more
        (asked again at each try to schedule it: the last one counts)."""
        self._local_hits[req_id] = num_computed_tokens

    def build_connector_meta(self, so: SchedulerOutput) -> KVGuardMetadata:
        requests, decodes = step_views(so, self.block_size, self.kv_cache_manager, self._local_hits)
        now = time.monotonic()
        plan = self.ledger.plan(requests, self.read_budget, now, so.preempted_req_ids or (), decodes)
        meta = KVGuardMetadata(plan, read_trigger=str(self.config.verify) if plan.read_verify else "")
        decoding = decodes.req_ids if decodes is not None else []
        self._recent[plan.step] = RecentStep(requests, decoding, plan.readers)
        self._recent.pop(plan.step - 3, None)
        if plan.seal:
            self.counters.add("sealed", len(plan.seal))
        if (
            plan.sealed_pages
            or plan.hit_pages
            or plan.given_pages
            or plan.given_decodes is not None
            or plan.sealed_decodes is not None
        ):
            self._check_identity(plan, meta)
        if requests and any(r.loaded for r in requests):
            self._plan_loads(requests, meta)
        if len(plan.written_blocks):
            lost = self.ledger.lost_write_rows(plan.written_blocks)
            if np.count_nonzero(lost):
                meta.lost_write_rows = lost
        if self.scrubber is not None:
            self._plan_scrub(meta, now)
        if self._invalidate_next:
            meta.invalidate, self._invalidate_next = self._invalidate_next, []
            if self.config.mode != Mode.LOG:  # (the worker forgets their rows: ledger.forget_owners)
                self.ledger.forget_owners(meta.invalidate)
        if self._zero_next:
            meta.zero, self._zero_next = sorted(set(self._zero_next)), []
            self.ledger.forget_owners(meta.zero)
        for violation in self.ledger.take_violations():
            self._handle_violation(violation, meta)
        if self.faults is not None:
            self._plan_faults(plan, meta)
        if self.finish is not None:
            if self.finish.held:
                self.finish.plan(meta, now)
            ahead = self.finish.ahead(meta, so, now)
            if ahead:
                self.counters.add("finish_ahead", ahead)
        return meta

    # ------------------------------------------------------------------ page identity

    def note_request(self, request: Request) -> None:
        """A request scheduled from the waiting queue (new or resumed): read its inputs once."""
        if request.request_id not in self.identity.requests:
            self.identity.add(request.request_id, request_inputs(request))
        if self.finish is not None:
            self.finish.watch(request)
        if self.stop_strings is not None:
            self.stop_strings.watch(request)

    # ------------------------------------------------------------ what the workers found

    def before_output(self, vllm_scheduler: Any, scheduler_output: Any, connector_output: Any) -> None:
        """Handle a step's worker output before vLLM does (patches.py): settle the device
        checks, add their bad blocks to ``invalid_block_ids`` so vLLM recomputes or fails
        their readers in this very step, and act on every finding while the block tables
        of the requests vLLM is about to fail still exist."""
        planned = guard_meta(getattr(scheduler_output, "kv_connector_metadata", None))
        if planned is not None:
            self._output_step = planned.step
            if planned.release and connector_output is not None:
                # vLLM asserts that every request reported done is still there.
                done = connector_output.finished_sending
                if done:
                    connector_output.finished_sending = {r for r in done if r in vllm_scheduler.requests}
        self._restore_fail_policy()
        meta = guard_worker_meta(getattr(connector_output, "kv_connector_worker_meta", None))
        if (
            meta is not None
            and meta.audits
            and not meta.handled
            and not vllm_scheduler.recompute_kv_load_failures
        ):
            # Pages refused for an audit are clean as far as anyone knows: recomputed, never
            # failed, under raise's "fail" policy too. For this step vLLM recomputes every block
            # reported unreadable; the readers of bad ones are ended by the guard instead.
            vllm_scheduler.recompute_kv_load_failures = True
            self._fail_policy_of = vllm_scheduler
        if meta is not None and not meta.handled:
            meta.settle()
            if meta.invalid:
                connector_output.invalid_block_ids = (
                    set(connector_output.invalid_block_ids or ()) | meta.invalid
                )
            if meta.detections:
                self._running = self._take_running(vllm_scheduler, scheduler_output)
            try:
                self.update_connector_output(meta)
            finally:
                self._running = None
        if self.finish is not None and self.finish.held:
            # Their checks' findings are handled: released now, so that the step's own state
            # report (inside vLLM's update_from_output) no longer counts them; their outputs go
            # back into the step's outputs in after_output.
            for h in self.finish.due(self._output_step):
                try:
                    self._released.append(self._release_held(h))
                except Exception as exc:  # its output still leaves, as vLLM made it
                    self.internal_error("finish_release", exc)
                    self._released.append((h.client_index, h.output))

    def _take_running(self, vllm_scheduler: Any, scheduler_output: Any) -> dict[str, Holder]:
        ntok = scheduler_output.num_scheduled_tokens
        out = {}
        for request in vllm_scheduler.running:
            table = self._block_table(request.request_id)
            if table is None:
                continue
            before = request.num_computed_tokens - ntok.get(request.request_id, 0)
            emits = request.num_computed_tokens >= request.num_tokens
            out[request.request_id] = Holder(table, -(-before // self.block_size), emits)
        return out

    def _restore_fail_policy(self) -> None:
        """Put back vLLM's "fail" load-failure policy after a step with audits (after_output, or
        the next step's before_output if that one never ran)."""
        if self._fail_policy_of is not None:
            self._fail_policy_of.recompute_kv_load_failures = False
            self._fail_policy_of = None

    def _audits_failed(self, failed: list[tuple[int, tuple[str, ...], float]]) -> None:
        """Audits whose recomputation differed from what the connector loaded: reported, the
        readers (recomputed at the audit) healed, the connector distrusted (said once)."""
        connector = "|".join(self.beside) or "unknown"
        for block, readers, far in failed:
            self.log.line(
                "kv_load_audit_failed",
                level="error",
                block_id=block,
                request_ids=list(readers),
                connector=connector,
                sketch_distance=round(far, 4) if far != float("inf") else "nan",
                action="recomputed",
            )
            for req_id in readers:
                self._affect(req_id, block, policy.HEALED, "", end=False)
        if failed and not self._distrusted:
            self._distrusted = True
            self.log.line(
                "kvguard_connector_distrusted",
                level="error",
                connector=connector,
                reason=(
                    "a page it loaded differed from the recomputation of the same inputs (wrong KV: "
                    "another model's weights, layout or dtype); every page it loads that nothing "
                    "here can check is refused and recomputed from now on"
                ),
            )

    def update_connector_output(self, meta: KVGuardWorkerMetadata) -> None:
        # Normally done already, in before_output (the update_from_output patch); this keeps
        # the detections where that patch is missing (block tables of failed requests gone).
        if meta.handled:
            return
        meta.handled = True
        meta.settle()
        self.counters.absorb(meta.counters)
        for error in meta.internal_errors:
            self.counters.add("internal_errors")
            self.worker_errors_seen += 1
            if power_of_two(self.worker_errors_seen):
                self.log.line("kvguard_worker_internal_error", level="error", error=error)
        if meta.audits_failed:
            self._audits_failed(meta.audits_failed)
        bad: set[int] = set()  # the blocks found bad this step (the drills' accounting)
        self._output_dropped = {}
        if meta.detections:
            by_block: dict[int, list[Detection]] = defaultdict(list)
            nonfinite: dict[int, list[Detection]] = defaultdict(list)
            lost: dict[int, list[Detection]] = defaultdict(list)
            for d in meta.detections:
                kind = nonfinite if d.kind == "nonfinite" else lost if d.kind == "write_lost" else by_block
                kind[d.block_id].append(d)
            for block, detections in sorted(by_block.items()):
                self._handle_corruption(block, detections)
            for block, detections in sorted(nonfinite.items()):
                self._handle_nonfinite(block, detections)
            for block, detections in sorted(lost.items()):
                self._handle_write_lost(block, detections)
            bad = set(by_block) | set(nonfinite) | set(lost)
            if self.config.mode != Mode.LOG:
                # The worker forgot the rows of pages whose rows changed (_row_findings).
                changed = [
                    b for b, found in by_block.items() if any(d.kind == "partial_mismatch" for d in found)
                ]
                if changed:
                    self.ledger.forget_owners(changed)
        for d in meta.diagnosed:
            self.counters.add("shapes", label=d.shape)
            self.log.event(
                "kv_block_diagnosed",
                BlockDiagnosed(
                    d.block_id, d.layer, d.rank, d.step, d.shape, d.where, str(d.where.get("device", ""))
                ),
                level="error",
            )
        if self.faults is not None:
            for fid in meta.unchanged_faults:
                self.faults.no_change(fid)
                self.log.event("kv_fault_outcome", FaultOutcome(fid, "no_change", self.ledger.step))
            for step in sorted(meta.verified_steps):
                found = bad | self._identity_found.pop(step, set())
                for fid, detected in self.faults.verified(step, found):
                    self.log.event(
                        "kv_fault_outcome",
                        FaultOutcome(fid, "detected" if detected else "escaped", step),
                        level="info" if detected else "error",
                    )

    # --------------------------------------------------------------- request lifecycle

    def request_finished(
        self,
        req_id: str,
        *,
        natural: bool = False,
        client_index: int = 0,
        streaming: bool = False,
        output_tokens: int = 0,
    ) -> bool:
        """vLLM finished ``req_id``. Returns whether to keep its blocks (the finish check holds
        its final output: ``natural``, it stopped or reached its length, in sampled mode)."""
        if self.stop_strings is not None:
            self.stop_strings.forget(req_id)
        if natural and self.finish is not None and self.kv_cache_manager is not None:
            last = self._output_step if self._output_step >= 0 else self.ledger.step
            if self.finish.hold(req_id, client_index, streaming, output_tokens, last):
                self.counters.add("finish_held")
                return True
        unsent = self.unsent.get(req_id)
        if streaming and unsent is not None and req_id in self._affected:
            # Ended by the guard (its error output): the tokens its client already has.
            self._release(req_id, tokens_streamed=max(0, output_tokens - unsent))
        else:
            self._release(req_id)
        return False

    def _release(self, req_id: str, **extra: Any) -> None:
        self._local_hits.pop(req_id, None)
        if self.finish is not None:
            self.finish.forget(req_id)
        self.ledger.release_request(req_id)
        self.identity.drop(req_id)
        self._nonfinite_recomputes.pop(req_id, None)
        affected = self._affected.pop(req_id, None)
        if affected is not None:
            # Once per request, with the worst it came to over every bad page it held.
            outcome, blocks = affected
            self.counters.add("requests_affected", label=outcome)
            self.log.event(
                "kv_request_affected",
                RequestAffected(req_id, blocks[0], tuple(dict.fromkeys(blocks)), outcome),
                level="info" if outcome == policy.HEALED else "error",
                **extra,
            )

    def after_output(self, outputs: dict[int, Any], live: Iterable[str]) -> None:
        """Put the guard's message into the final output of each failed or flagged request;
        hold back the final outputs of requests the finish check holds, and put back those
        whose check this step made; forget messages of requests that ended without one
        passing (aborted)."""
        self._restore_fail_policy()
        finish = self.finish
        if finish is not None and finish.held:
            # First: a held output gets its message when it is released (_release_held).
            finish.stash(outputs)
        if self.stop_messages:
            for engine_outputs in outputs.values():
                for out in engine_outputs.outputs:
                    if out.finish_reason is not None:
                        message = self.stop_messages.pop(out.request_id, None)
                        if message is not None:
                            out.stop_reason = message
        if self._released:
            for client_index, out in self._released:
                if out is not None:
                    patches.add_output(outputs, client_index, out)
            self._released = []
        if self.stop_messages:
            alive = set(live) | (set(finish.held) if finish is not None else set())
            for req_id in [r for r in self.stop_messages if r not in alive]:
                del self.stop_messages[req_id]

    def _release_held(self, h: Held) -> tuple[int, Any]:
        """A held request's pages are verified: its final output goes out as it was, flagged, or
        replaced by the guard's error (a page it read failed its check). Returns its client and
        that output."""
        affected = self._affected.get(h.req_id)
        message = self.stop_messages.pop(h.req_id, None)
        self.pending_failures.pop(h.req_id, None)
        out = h.output
        if affected is not None and affected[0] == policy.FAILED and message is not None:
            out = patches.error_output(h.req_id, message)
        elif message is not None and out is not None:
            out.stop_reason = message
        extra = {"tokens_streamed": h.streamed()} if affected is not None and h.streaming else {}
        self._release(h.req_id, **extra)
        return h.client_index, out

    def take_pending_failures(self) -> dict[str, str]:
        """Requests the guard must end itself (not those the finish check holds: their held
        output is replaced when it is released)."""
        failures, self.pending_failures = self.pending_failures, {}
        if self.finish is not None and self.finish.held:
            for req_id in [r for r in failures if r in self.finish.held]:
                self.pending_failures[req_id] = failures.pop(req_id)
        return failures

    def stats(self) -> dict[str, Any] | None:
        """The metric delta since the last call, or None when nothing happened."""
        self._report_state()
        if self.counters.empty():
            return None
        self.counters.add("guard_seconds", self.hook_seconds, label="scheduler")
        self.hook_seconds = 0.0
        delta = self.counters.take()
        if self.exporter is not None:
            self.exporter.observe(delta)
        return delta

    def shutdown(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
