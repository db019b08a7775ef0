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
    # Page identity (connector/scheduler.py): per request, the positions in its block table
    # and the blocks of the pages it sealed this step, and of the prefix-cache hits it reads.
    sealed_pages: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    hit_pages: list[tuple[str, np.ndarray]] = field(default_factory=list)
    # Row digests (digest/rows.py): blocks handed to a new owner this step (their rows become
    # the previous generation's), the (block, slot) rows this step's forward writes, and the
    # unfilled pages of running requests to verify (their rows written in earlier steps).
    given: list[int] = field(default_factory=list)
    written_blocks: list[int] = field(default_factory=list)
    written_slots: list[int] = field(default_factory=list)
    read_partial: list[int] = field(default_factory=list)
    # Pages whose first slot this step writes: every row they hold is known good after it.
    started: list[int] = field(default_factory=list)
    # Per request with pages handed out this step: (request, positions in its table, blocks).
    given_pages: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)


class Violation(StrEnum):
    """How a block was misused (the ``what`` of ``kv_block_lifecycle_violation``)."""

    DOUBLE_ALLOCATION = "allocated_while_held"  # handed to a request while another still writes it
    QUARANTINED_ALLOCATED = "quarantined_block_allocated"
    QUARANTINED_REUSED = "quarantined_block_reused"
    FREE_BLOCK_READ = "free_block_in_block_table"  # stale block table


