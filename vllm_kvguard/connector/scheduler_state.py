"""The scheduler's state, and its actions on vLLM's block pool and requests: who holds a
page, evict, quarantine, zero after a failure, and each request's outcome (reported once).

The scheduler side is one class (:class:`~vllm_kvguard.connector.scheduler.KVGuardScheduler`)
built from one module per concern, each a layer over this one: :mod:`.findings` (what is done
with each finding), :mod:`.planning` (identity, loads, scrub and drill faults in the plan) and
:mod:`.scheduler` (vLLM's hooks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm_kvguard.config import KVGuardConfig, Mode, VerifyPolicy
from vllm_kvguard.connector.finish import FinishCheck
from vllm_kvguard.connector.stop_strings import StopStrings
from vllm_kvguard.core import policy
from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.core.events import (
    BlockQuarantined,
    GuardStarted,
)
from vllm_kvguard.core.faults import FaultTracker, parse_fault_spec
from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.core.plan import ScheduledRequest
from vllm_kvguard.core.scrub import Scrubber
from vllm_kvguard.digest.identity import PageIdentity, root_for
from vllm_kvguard.logs import GuardLog
from vllm_kvguard.metrics import StandaloneExporter

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager


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


class SchedulerState:
    """The scheduler side's state and its actions on vLLM (module docstring)."""

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
        weights: int = 0,
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
        # Requests with stop strings, checked where their tokens are made so that they end in
        # the engine and the finish check holds them (connector/stop_strings.py; set by the
        # facade, which has vLLM's model config, where the finish check is on).
        self.stop_strings: StopStrings | None = None
        self._output_step = -1
        # Held requests released in this step's before_output: (client, final output) to put back.
        self._released: list[tuple[int, Any]] = []
        # Requests the guard is ending this step: their tokens in the step's outputs (which
        # never leave), set around vLLM's finish_requests (facade.after_output).
        self.unsent: dict[str, int] = {}
        # Each live request's page fingerprints (what its pages hold), checked on every hit,
        # and the blocks that failed the check by step (drill accounting; dropped as settled).
        self.identity = PageIdentity(block_size, root_for(weights))
        self._identity_found: dict[int, set[int]] = {}
        # Audits of loads (connector/loaded.py): vLLM's scheduler whose "fail" load-failure policy
        # is set aside for the step being handled, and whether a connector is distrusted.
        self._fail_policy_of: Any = None
        self._distrusted = False
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
        # This output's readers of a page reported unreadable, by the step that found it: vLLM
        # drops that step's output for them and recomputes, so a page their forward wrote in that
        # step (NaN from the bad page, found non-finite) emitted nothing. Reset every output.
        self._output_dropped: dict[str, int] = {}
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
