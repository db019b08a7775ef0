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

from collections.abc import Iterable

import numpy as np

from vllm_kvguard.core.compiled import compiled
from vllm_kvguard.core.plan import (
    FILLING,
    FREE,
    NO_BLOCKS,
    NO_FLAGS,
    QUARANTINED,
    SEALED,
    Decoded,
    Decodes,
    LifecycleViolation,
    PageBatch,
    ScheduledRequest,
    StepPlan,
    Violation,
    block_array,
)
from vllm_kvguard.core.reads import ReadSweep


class BlockLedger(ReadSweep):
    """What the scheduler knows about every KV block (module docstring); :meth:`plan` a step."""

    # ------------------------------------------------------------ block-table mirror

    # ------------------------------------------------------------------ the step's plan

    def plan(
        self,
        requests: Iterable[ScheduledRequest],
        read_budget: int | None = 0,
        now: float = 0.0,
        released: Iterable[str] = (),
        decodes: Decodes | None = None,
    ) -> StepPlan:
        """Plan one step. ``read_budget``: how many pages that running requests read this
        step to verify as well (0: none; None: all of them, the paranoid policy); with
        ``read_every`` N > 1, N times as many on every Nth step and none on the others.
        ``released``: requests that gave their blocks back since the last step
        (preempted), before this step's allocations. ``decodes``: running requests that only
        write one token into a page they hold, as arrays (the rest come as ``requests``)."""
        requests = list(requests)
        for req_id in released:
            self.release_request(req_id)
        self.step += 1
        if read_budget and self.read_every > 1:
            # Sampled reads batched: the same pages per step on average, on one step in
            # read_every (a page read on every step is verified at least once every
            # read_every x ceil(pages read per step / (read_every x budget)) steps).
            read_budget = read_budget * self.read_every if self.step % self.read_every == 0 else 0
        plan = StepPlan(self.step)
        bs = self.block_size
        # The rows the views' requests write, and the pages they begin: an array per request
        # (a prefill's thousands of tokens are never a Python int each).
        rows_b: list[np.ndarray] = []
        rows_s: list[np.ndarray] = []
        started: list[np.ndarray] = []
        # Allocations first: a request may hit, in this same step, a block that a request
        # listed after it is given (vLLM caches a block as soon as its tokens are scheduled).
        for req in requests:
            new = req.new_block_ids
            if req.fresh or req.req_id not in self._row_of:
                self._set_table(req.req_id, req.block_ids())
            elif len(new):
                self._set_table(req.req_id, new, int(self._table_len[self._row_of[req.req_id]]))
            if len(new):
                blocks = block_array(new)
                self._allocate(req.req_id, blocks, plan)
                plan.given.extend(blocks.tolist())
                start = int(self._table_len[self._row_of[req.req_id]]) - len(blocks)
                plan.given_pages.append((req.req_id, np.arange(start, start + len(blocks)), blocks))
            if req.num_new:
                self._written(req, rows_b, rows_s, started)
        d_blocks = d_slots = d_index = col = NO_BLOCKS
        # Pages the decodes fill and begin this step, decodes with no full page (-1: not
        # counted, numpy looks).
        fills = begun_count = short = -1
        decoded = None
        if decodes is not None and len(decodes):
            d_index, d_rows, fetched = self._decode_rows(decodes)
            if decodes.grown is not None and len(decodes.grown):
                self._grow(decodes, d_index, d_rows, fetched, plan)
            nc = decodes.num_computed
            placed = self._place_decodes(nc, d_rows)
            if placed is not None:  # the usual step: one compiled call
                d_blocks, d_slots, col, fills, begun_count, short = placed
            else:
                col = nc // bs
                over = col >= self._table_len[d_rows]
                if np.count_nonzero(over):
                    for i in np.flatnonzero(over).tolist():  # a table the views did not show whole
                        req_id = decodes.req_ids[d_index[i]]
                        self._set_table(req_id, decodes.block_ids(req_id))
                    known = col < self._table_len[d_rows]
                    d_index, d_rows, col, nc = d_index[known], d_rows[known], col[known], nc[known]
                d_blocks = self._table[d_rows, col].astype(np.int64)
                d_slots = nc % bs
            decoded = Decoded(decodes.req_ids, d_index, nc, d_rows, short)
        for req in requests:
            hits = req.num_computed // bs if req.fresh else 0
            first_sealed = req.num_computed // bs
            last_sealed = (req.num_computed + req.num_new) // bs
            if not hits and last_sealed <= first_sealed:
                continue
            table = self.table(req.req_id)
            if hits:
                hit = table[:hits].astype(np.int64)
                self._hit(req.req_id, hit, plan)
                plan.hit_pages.append((req.req_id, hit))
            if last_sealed > first_sealed:
                self._seal(req.req_id, table[first_sealed:last_sealed].astype(np.int64), first_sealed, plan)
        # Views' pages sealed before the decodes' (marked verified apart where the decodes' are
        # closed in one compiled call).
        view_seals = len(plan.seal)
        closed = self._close_decodes(decodes, d_index, d_blocks, d_slots, col, fills, begun_count, now, plan)
        if closed is not None:
            begun = closed
        else:
            begun = d_blocks[d_slots == 0] if len(d_blocks) and begun_count else NO_BLOCKS
            fill = np.flatnonzero(d_slots == bs - 1) if len(d_blocks) and fills else NO_BLOCKS
            if len(fill):
                # Pages whose last slot a decode writes: sealed after the forward (one entry per
                # request that fills one: what changed).
                assert decodes is not None
                fill = fill[self.state[d_blocks[fill]] != QUARANTINED]
                self._sealed(d_blocks[fill], plan)
                if len(fill):
                    names = decodes.req_ids
                    plan.sealed_decodes = PageBatch(
                        [names[i] for i in d_index[fill].tolist()], col[fill], d_blocks[fill]
                    )
        if rows_b:
            plan.written_blocks = np.concatenate([*rows_b, d_blocks])
            plan.written_slots = np.concatenate([*rows_s, d_slots])
        else:  # a step of decodes only
            plan.written_blocks, plan.written_slots = d_blocks, d_slots
        plan.started = np.concatenate([*started, begun]) if started else begun
        if closed is not None:  # the decodes' pages are marked already: the views' only
            if view_seals or plan.verify or started:
                views = [block_array(plan.seal[:view_seals]), block_array(plan.verify), *started]
                self.mark_verified(np.concatenate(views), now)
        elif plan.seal or plan.verify or len(plan.started):
            self.mark_verified(
                np.concatenate([block_array(plan.seal), block_array(plan.verify), plan.started]), now
            )
        if read_budget != 0:
            running = [(r.req_id, r.num_computed) for r in requests if not r.fresh and r.num_computed >= bs]
            plan.read_verify, plan.read_partial = self._reads(running, decoded, read_budget, now)
        return plan

    def _close_decodes(
        self,
        decodes: Decodes | None,
        d_index: np.ndarray,
        d_blocks: np.ndarray,
        d_slots: np.ndarray,
        col: np.ndarray,
        fills: int,
        begun_count: int,
        now: float,
        plan: StepPlan,
    ) -> np.ndarray | None:
        """The decodes' pages filled (sealed) and begun, both marked verified, in one compiled
        call (``_plankernels.close_decodes``) where the compiled placement counted them; returns
        the blocks begun, or None, with nothing changed, for the numpy path."""
        if decodes is None or fills < 0 or begun_count < 0:
            return None  # no decodes, or placed by the numpy path: it closes them too
        if not fills and not begun_count:
            return NO_BLOCKS
        kernels = compiled()
        if kernels is None:
            return None
        n = len(d_blocks)
        fill_out = np.empty(n, dtype=np.int64)
        begun_out = np.empty(n, dtype=np.int64)
        n_fill, n_begun = kernels.close_decodes(
            d_blocks,
            d_slots,
            self.block_size,
            self.state,
            self.generation,
            self.writer_of,
            self.checked_at,
            self.verified_step,
            self.verified_before,
            float(now),
            self.step,
            fill_out,
            begun_out,
        )
        if n_fill < 0:
            return None
        if n_fill:
            fill = fill_out[:n_fill]
            blocks = d_blocks[fill]
            plan.seal.extend(blocks.tolist())
            names = decodes.req_ids
            plan.sealed_decodes = PageBatch([names[i] for i in d_index[fill].tolist()], col[fill], blocks)
        return d_blocks[begun_out[:n_begun]] if n_begun else NO_BLOCKS

    def _grow(
        self,
        decodes: Decodes,
        d_index: np.ndarray,
        d_rows: np.ndarray,
        fetched: np.ndarray | None,
        plan: StepPlan,
    ) -> None:
        """Decodes given one new block this step: append it to each one's mirrored table
        (unless the table was just read whole from vLLM, which has it already) and allocate
        them all at once, as the views path does one request at a time."""
        assert decodes.grown is not None and decodes.grown_blocks is not None
        names = decodes.req_ids
        req_ids = [names[i] for i in d_index[decodes.grown].tolist()]
        if self._grow_compiled(decodes, d_rows, fetched, req_ids, plan):
            return
        grown, blocks = decodes.grown, decodes.grown_blocks.astype(np.int64)
        rows = d_rows[grown]
        ends = self._table_len[rows]
        append = np.ones(len(grown), dtype=bool) if fetched is None else ~fetched[grown]
        if np.count_nonzero(append):
            self._widen(int(ends[append].max()) + 1)
            self._table[rows[append], ends[append]] = blocks[append]
            self._table_len[rows[append]] += 1
            ends = ends + append
        positions = ends - 1
        self._allocate_many(req_ids, blocks, plan)
        plan.given.extend(blocks.tolist())
        plan.given_decodes = PageBatch(req_ids, positions, blocks)

    def _grow_compiled(
        self,
        decodes: Decodes,
        d_rows: np.ndarray,
        fetched: np.ndarray | None,
        req_ids: list[str],
        plan: StepPlan,
    ) -> bool:
        """:meth:`_grow` in one compiled call (the tables' appends and the hand-out of every
        block: ``_plankernels.grow_decodes``); False, with nothing changed, where numba is
        missing, the arrays are of other kinds, or a block needs the audit's rare cases (the
        numpy path then)."""
        kernels = compiled()
        grown, blocks = decodes.grown, decodes.grown_blocks
        assert grown is not None and blocks is not None
        if (
            kernels is None
            or grown.dtype != np.int64
            or blocks.dtype != np.int64
            or d_rows.dtype != np.int64
            or not (grown.flags.c_contiguous and blocks.flags.c_contiguous and d_rows.flags.c_contiguous)
            or (fetched is not None and (fetched.dtype != np.bool_ or not fetched.flags.c_contiguous))
        ):
            return False
        numbers = np.fromiter(map(self._number, req_ids), dtype=np.int64, count=len(req_ids))
        blocks = blocks.copy()  # kept in the holders' lists: not the caller's array
        n = len(blocks)
        positions = np.empty(n, dtype=np.int64)
        sealed_out = np.empty(n, dtype=np.int8)
        for _ in range(2):
            status, value = kernels.grow_decodes(
                grown,
                blocks,
                d_rows,
                NO_FLAGS if fetched is None else fetched,
                fetched is not None,
                self._table,
                self._table_len,
                numbers,
                self.state,
                self.fingerprint,
                self.verified_step,
                self.verified_before,
                self.previous_key,
                self.owner_key,
                self.lost_evidence,
                self.writer_of,
                self.held,
                positions,
                sealed_out,
            )
            if status != 2:
                break
            self._widen(value)  # the mirror's columns grow on demand, then the same call again
        if status != 0:
            return False
        if value:  # cached pages left the prefix cache for their new writers
            for i in np.flatnonzero(sealed_out).tolist():
                plan.forget.append(int(blocks[i]))
            for i in np.flatnonzero(sealed_out == 2).tolist():
                self._taken_from_reader(int(blocks[i]), req_ids[i])
        given = self._given
        for i, number in enumerate(numbers.tolist()):
            given.setdefault(number, []).append(blocks[i : i + 1])
        self._given_count += n
        plan.given.extend(blocks.tolist())
        plan.given_decodes = PageBatch(req_ids, positions, blocks)
        return True

    def _allocate_many(self, req_ids: list[str], blocks: np.ndarray, plan: StepPlan) -> None:
        """:meth:`_allocate` of one block each for many requests, in a few numpy calls. The
        audit's rare cases (a block given twice, a quarantined block, one still being written)
        go through :meth:`_allocate` one request at a time, with its messages."""
        states = self.state[blocks]
        odd = (states == QUARANTINED) | (states == FILLING)
        # (A set, not np.unique: docs/design/decisions.md, "The GIL".)
        if np.count_nonzero(odd) or len(set(blocks.tolist())) != len(blocks):
            for i, req_id in enumerate(req_ids):
                self._allocate(req_id, blocks[i : i + 1], plan)
            return
        sealed = states == SEALED
        if np.count_nonzero(sealed):
            plan.forget.extend(blocks[sealed].tolist())
            for i in np.flatnonzero(sealed & (self.held[blocks] > 0)).tolist():
                self._taken_from_reader(int(blocks[i]), req_ids[i])
        numbers = [self._number(r) for r in req_ids]
        self._owned(blocks, numbers)
        self.held[blocks] += 1  # (each block once: checked above)
        given = self._given
        for i, number in enumerate(numbers):
            given.setdefault(number, []).append(blocks[i : i + 1])
        self._given_count += len(numbers)

    def _seal(self, req_id: str, blocks: np.ndarray, first: int, plan: StepPlan) -> None:
        """``req_id``'s pages ``first``.. (``blocks``) are full after this step's forward."""
        keep = self.state[blocks] != QUARANTINED
        blocks = blocks[keep]
        self._sealed(blocks, plan)
        positions = np.arange(first, first + len(keep), dtype=np.int64)[keep]
        plan.sealed_pages.append((req_id, positions, blocks))

    def _sealed(self, blocks: np.ndarray, plan: StepPlan) -> None:
        self.state[blocks] = SEALED
        self.generation[blocks] += 1
        self.writer_of[blocks] = -1
        plan.seal.extend(blocks.tolist())

    def _written(
        self,
        req: ScheduledRequest,
        blocks: list[np.ndarray],
        slots: list[np.ndarray],
        started: list[np.ndarray],
    ) -> None:
        """The (block, slot) rows the step's forward writes for ``req``, and the pages it begins,
        appended as arrays."""
        bs = self.block_size
        first, end = req.num_computed, req.num_computed + req.num_new
        table = self.table(req.req_id)
        if (end - 1) // bs >= len(table):
            self._set_table(req.req_id, req.block_ids())  # a table the views did not show whole
            table = self.table(req.req_id)
            if (end - 1) // bs >= len(table):
                return
        positions = np.arange(first, end, dtype=np.int64)
        written = table[positions // bs].astype(np.int64)
        at = positions % bs
        blocks.append(written)
        slots.append(at)
        if first % bs == 0 or req.num_new > bs - first % bs:
            started.append(written[at == 0])

    def _allocate(self, req_id: str, blocks: np.ndarray, plan: StepPlan) -> None:
        states = self.state[blocks]
        quarantined = states == QUARANTINED
        if np.count_nonzero(quarantined):
            for block in blocks[quarantined].tolist():
                self.violations.append(LifecycleViolation(block, req_id, Violation.QUARANTINED_ALLOCATED))
            blocks, states = blocks[~quarantined], states[~quarantined]
        sealed = states == SEALED
        if np.count_nonzero(sealed):
            plan.forget.extend(blocks[sealed].tolist())
            # A full page leaves the prefix cache for a new writer only when nobody holds it:
            # one still in a live request's block table is being taken from its reader.
            for block in blocks[sealed & (self.held[blocks] > 0)].tolist():
                self._taken_from_reader(block, req_id)
        filling = blocks[states == FILLING]
        if len(filling):
            holders = self.writer_of[filling]
            me = self._numbers.get(req_id, -2)
            stolen = (holders >= 0) & (holders != me)
            for block, holder in zip(filling[stolen].tolist(), holders[stolen].tolist(), strict=True):
                name = self._names[holder]
                if not self._released(name, block):
                    self.violations.append(
                        LifecycleViolation(block, req_id, Violation.DOUBLE_ALLOCATION, name)
                    )
        self._own(blocks, req_id)

    def _hit(self, req_id: str, blocks: np.ndarray, plan: StepPlan) -> None:
        states = self.state[blocks]
        for block in blocks[states == SEALED].tolist():
            readers = plan.readers.get(block)
            if readers is None:
                plan.readers[block] = [req_id]
                plan.verify.append(block)
            else:
                readers.append(req_id)
        quarantined = states == QUARANTINED
        if np.count_nonzero(quarantined):
            for block in blocks[quarantined].tolist():
                self.violations.append(LifecycleViolation(block, req_id, Violation.QUARANTINED_REUSED))
        # Filled by another request in this same step (not sealed yet), or loaded by
        # another KV connector: read without a seal to verify against.
        unsealed = (states == FILLING) | (states == FREE)
        plan.unverified_hits += int(np.count_nonzero(unsealed))
        free = states == FREE
        if np.count_nonzero(free):
            self.state[blocks[free]] = FILLING
            self.writer_of[blocks[free]] = self._number(req_id)
        self._hold(self._number(req_id), blocks)

    def release_request(self, req_id: str) -> None:
        """A request gave its blocks back (finished or preempted): the blocks it was
        still writing hold nothing anyone may read, so they are free again."""
        row = self._row_of.pop(req_id, None)
        if row is not None:
            self._table_len[row] = 0
            self._free_rows.append(row)
            self._last_decodes = None
        number = self._numbers.pop(req_id, None)
        if number is None:
            return
        del self._names[number]
        given = self._given.pop(number, None)
        if not given:
            return
        blocks = np.concatenate(given)
        self._given_count -= len(blocks)
        np.subtract.at(self.held, blocks, 1)
        np.maximum(self.held, 0, out=self.held)
        mine = blocks[self.writer_of[blocks] == number]
        self.writer_of[mine] = -1
        self.state[mine[self.state[mine] == FILLING]] = FREE
