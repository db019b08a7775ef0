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

import functools
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from vllm_kvguard.config import KVGuardConfig, Mode, VerifyPolicy
from vllm_kvguard.connector import patches
from vllm_kvguard.connector.finish import FinishCheck, Held
from vllm_kvguard.connector.metadata import (
    KVGuardMetadata,
    KVGuardWorkerMetadata,
    guard_meta,
    guard_worker_meta,
)
from vllm_kvguard.core import policy
from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.core.events import (
    BlockCorrupted,
    BlockDiagnosed,
    BlockNonFinite,
    BlockQuarantined,
    Detection,
    FaultInjected,
    FaultOutcome,
    GuardStarted,
    IdentityMismatchFound,
    LifecycleViolationFound,
    RequestAffected,
    WriteLost,
)
from vllm_kvguard.core.faults import FaultSite, FaultTracker, Injection, parse_fault_spec
from vllm_kvguard.core.ledger import (
    BlockLedger,
    BlockState,
    Decodes,
    IdentityMismatch,
    LifecycleViolation,
    ScheduledRequest,
    StepPlan,
)
from vllm_kvguard.core.scrub import Scrubber
from vllm_kvguard.core.shapes import Shape
from vllm_kvguard.digest.identity import Media, PageIdentity, RequestInputs, context_bytes
from vllm_kvguard.errors import KVCacheCorruptionError
from vllm_kvguard.logs import GuardLog, power_of_two
from vllm_kvguard.metrics import StandaloneExporter

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class RecentStep(NamedTuple):
    """What a detection coming back with a later output needs of the step it was planned in."""

    views: list[ScheduledRequest]  # the requests that changed (views)
    decoding: list[str]  # the requests that only decoded (their ids)
    readers: dict[int, list[str]]  # verified prefix-cache hits: block -> the requests that hit it


@dataclass(frozen=True)
class Holder:
    """A running request as a finding needs to see it, taken before vLLM acts on the step's
    output (vLLM frees the block tables of the requests it fails)."""

    table: list[int]
    computed_blocks: int  # blocks holding tokens computed before this step
    emits: bool  # this step samples a token for it (not a prefill chunk short of the end)


def _same(table: list[int]) -> list[int]:
    return table


def _first_group(manager: Any, req_id: str) -> list[int]:
    # The request's block table (one KV cache group: the guard is inactive with several).
    return manager.get_block_ids(req_id)[0]


