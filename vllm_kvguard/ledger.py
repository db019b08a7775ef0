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
from enum import IntEnum
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


@dataclass(frozen=True)
class LifecycleViolation:
    """A block used in a way the ledger says is impossible (a scheduler bug)."""

    block_id: int
    req_id: str
    what: str


class BlockLedger:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.state = np.zeros(num_blocks, dtype=np.uint8)
        self.generation = np.zeros(num_blocks, dtype=np.uint32)
        self.step = 0
        self.violations: list[LifecycleViolation] = []
        self._read_cursor = 0
        self._read_window: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.state)

    def quarantined(self) -> int:
        return int(np.count_nonzero(self.state == BlockState.QUARANTINED))

    def plan(self, requests: Iterable[ScheduledRequest], read_budget: int | None = 0) -> StepPlan:
        """Plan one step. ``read_budget``: how many pages that running requests read this
        step to verify as well (0: none; None: all of them, the paranoid policy)."""
        requests = list(requests)
        self.step += 1
        plan = StepPlan(self.step)
        bs = self.block_size
        state = self.state
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
                            LifecycleViolation(block, req.req_id, "quarantined block reused")
                        )
                    else:
                        # Filled by another request in this same step: not sealed yet.
                        plan.unverified_hits += 1
            for block in req.new_block_ids:
                s = state[block]
                if s == BlockState.QUARANTINED:
                    self.violations.append(
                        LifecycleViolation(block, req.req_id, "quarantined block allocated")
                    )
                    continue
                if s == BlockState.SEALED:
                    plan.forget.append(block)
                state[block] = BlockState.FILLING
            if last_sealed > first_sealed:
                assert table is not None
                for block in table[first_sealed:last_sealed]:
                    if state[block] != BlockState.QUARANTINED:
                        state[block] = BlockState.SEALED
                        self.generation[block] += 1
                        plan.seal.append(block)
        if read_budget != 0:
            running = [r for r in requests if not r.fresh and r.num_computed >= bs]
            plan.read_verify = self._reads(running, read_budget)
        return plan

    def _reads(self, running: list[ScheduledRequest], budget: int | None) -> list[int]:
        """Sealed pages this step's attention reads, all of them or a rotating sample.

        Sampling rotates over requests and, inside a request longer than the budget,
        over its pages, so a page read on every step is verified at least once every
        ceil(pages read per step / budget) steps.
        """
        bs = self.block_size
        if not running:
            return []
        chosen: list[Sequence[int]] = []
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
        ids = ids[self.state[ids] == BlockState.SEALED]
        _, first = np.unique(ids, return_index=True)
        return ids[np.sort(first)].tolist()

    def quarantine(self, block_ids: Iterable[int]) -> list[int]:
        """Mark blocks quarantined; return those that were not already."""
        new = [b for b in dict.fromkeys(block_ids) if self.state[b] != BlockState.QUARANTINED]
        self.state[new] = BlockState.QUARANTINED
        return new

    def release(self, block_ids: Iterable[int]) -> None:
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
