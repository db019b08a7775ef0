"""The block ledger: what the scheduler knows about every KV block, step by step.

Each block is ``FREE`` (never written since start-up), ``FILLING`` (allocated to a
request that is writing it), ``SEALED`` (full, its digest taken right after the
forward that wrote its last slot) or ``QUARANTINED`` (failed verification; kept
out of the prefix cache and never handed out again). Each seal starts a new
*generation* of the block so that a digest is always tied to one writing.

The ledger turns one scheduler step into a :class:`StepPlan` for the workers:
which blocks to seal after the forward, which digests to forget (blocks handed
to a new writer), and which sealed blocks to verify before the forward because
a request is about to reuse them from the prefix cache. It knows nothing of
vLLM; the connector feeds it :class:`ScheduledRequest` views.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import NamedTuple

import numpy as np


class BlockState(IntEnum):
    FREE = 0
    FILLING = 1
    SEALED = 2
    QUARANTINED = 3


class ScheduledRequest(NamedTuple):
    """One request in one scheduler step, as the ledger needs to see it.

    ``num_computed`` counts tokens whose KV existed before this step; for a
    ``fresh`` request (new, or resumed after preemption) those are prefix-cache
    hits that this step will read. ``num_new`` tokens get their KV written this
    step (draft tokens excluded: they may be rejected and rewritten).
    ``new_block_ids`` are the blocks allocated to it this step (for a fresh
    request: all its blocks past the hits). ``block_ids`` returns the request's
    whole block table; it is only called when needed. (A NamedTuple: one is built
    per scheduled request per step, and a frozen dataclass costs several times more.)
    """

    req_id: str
    num_computed: int
    num_new: int
    fresh: bool
    new_block_ids: Sequence[int]
    block_ids: Callable[[], Sequence[int]]


@dataclass
class StepPlan:
    step: int
    seal: list[int] = field(default_factory=list)
    forget: list[int] = field(default_factory=list)
    verify: list[int] = field(default_factory=list)
    readers: dict[int, list[str]] = field(default_factory=dict)
    read_verify: list[int] = field(default_factory=list)
    unverified_hits: int = 0


class Violation(StrEnum):
    """How a block was misused (the ``what`` of ``kv_block_lifecycle_violation``)."""

    DOUBLE_ALLOCATION = "allocated_while_held"  # handed to a request while another still writes it
    QUARANTINED_ALLOCATED = "quarantined_block_allocated"
    QUARANTINED_REUSED = "quarantined_block_reused"
    FREE_BLOCK_READ = "free_block_in_block_table"  # stale block table


@dataclass(frozen=True)
class LifecycleViolation:
    """A block used in a way the ledger says is impossible (a scheduler bug).

    ``req_id`` is the request the block was just given to (or that reads it);
    ``holder`` the request the ledger says still owns it, if any.
    """

    block_id: int
    req_id: str
    what: Violation
    holder: str | None = None


class BlockLedger:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.state = np.zeros(num_blocks, dtype=np.uint8)
        self.generation = np.zeros(num_blocks, dtype=np.uint32)
        # When each block was last sealed or verified (the caller's clock): scrub age.
        self.checked_at = np.zeros(num_blocks, dtype=np.float64)
        # Who writes each FILLING block, and the reverse: the lifecycle audit.
        self.writer: dict[int, str] = {}
        self._writing: dict[str, set[int]] = {}
        self.step = 0
        self.violations: list[LifecycleViolation] = []
        self._read_cursor = 0
        self._read_window: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.state)

    def quarantined(self) -> int:
        return int(np.count_nonzero(self.state == BlockState.QUARANTINED))

    def plan(
        self,
        requests: Iterable[ScheduledRequest],
        read_budget: int | None = 0,
        now: float = 0.0,
        released: Iterable[str] = (),
    ) -> StepPlan:
        """Plan one step. ``read_budget``: how many pages that running requests read this
        step to verify as well (0: none; None: all of them, the paranoid policy).
        ``released``: requests that gave their blocks back since the last step
        (preempted), before this step's allocations."""
        requests = list(requests)
        for req_id in released:
            self.release_request(req_id)
        self.step += 1
        plan = StepPlan(self.step)
        bs = self.block_size
        state = self.state
        writer = self.writer
        # Allocations first: a request may hit, in this same step, a block that a request
        # listed after it is given (vLLM caches a block as soon as its tokens are scheduled).
        for req in requests:
            for block in req.new_block_ids:
                s = state[block]
                if s == BlockState.QUARANTINED:
                    self.violations.append(
                        LifecycleViolation(block, req.req_id, Violation.QUARANTINED_ALLOCATED)
                    )
                    continue
                if s == BlockState.SEALED:
                    plan.forget.append(block)
                elif s == BlockState.FILLING:
                    holder = writer.get(block)
                    if holder is not None and holder != req.req_id:
                        self.violations.append(
                            LifecycleViolation(block, req.req_id, Violation.DOUBLE_ALLOCATION, holder)
                        )
                        self._writing[holder].discard(block)
                state[block] = BlockState.FILLING
                self._own(block, req.req_id)
        for req in requests:
            hits = req.num_computed // bs if req.fresh else 0
            first_sealed = req.num_computed // bs
            last_sealed = (req.num_computed + req.num_new) // bs
            table: Sequence[int] | None = None
            if hits or last_sealed > first_sealed:
                table = req.block_ids()
            if hits:
                assert table is not None
                for block in table[:hits]:
                    s = state[block]
                    if s == BlockState.SEALED:
                        readers = plan.readers.get(block)
                        if readers is None:
                            plan.readers[block] = [req.req_id]
                            plan.verify.append(block)
                        else:
                            readers.append(req.req_id)
                    elif s == BlockState.QUARANTINED:
                        self.violations.append(
                            LifecycleViolation(block, req.req_id, Violation.QUARANTINED_REUSED)
                        )
                    else:
                        # Filled by another request in this same step (not sealed yet), or
                        # loaded by another KV connector: not verified.
                        plan.unverified_hits += 1
                        if s == BlockState.FREE:
                            state[block] = BlockState.FILLING
                            self._own(block, req.req_id)
            if last_sealed > first_sealed:
                assert table is not None
                for block in table[first_sealed:last_sealed]:
                    if state[block] != BlockState.QUARANTINED:
                        state[block] = BlockState.SEALED
                        self.generation[block] += 1
                        plan.seal.append(block)
                        holder = writer.pop(block, None)
                        if holder is not None:
                            self._writing[holder].discard(block)
        if plan.seal or plan.verify:
            self.checked_at[plan.seal + plan.verify] = now
        if read_budget != 0:
            running = [r for r in requests if not r.fresh and r.num_computed >= bs]
            plan.read_verify = self._reads(running, read_budget, now)
        return plan

    def _own(self, block: int, req_id: str) -> None:
        self.writer[block] = req_id
        blocks = self._writing.get(req_id)
        if blocks is None:
            self._writing[req_id] = {block}
        else:
            blocks.add(block)

    def release_request(self, req_id: str) -> None:
        """A request gave its blocks back (finished or preempted): the blocks it was
        still writing hold nothing anyone may read, so they are free again."""
        for block in self._writing.pop(req_id, ()):
            if self.writer.get(block) == req_id:
                del self.writer[block]
                if self.state[block] == BlockState.FILLING:
                    self.state[block] = BlockState.FREE

    def oldest_unverified_age(self, now: float) -> float:
        """Seconds since the least recently sealed-or-verified sealed page was checked."""
        sealed = self.state == BlockState.SEALED
        if not sealed.any():
            return 0.0
        return max(0.0, now - float(self.checked_at[sealed].min()))

    def _reads(self, running: list[ScheduledRequest], budget: int | None, now: float) -> list[int]:
        """Sealed pages this step's attention reads, all of them or a rotating sample.

        Sampling rotates over requests and, inside a request longer than the budget,
        over its pages, so a page read on every step is verified at least once every
        ceil(pages read per step / budget) steps.
        """
        bs = self.block_size
        if not running:
            return []
        chosen: list[Sequence[int]] = []
        owners: list[str] = []
        count = len(running)
        start = self._read_cursor % count
        left = budget
        for i in range(count):
            req = running[(start + i) % count]
            table = req.block_ids()[: req.num_computed // bs]
            if left is not None and len(table) > left:
                offset = self._read_window.get(req.req_id, 0) % len(table)
                table = (list(table[offset:]) + list(table[:offset]))[:left]
                self._read_window[req.req_id] = offset + left
            chosen.append(table)
            owners.append(req.req_id)
            if left is not None:
                left -= len(table)
                if left <= 0:
                    self._read_cursor = start + i + 1
                    break
        else:
            self._read_cursor = start + 1
        if len(self._read_window) > 4 * count + 64:
            live = {r.req_id for r in running}
            self._read_window = {k: v for k, v in self._read_window.items() if k in live}
        # One numpy pass instead of a Python test per page: keep sealed pages, first
        # occurrence of each (pages shared by several requests are read once).
        ids = np.fromiter(itertools.chain.from_iterable(chosen), dtype=np.int64)
        states = self.state[ids]
        if (states == BlockState.FREE).any():
            # A computed block of a running request that the ledger saw released: a
            # stale block table. Rare, so the owner lookup is per block here.
            which = np.repeat(np.arange(len(chosen)), [len(t) for t in chosen])
            for i in np.flatnonzero(states == BlockState.FREE).tolist():
                self.violations.append(
                    LifecycleViolation(int(ids[i]), owners[which[i]], Violation.FREE_BLOCK_READ)
                )
        ids = ids[states == BlockState.SEALED]
        _, first = np.unique(ids, return_index=True)
        ids = ids[np.sort(first)]
        self.checked_at[ids] = now
        return ids.tolist()

    def quarantine(self, block_ids: Iterable[int]) -> list[int]:
        """Mark blocks quarantined; return those that were not already."""
        new = [b for b in dict.fromkeys(block_ids) if self.state[b] != BlockState.QUARANTINED]
        self.state[new] = BlockState.QUARANTINED
        return new

    def release_quarantined(self, block_ids: Iterable[int]) -> None:
        """Return quarantined blocks to circulation (the quarantine is full)."""
        blocks = list(block_ids)
        self.state[blocks] = BlockState.FREE

    def idle_sealed(self, in_use: Callable[[int], bool]) -> list[int]:
        """Sealed blocks that no request holds: pages at rest (fault-injection targets)."""
        sealed = np.flatnonzero(self.state == BlockState.SEALED).tolist()
        return [b for b in sealed if not in_use(b)]

    def take_violations(self) -> list[LifecycleViolation]:
        out, self.violations = self.violations, []
        return out