@dataclass(frozen=True)
class IdentityMismatch:
    """A prefix-cache hit on a page sealed for other inputs (``kv_block_identity_mismatch``).

    ``position``: the page's index in the reader's block table; ``expected``: the reader's
    own fingerprint for that position; ``found``: the fingerprint the page was sealed with,
    by ``sealed_by``."""

    block_id: int
    position: int
    req_id: str
    expected: int
    found: int
    sealed_by: str


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
        # The step of each block's last seal or planned verification, and the one before it:
        # a detection at step S tells how long the page went unverified while it was read
        # (:meth:`last_good_step`). -1: never.
        self.verified_step = np.full(num_blocks, -1, dtype=np.int64)
        self.verified_before = np.full(num_blocks, -1, dtype=np.int64)
        # How many live requests hold each block in their block table (given or hit): a
        # block handed out while one does is a use-after-free, full pages included.
        self.held = np.zeros(num_blocks, dtype=np.int32)
        # What each sealed page holds (digest/identity.py; 0: unknown) and who sealed it.
        self.fingerprint = np.zeros(num_blocks, dtype=np.uint64)
        self.sealed_by = np.full(num_blocks, "", dtype=object)
        # Who writes each FILLING block (an interned request number, -1: nobody), and the
        # blocks each request was given: the lifecycle audit. Arrays, so that a step's
        # allocations and seals are a few numpy calls per request, not Python per block.
        self.writer_of = np.full(num_blocks, -1, dtype=np.int64)
        self._numbers: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._given: dict[int, list[np.ndarray]] = {}
        self._next_number = 0
        self.step = 0
        self.violations: list[LifecycleViolation] = []
        self._read_cursor = 0
        self._read_window: dict[str, int] = {}
        # Each live request's block table as vLLM handed it out (its first view, then the blocks
        # appended): where this step's rows go, without asking vLLM for the table every step.
        self._tables: dict[str, list[int]] = {}
        # Who each block was handed to (a key of the writer and page position, set by the
        # connector; 0: unknown), and the same for the block's previous owner: a row that
        # reads back as the previous owner's is a lost write only if that owner's row was
        # not the same computation (digest/identity.py).
        self.owner_key = np.zeros(num_blocks, dtype=np.uint64)
        self.previous_key = np.zeros(num_blocks, dtype=np.uint64)

    @property
    def num_blocks(self) -> int:
        return len(self.state)

    def live_requests(self) -> int:
        return len(self._numbers)

    def footprint(self) -> dict[str, int]:
        """Entries of the per-request tables (0 once every request has ended)."""
        return {
            "requests": len(self._numbers),
            "blocks_given": sum(len(a) for g in self._given.values() for a in g),
            "read_windows": len(self._read_window),
            "tables": len(self._tables),
        }

    def nbytes(self) -> int:
        """Bytes of the per-block arrays (fixed at start)."""
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray))

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
        # Allocations first: a request may hit, in this same step, a block that a request
        # listed after it is given (vLLM caches a block as soon as its tokens are scheduled).
        tables = self._tables
        for req in requests:
            new = req.new_block_ids
            if req.fresh or req.req_id not in tables:
                tables[req.req_id] = list(req.block_ids())
            elif len(new):
                tables[req.req_id].extend(new)
            if len(new):
                blocks = np.asarray(new, dtype=np.int64)
                self._allocate(req.req_id, blocks, plan)
                plan.given.extend(blocks.tolist())
                start = len(tables[req.req_id]) - len(blocks)
                plan.given_pages.append((req.req_id, np.arange(start, start + len(blocks)), blocks))
            if req.num_new:
                self._written(req, tables[req.req_id], plan)
        for req in requests:
            hits = req.num_computed // bs if req.fresh else 0
            first_sealed = req.num_computed // bs
            last_sealed = (req.num_computed + req.num_new) // bs
            if not hits and last_sealed <= first_sealed:
                continue
            table = tables[req.req_id]
            if hits:
                hit = np.asarray(table[:hits], dtype=np.int64)
                self._hit(req.req_id, hit, plan)
                plan.hit_pages.append((req.req_id, hit))
            if last_sealed > first_sealed:
                blocks = np.asarray(table[first_sealed:last_sealed], dtype=np.int64)
                keep = state[blocks] != BlockState.QUARANTINED
                blocks = blocks[keep]
                state[blocks] = BlockState.SEALED
                self.generation[blocks] += 1
                self.writer_of[blocks] = -1
                plan.seal.extend(blocks.tolist())
                positions = np.arange(first_sealed, last_sealed, dtype=np.int64)[keep]
                plan.sealed_pages.append((req.req_id, positions, blocks))
        if plan.seal or plan.verify or plan.started:
            self.mark_verified(plan.seal + plan.verify + plan.started, now)
        if read_budget != 0:
            running = [r for r in requests if not r.fresh and r.num_computed >= bs]
            plan.read_verify, plan.read_partial = self._reads(running, read_budget, now)
        return plan

    def _written(self, req: ScheduledRequest, table: list[int], plan: StepPlan) -> None:
        """The (block, slot) rows the step's forward writes for ``req``."""
        bs = self.block_size
        first, end = req.num_computed, req.num_computed + req.num_new
        if (end - 1) // bs >= len(table):
            table[:] = list(req.block_ids())  # a table the views did not show whole
            if (end - 1) // bs >= len(table):
                return
        if req.num_new == 1:
            plan.written_blocks.append(table[first // bs])
            plan.written_slots.append(first % bs)
            if first % bs == 0:
                plan.started.append(table[first // bs])
            return
        positions = np.arange(first, end)
        blocks = np.asarray(table, dtype=np.int64)[positions // bs]
        plan.written_blocks.extend(blocks.tolist())
        plan.written_slots.extend((positions % bs).tolist())
        plan.started.extend(blocks[positions % bs == 0].tolist())

    def mark_verified(self, block_ids: Sequence[int] | np.ndarray, now: float) -> None:
        """Blocks sealed or verified in the current step (one numpy pass, no Python per block)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if not len(ids):
            return
        self.checked_at[ids] = now
        last = self.verified_step[ids]
        moved = last != self.step
        self.verified_before[ids[moved]] = last[moved]
        self.verified_step[ids] = self.step

    def last_good_step(self, block_id: int, step: int) -> int:
        """The last step before ``step`` in which ``block_id`` was sealed or verified (-1: none
        known). A page found bad at ``step`` was last known good then: every forward between
        the two read it unverified."""
        last, before = int(self.verified_step[block_id]), int(self.verified_before[block_id])
        if last < step:
            return last
        return before if before < step else -1

    def _number(self, req_id: str) -> int:
        number = self._numbers.get(req_id)
        if number is None:
            number = self._numbers[req_id] = self._next_number
            self._next_number += 1
            self._names[number] = req_id
        return number

    def _own(self, blocks: np.ndarray, req_id: str) -> None:
        number = self._number(req_id)
        self.state[blocks] = BlockState.FILLING
        self.fingerprint[blocks] = 0
        # Nothing of the new owner's is known good yet (a previous life's checks do not count).
        self.verified_step[blocks] = -1
        self.verified_before[blocks] = -1
        self.previous_key[blocks] = self.owner_key[blocks]
        self.owner_key[blocks] = 0
        self.writer_of[blocks] = number
        self._hold(number, blocks)

    def _hold(self, number: int, blocks: np.ndarray) -> None:
        self.held[blocks] += 1
        self._given.setdefault(number, []).append(blocks)

    def holders_of(self, block_id: int) -> list[str]:
        """Live requests whose block table holds ``block_id`` (the rare path: a scan)."""
        return [
            self._names[number]
            for number, given in self._given.items()
            if any(block_id in blocks for blocks in given)
        ]

    def _allocate(self, req_id: str, blocks: np.ndarray, plan: StepPlan) -> None:
        states = self.state[blocks]
        quarantined = states == BlockState.QUARANTINED
        if quarantined.any():
            for block in blocks[quarantined].tolist():
                self.violations.append(LifecycleViolation(block, req_id, Violation.QUARANTINED_ALLOCATED))
            blocks, states = blocks[~quarantined], states[~quarantined]
        sealed = states == BlockState.SEALED
        if sealed.any():
            plan.forget.extend(blocks[sealed].tolist())
            # A full page leaves the prefix cache for a new writer only when nobody holds it:
            # one still in a live request's block table is being taken from its reader.
            taken = blocks[sealed & (self.held[blocks] > 0)]
            for block in taken.tolist():
                holder = next(iter(self.holders_of(block)), None)
                if holder is not None and holder != req_id:
                    self.violations.append(
                        LifecycleViolation(block, req_id, Violation.DOUBLE_ALLOCATION, holder)
                    )
        filling = blocks[states == BlockState.FILLING]
        if len(filling):
            holders = self.writer_of[filling]
            me = self._numbers.get(req_id, -2)
            stolen = (holders >= 0) & (holders != me)
            for block, holder in zip(filling[stolen].tolist(), holders[stolen].tolist(), strict=True):
                self.violations.append(
                    LifecycleViolation(block, req_id, Violation.DOUBLE_ALLOCATION, self._names[holder])
                )
        self._own(blocks, req_id)

    def _hit(self, req_id: str, blocks: np.ndarray, plan: StepPlan) -> None:
        states = self.state[blocks]
        for block in blocks[states == BlockState.SEALED].tolist():
            readers = plan.readers.get(block)
            if readers is None:
                plan.readers[block] = [req_id]
                plan.verify.append(block)
            else:
                readers.append(req_id)
        quarantined = states == BlockState.QUARANTINED
        if quarantined.any():
            for block in blocks[quarantined].tolist():
                self.violations.append(LifecycleViolation(block, req_id, Violation.QUARANTINED_REUSED))
        # Filled by another request in this same step (not sealed yet), or loaded by
        # another KV connector: read without a seal to verify against.
        unsealed = (states == BlockState.FILLING) | (states == BlockState.FREE)
        plan.unverified_hits += int(np.count_nonzero(unsealed))
        free = states == BlockState.FREE
        if free.any():
            self.state[blocks[free]] = BlockState.FILLING
            self.writer_of[blocks[free]] = self._number(req_id)
        self._hold(self._number(req_id), blocks)

    @property
    def writer(self) -> dict[int, str]:
        """{block: request writing it} for FILLING blocks (diagnostics and tests)."""
        blocks = np.flatnonzero(self.writer_of >= 0)
        return {int(b): self._names[int(self.writer_of[b])] for b in blocks}

    def release_request(self, req_id: str) -> None:
        """A request gave its blocks back (finished or preempted): the blocks it was
        still writing hold nothing anyone may read, so they are free again."""
        self._read_window.pop(req_id, None)
        self._tables.pop(req_id, None)
        number = self._numbers.pop(req_id, None)
        if number is None:
            return
        del self._names[number]
        given = self._given.pop(number, None)
        if not given:
            return
        blocks = np.concatenate(given)
        np.subtract.at(self.held, blocks, 1)
        np.maximum(self.held, 0, out=self.held)
        mine = blocks[self.writer_of[blocks] == number]
        self.writer_of[mine] = -1
        self.state[mine[self.state[mine] == BlockState.FILLING]] = BlockState.FREE

    def oldest_unverified_age(self, now: float) -> float:
        """Seconds since the least recently sealed-or-verified sealed page was checked."""
        sealed = self.state == BlockState.SEALED
        if not sealed.any():
            return 0.0
        return max(0.0, now - float(self.checked_at[sealed].min()))

    def _reads(
        self, running: list[ScheduledRequest], budget: int | None, now: float
    ) -> tuple[list[int], list[int]]:
        """Pages this step's attention reads, all of them or a rotating sample: (sealed pages,
        unfilled pages whose written rows are verified).

        Sampling rotates over requests and, inside a request longer than the budget,
        over its pages, so a page read on every step is verified at least once every
        ceil(pages read per step / budget) steps.
        """
        bs = self.block_size
        if not running:
            return [], []
        chosen: list[Sequence[int]] = []
        owners: list[str] = []
        count = len(running)
        start = self._read_cursor % count
        left = budget
        for i in range(count):
            req = running[(start + i) % count]
            whole = req.block_ids()
            computed = req.num_computed // bs
            table = list(whole[:computed])
            if req.num_computed % bs and computed < len(whole):
                # The unfilled page, one more page of the rotation: its rows written in earlier
                # steps are verified (digest/rows.py).
                table.append(whole[computed])
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
        _, first = np.unique(ids, return_index=True)
        keep = np.sort(first)
        ids, states = ids[keep], states[keep]
        partial = ids[states == BlockState.FILLING]
        ids = ids[states == BlockState.SEALED]
        self.mark_verified(ids, now)
        self.mark_verified(partial, now)
        return ids.tolist(), partial.tolist()

    def record_identity(self, req_id: str, blocks: np.ndarray, fingerprints: np.ndarray) -> None:
        """The fingerprints of pages ``req_id`` sealed (0 where not known)."""
        self.fingerprint[blocks] = fingerprints
        self.sealed_by[blocks] = req_id

    def identity_mismatches(
        self, req_id: str, blocks: np.ndarray, fingerprints: np.ndarray
    ) -> list[IdentityMismatch]:
        """Hits of ``req_id`` (its pages 0.. in ``blocks``, its own ``fingerprints`` for them)
        on pages sealed for other inputs. One numpy compare; unknown (0) on either side passes."""
        found = self.fingerprint[blocks]
        bad = (found != fingerprints) & (found != 0) & (fingerprints != 0)
        return [
            IdentityMismatch(
                int(blocks[i]), i, req_id, int(fingerprints[i]), int(found[i]), str(self.sealed_by[blocks[i]])
            )
            for i in np.flatnonzero(bad).tolist()
        ]

    def record_owners(self, blocks: np.ndarray, keys: np.ndarray) -> None:
        """Who the blocks handed out this step were handed to (see ``owner_key``)."""
        self.owner_key[blocks] = keys

    def lost_write_candidates(self, blocks: Sequence[int]) -> list[int]:
        """Of the blocks written this step, those whose previous owner computed something else at
        that page position (both owners known): a row that reads back as that owner's is then a
        lost write. Where they computed the same (a resumed or recomputed request) or either is
        unknown, equal rows are no evidence."""
        ids = np.unique(np.asarray(blocks, dtype=np.int64))
        now, before = self.owner_key[ids], self.previous_key[ids]
        return ids[(now != before) & (now != 0) & (before != 0)].tolist()

    def forget_identity(self, block_ids: Sequence[int]) -> None:
        """A page whose content is no longer what it was sealed for (being recomputed)."""
        self.fingerprint[np.asarray(block_ids, dtype=np.int64)] = 0

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