def _new_view(
    new: Any, ntok: dict[str, int], spec: dict[str, Any], bs: int, local: dict[str, int] | None = None
) -> ScheduledRequest:
    table = new.block_ids[0]
    num_new = ntok[new.req_id] - len(spec.get(new.req_id, ()))
    nc, loaded = _loaded(new.req_id, new.num_computed_tokens, local)
    return ScheduledRequest(
        new.req_id, nc, num_new + loaded, True, table[nc // bs :], functools.partial(_same, table), loaded
    )


def _loaded(req_id: str, nc: int, local: dict[str, int] | None) -> tuple[int, int]:
    """A fresh request's computed tokens as the ledger sees them, and the tokens another KV
    connector loaded: of ``nc`` computed tokens only the local prefix-cache hits (``local``,
    noted when vLLM asked the connectors for matches) are pages this request reads from the
    cache; the rest were loaded into blocks it was just given, and are sealed, fingerprinted
    and row-hashed after this step like the forward's own writes."""
    if not local:
        return nc, 0
    hits = local.pop(req_id, None)
    if hits is None or hits >= nc:
        return nc, 0
    return hits, nc - hits


def _cached_view(
    cached: Any,
    i: int,
    resumed_ids: Any,
    ntok: dict[str, int],
    spec: dict[str, Any],
    bs: int,
    manager: Any,
    local: dict[str, int] | None = None,
) -> ScheduledRequest:
    req_id = cached.req_ids[i]
    new_ids = cached.new_block_ids[i]
    added = new_ids[0] if new_ids else []
    nc = cached.num_computed_tokens[i]
    num_new = ntok[req_id] - len(spec.get(req_id, ()))
    # vLLM 0.34 sends resumed requests in full with the new ones (no resumed_req_ids).
    resumed = req_id in resumed_ids
    loaded = 0
    if resumed:
        nc, loaded = _loaded(req_id, nc, local)
    return ScheduledRequest(
        req_id,
        nc,
        num_new + loaded,
        resumed,
        added[nc // bs :] if resumed else added,
        functools.partial(_first_group, manager, req_id),
        loaded,
    )


def scheduled_requests(
    so: SchedulerOutput, block_size: int, manager: Any, local: dict[str, int] | None = None
) -> list[ScheduledRequest]:
    """vLLM's scheduler output as the ledger's per-request views (across vLLM versions).
    ``local``: fresh requests' local prefix-cache hits where another connector may have loaded
    more (taken out as their views are made)."""
    spec = so.scheduled_spec_decode_tokens
    ntok = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
    views = [_new_view(new, ntok, spec, block_size, local) for new in so.scheduled_new_reqs]
    return views + [
        _cached_view(cached, i, resumed_ids, ntok, spec, block_size, manager, local)
        for i in range(len(cached.req_ids))
    ]


def step_views(
    so: SchedulerOutput, block_size: int, manager: Any, local: dict[str, int] | None = None
) -> tuple[list[ScheduledRequest], Decodes | None]:
    """vLLM's scheduler output as the ledger sees it: a view per request that changed (new,
    resumed, given several blocks, more than one token) and, as arrays, the running requests
    that only decode one token, into a page they hold or the one block they were given
    (:class:`Decodes`). The same plan as
    :func:`scheduled_requests` (tests/unit/connector/test_scheduler.py); a quiet decode step
    costs a few C-level passes over vLLM's lists, no Python per request."""
    spec = so.scheduled_spec_decode_tokens
    ntok = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    ids = cached.req_ids
    n = len(ids)
    views = [_new_view(new, ntok, spec, block_size, local) for new in so.scheduled_new_reqs]
    if not n:
        return views, None
    resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
    new_blocks = cached.new_block_ids
    total = getattr(so, "total_num_scheduled_tokens", None)
    single = not spec and total is not None and total - sum(v.num_new for v in views) == n
    grown: dict[int, int] = {}  # index -> the one block a plain decode was given
    if single and not resumed_ids and new_blocks.count(None) == n:
        changed: list[int] = []
    else:
        given = [i for i, b in enumerate(new_blocks) if b is not None]
        changed = []
        for i in given:
            added = new_blocks[i]
            assert added is not None
            if len(added) == 1 and len(added[0]) == 1:
                grown[i] = added[0][0]  # one block for its next page: still a plain decode
            else:
                changed.append(i)
        if resumed_ids:
            changed += [i for i, r in enumerate(ids) if r in resumed_ids]
        if not single:
            # Every scheduled request has a token; a step with more than one per request for
            # some (chunked prefill, drafts) sends those through the views.
            changed += [i for i, r in enumerate(ids) if ntok[r] - len(spec.get(r, ())) != 1]
        changed = sorted(set(changed))
        for i in changed:
            grown.pop(i, None)
    nc = np.fromiter(cached.num_computed_tokens, dtype=np.int64, count=n)
    at = None
    if changed:
        views += [
            _cached_view(cached, i, resumed_ids, ntok, spec, block_size, manager, local) for i in changed
        ]
        keep = np.ones(n, dtype=bool)
        keep[changed] = False
        at = np.flatnonzero(keep)
        nc = nc[at]
    if not len(nc):
        return views, None
    decodes = Decodes(ids, at, nc, functools.partial(_first_group, manager))
    if grown:
        index = np.fromiter(grown, dtype=np.int64, count=len(grown))
        if at is not None:
            index = np.searchsorted(at, index)  # positions among the decodes
        decodes.grown = index
        decodes.grown_blocks = np.fromiter(grown.values(), dtype=np.int64, count=len(grown))
    return views, decodes


def request_inputs(request: Request) -> RequestInputs:
    """What a request's pages are computed from, read from vLLM's ``Request`` by the guard
    itself (digest/identity.py): its live token list, LoRA adapter (name and path), cache
    salt, multimodal inputs (content hash and placement) and prompt embeddings."""
    lora = getattr(request, "lora_request", None)
    adapter = None
    if lora is not None:
        # Name and path: what the adapter's weights are (the numeric id is the server's handle).
        adapter = f"{getattr(lora, 'lora_name', '')}#" + str(
            getattr(lora, "lora_path", "") or getattr(lora, "path", "")
        )
    media = tuple(
        Media(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
        for f in getattr(request, "mm_features", None) or ()
        if getattr(f, "mm_position", None) is not None
    )
    embeds_tensor = getattr(request, "prompt_embeds", None)
    embeds = None
    if embeds_tensor is not None:

        def embeds(start: int, end: int) -> bytes:
            rows = embeds_tensor[start:end].detach().to("cpu").contiguous()
            return bytes(rows.view(-1).view(torch.uint8).numpy()) if rows.numel() else b""

    return RequestInputs(
        request.all_token_ids,
        context_bytes(lora=adapter, salt=getattr(request, "cache_salt", None)),
        media,
        embeds,
    )


def _slots(d: Detection) -> list[int]:
    slots = d.where.get("slots", [])
    return [int(s) for s in slots] if isinstance(slots, list) else []


class KVGuardScheduler:
    def __init__(
        self,
        config: KVGuardConfig,
        log: GuardLog,
        *,
        num_blocks: int,
        block_size: int,
        bytes_per_block: int,
        num_layers: int,
        model_name: str,
        details: dict[str, object],
        beside: list[str] | None = None,
    ) -> None:
        self.config = config
        # The KV connectors beside the guard in a MultiConnector: pages they load are checked
        # against the digests sealed here for the same inputs (digest/loads.py).
        self.beside = list(beside or ())
        self.log = log
        self.block_size = block_size
        self.internal_errors = 0
        self.hook_seconds = 0.0
        self.block_pool: BlockPool | None = None
        self.kv_cache_manager: KVCacheManager | None = None
        # Sampled reads batched every VLLM_KVGUARD_VERIFY_EVERY steps (the ledger's plan);
        # reuse and paranoid have no budget to batch.
        read_every = config.verify_every if config.verify == VerifyPolicy.SAMPLED else 1
        self.ledger = BlockLedger(num_blocks, block_size, read_every)
        self.ledger.still_held = self._still_held
        # sampled: finished requests' final outputs held until the pages they read since those
        # were last verified are verified again (connector/finish.py; None: not held). The step
        # whose output vLLM is handling (update_from_output), -1 before the first.
        self.finish: FinishCheck | None = (
            FinishCheck(self.ledger, config.rows)
            if config.verify == VerifyPolicy.SAMPLED and config.finish_check
            else None
        )
        self._output_step = -1
        # Held requests released in this step's before_output: (client, final output) to put back.
        self._released: list[tuple[int, Any]] = []
        # Each live request's page fingerprints (what its pages hold), checked on every hit,
        # and the blocks that failed the check by step (drill accounting; dropped as settled).
        self.identity = PageIdentity(block_size)
        self._identity_found: dict[int, set[int]] = {}
        self.faults = FaultTracker(parse_fault_spec(config.inject)) if config.inject else None
        self.quarantine_limit = policy.quarantine_limit(config.quarantine_max_fraction, num_blocks)
        # The message each failed or flagged request's final output carries in stop_reason
        # (patches.py puts it there), and each affected request's worst outcome so far with
        # its bad blocks: reported once, when the request finishes.
        self.stop_messages: dict[str, str] = {}
        self._affected: dict[str, tuple[str, list[int]]] = {}
        # Running requests at the step whose output is being handled (None: not taken).
        self._running: dict[str, Holder] | None = None
        # Pages of failed requests to zero before anyone is given them (next step).
        self._zero_next: list[int] = []
        # Pages of running requests to verify per step: 0 none, None all.
        self.read_budget: int | None = {
            VerifyPolicy.REUSE: 0,
            VerifyPolicy.PARANOID: None,
            VerifyPolicy.SAMPLED: max(1, config.verify_budget_bytes // max(1, bytes_per_block)),
        }[config.verify]
        self.scrubber = (
            Scrubber(config.scrub_interval_s, max(1, config.scrub_budget_bytes // max(1, bytes_per_block)))
            if config.scrub_interval_s > 0
            else None
        )
        self._scrub_behind_logged = False
        self._age_reported_at = 0.0
        self._state_reported_at = 0.0
        # Non-finite pages: blocks to report unreadable next step, and how often each
        # request was sent to recompute one (a model that writes NaN writes it again).
        self._invalidate_next: list[int] = []
        self._nonfinite_recomputes: dict[str, int] = {}
        # Requests to end with an error after this step's output (lifecycle violations).
        self.pending_failures: dict[str, str] = {}
        self.counters = GuardCounters()
        self.worker_errors_seen = 0
        # The last steps' request views, decoding request ids and verified hits (block -> the
        # requests that hit it), kept (not copied) so that a detection, which comes back with
        # that step's or the next step's output, can name its readers and count their tokens;
        # nothing is derived from them per step.
        self._recent: dict[int, RecentStep] = {}
        # Waiting requests' local prefix-cache hits, noted when vLLM asks the KV connectors for
        # external matches (facade.get_num_new_matched_tokens); taken when the request is
        # scheduled: what it is scheduled with beyond them, another connector loaded.
        self._local_hits: dict[str, int] = {}
        self.exporter = (
            StandaloneExporter(config.metrics_port, model_name, engine=log.engine)
            if config.metrics_port
            else None
        )
        self._num_layers = num_layers
        self.log.event(
            "kvguard_started",
            GuardStarted(
                "scheduler",
                config.to_dict(),
                {
                    **details,
                    "num_blocks": num_blocks,
                    "block_size": block_size,
                    "read_pages_per_step": "all" if self.read_budget is None else self.read_budget,
                    "read_every_steps": self.ledger.read_every,
                    "scrub_pages_per_step_max": self.scrubber.max_pages if self.scrubber else 0,
                },
            ),
        )
        if config.inject:
            self.log.line("kvguard_fault_injection_armed", level="warning", spec=config.inject)

    def internal_error(self, where: str, exc: Exception) -> None:
        """A hook failed (fail-open): counted and logged (1st, 2nd, 4th, ... occurrence)."""
        self.internal_errors += 1
        self.log.internal_error(where, exc, self.internal_errors)
        self.counters.add("internal_errors")

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
        if self.finish is not None and self.finish.held:
            self.finish.plan(meta, now)
        return meta

    # ------------------------------------------------------------------ page identity

    def note_request(self, request: Request) -> None:
        """A request scheduled from the waiting queue (new or resumed): read its inputs once."""
        if request.request_id not in self.identity.requests:
            self.identity.add(request.request_id, request_inputs(request))

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
            checked = np.unique(plan.written_blocks[meta.lost_write_rows]).tolist()
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
        meta = guard_worker_meta(getattr(connector_output, "kv_connector_worker_meta", None))
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
        bad: set[int] = set()  # the blocks found bad this step (the drills' accounting)
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

    def _holders(self, block: int, step: int, *, computed: bool) -> dict[str, Holder | None]:
        """Requests holding ``block`` at ``step``: in the computed part of their block table
        (``computed``: what vLLM re-checks for a bad block) or anywhere (a block being written)."""
        if self._running is not None:
            return {
                req_id: h
                for req_id, h in self._running.items()
                if block in (h.table[: h.computed_blocks] if computed else h.table)
            }
        # Without the snapshot (the update_from_output patch is missing): the step's views.
        out: dict[str, Holder | None] = {}
        recent = self._recent.get(step, RecentStep([], [], {}))
        for req_id in [r.req_id for r in recent.views] + recent.decoding:
            table = self._block_table(req_id)
            if table is not None and block in table:
                out[req_id] = None
        return out

    def _later_hitters(self, block: int, step: int) -> set[str]:
        """Requests that hit ``block`` in a step planned after ``step``. With async scheduling
        (vLLM's default on GPUs) the next step is scheduled before this step's output comes
        back, so such a request already holds the page in the computed part of its table; its
        hit is verified before the forward that reads it, so it never read the page unverified."""
        return {r for s, recent in self._recent.items() if s > step for r in recent.readers.get(block, ())}

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
            self._affect(req_id, block, outcome, message, end=self.config.mode != Mode.RAISE)
            if outcome == policy.FAILED:
                failed.add(req_id)
        self._zero_after_failure(block, holders, failed)

    def _handle_nonfinite(self, block: int, detections: list[Detection]) -> None:
        """NaN/Inf in a page just sealed: keep it from spreading, recompute once (policy.on_nonfinite).

        A writer that sampled a token in the step that wrote the page computed it from the
        NaN: recomputing cannot take it back, so it is failed or flagged, never healed."""
        first = detections[0]
        holders = self._holders(block, first.step, computed=False)
        writers = tuple(sorted(holders))
        again = any(self._nonfinite_recomputes.get(w, 0) >= 1 for w in writers)
        decision = policy.on_nonfinite(self.config.nonfinite_mode, again)
        self.counters.add("corruptions", label="nonfinite")
        self.counters.add("shapes", label="nonfinite")
        if decision.evict:
            self._evict_from_cache(block, holders)
        if decision.invalidate:
            self._invalidate_next.append(block)
        if decision.count_recompute:
            for w in writers:
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
            emitted = holder.emits if holder is not None else True
            outcome = policy.reader_outcome(
                mode, self.config.suspect, decision.outcome, read_unverified=emitted
            )
            message = KVCacheCorruptionError.describe_nonfinite(block, first.layer, outcome)
            # raise: vLLM fails the writers when the block is reported next step.
            self._affect(req_id, block, outcome, message, end=mode != Mode.RAISE)
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
            self._affect(req_id, block, outcome, message, end=self.config.mode != Mode.RAISE)
            if outcome == policy.FAILED:
                failed.add(req_id)
        self._zero_after_failure(block, holders, failed)

    def _affect(self, req_id: str, block: int, outcome: str, message: str, *, end: bool) -> None:
        """Record what happened to a request (reported once, at request_finished) and have its
        final output say so: a failed request ends with ``message`` (by the guard when ``end``:
        vLLM would only recompute it), a suspect one finishes with it in ``stop_reason``."""
        worst, blocks = self._affected.get(req_id, (None, []))
        self._affected[req_id] = (policy.worst(worst, outcome), [*blocks, block])
        if outcome == policy.FAILED:
            self.stop_messages[req_id] = message
            if end:
                self.pending_failures[req_id] = message
        elif outcome == policy.SUSPECT:
            self.stop_messages.setdefault(req_id, message)

    def _zero_after_failure(self, block: int, holders: dict[str, Holder | None], failed: set[str]) -> None:
        """Pages a failed request wrote from the bad page (its block table from the bad block
        on, the unfilled last page included) go back to the free pool with whatever that
        forward wrote, NaN/Inf included; a masked slot times NaN poisons the next owner's
        attention (0 x NaN). Zeroed before the next step's forward, unless another request
        that goes on holds them (it recomputes them itself)."""
        if not failed or self.config.mode == Mode.LOG:
            return
        keep: set[int] = set()
        zero: set[int] = set()
        for req_id, holder in holders.items():
            if holder is None:
                continue
            if req_id in failed and block in holder.table:
                zero.update(holder.table[holder.table.index(block) :])
            elif req_id not in failed:
                keep.update(holder.table)
        self._zero_next.extend(sorted(zero - keep))

    def _still_held(self, req_id: str, block: int) -> bool:
        """Whether ``req_id``'s block table in vLLM still has ``block`` (the ledger asks before
        it reports a lifecycle violation). vLLM frees the pages behind a sliding window while
        the request runs, putting its null block in their place; the null block is no page."""
        if self.kv_cache_manager is None:
            return True
        null = getattr(getattr(self.block_pool, "null_block", None), "block_id", None)
        if block == null:
            return False
        table = self._block_table(req_id)
        return table is not None and block in table

    def _block_table(self, req_id: str) -> list[int] | None:
        if self.kv_cache_manager is None:
            return None
        try:
            return list(self.kv_cache_manager.get_block_ids(req_id)[0])
        except (KeyError, AssertionError):
            return None

    def _evict_from_cache(self, block: int, holders: dict[str, Holder | None]) -> None:
        """Take ``block``, and the blocks each holder computed from it, out of the prefix cache."""
        if self.block_pool is None:
            return
        evict = {block}
        for req_id, holder in holders.items():
            table = holder.table if holder is not None else self._block_table(req_id)
            if table is not None and block in table:
                evict.update(table[table.index(block) :])
        self.block_pool.evict_blocks(evict)

    def _quarantine(self, block: int) -> None:
        assert self.block_pool is not None
        pool = self.block_pool
        if not self.ledger.quarantine([block]):
            return
        pinned = policy.pins(self.ledger.quarantined(), self.quarantine_limit)
        if pinned:
            # One reference the guard never drops: the block never returns to the
            # free queue, so it is never handed out again.
            pool.touch([pool.blocks[block]])
        else:
            self.ledger.release_quarantined([block])
            pool.evict_blocks({block})
        self.counters.set("quarantined", self.ledger.quarantined())
        extra: dict[str, Any] = (
            {} if pinned else {"reason": "quarantine full (VLLM_KVGUARD_QUARANTINE_MAX_FRACTION)"}
        )
        self.log.event(
            "kv_block_quarantined",
            BlockQuarantined(block, self.ledger.quarantined(), pinned),
            level="warning" if pinned else "error",
            **extra,
        )

    def _tokens_to_recompute(self, req_id: str, block: int) -> int:
        hits = next(
            (
                r.num_computed
                for recent in reversed(self._recent.values())
                for r in recent.views
                if r.req_id == req_id and r.fresh and r.num_computed >= self.block_size
            ),
            0,
        )
        table = self._block_table(req_id)
        if table is None or block not in table:
            return 0
        return max(0, hits - table.index(block) * self.block_size)

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
        if natural and self.finish is not None and self.kv_cache_manager is not None:
            last = self._output_step if self._output_step >= 0 else self.ledger.step
            if self.finish.hold(req_id, client_index, streaming, output_tokens, last):
                self.counters.add("finish_held")
                return True
        self._release(req_id)
        return False

    def _release(self, req_id: str, **extra: Any) -> None:
        self._local_hits.pop(req_id, None)
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
