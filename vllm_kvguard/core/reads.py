"""Which pages of running requests a step verifies (sampled and paranoid reads): the sweep
over readers in vLLM's order, resumed by name, and its bound (docs/configuration.md).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_kvguard.core.ledger_state import LedgerState
from vllm_kvguard.core.plan import (
    FILLING,
    FREE,
    NO_BLOCKS,
    SEALED,
    Decoded,
    LifecycleViolation,
    Violation,
    block_array,
)


class ReadSweep(LedgerState):
    """Which pages of running requests a step verifies (module docstring)."""

    # Up to this many are checked and marked in Python (:meth:`_few_reads`).
    _FEW_READS = 8

    def oldest_unverified_age(self, now: float) -> float:
        """Seconds since the least recently sealed-or-verified sealed page was checked."""
        sealed = self.state == SEALED
        if not np.count_nonzero(sealed):
            return 0.0
        return max(0.0, now - float(self.checked_at[sealed].min()))

    def _reads(
        self, running: list[tuple[str, int]], decoded: Decoded | None, budget: int | None, now: float
    ) -> tuple[list[int], list[int]]:
        """Pages this step's attention reads, all of them or a rotating sample: (sealed pages,
        unfilled pages whose written rows are verified). ``running``: (request, tokens computed)
        of the running requests in ``requests``; ``decodes``: the rest. Tables from the mirror.

        Sampling sweeps the readers' pages laid end to end, a page once for each reader of
        it, so while the running requests and their pages stay the same each is verified
        at least once every ceil(their pages, summed / budget) steps. It looks at as many
        requests as the budget takes, never at every running request.
        """
        bs = self.block_size
        # The decodes with a full page to read (None: all of them, as the placement counted).
        d_at: np.ndarray | None = NO_BLOCKS
        count = len(running)
        if decoded is not None:
            d_at = None if decoded.short == 0 else np.flatnonzero(decoded.nc >= bs)
            count += len(decoded.nc) if d_at is None else len(d_at)
        if not count:
            return [], []
        if budget is None:
            if decoded is not None and d_at is None:
                d_at = np.arange(len(decoded.nc))
            assert d_at is not None
            ids, owner = self._all_reads(running, decoded, d_at)
            names: list[str] = [r for r, _ in running]
            if decoded is not None:
                names += [decoded.req_ids[i] for i in decoded.at[d_at].tolist()]
        else:
            chosen: list[np.ndarray] = []
            names = []

            # One sweep over every reader's pages laid end to end (reader k's page o is where
            # the last step stopped), ``budget`` pages a step: while the readers stay the
            # same, each (reader, page) comes round every ceil(their number / budget) steps.
            def reader(k: int) -> tuple[str, int]:
                if k < len(running):
                    return running[k]
                assert decoded is not None
                j = k - len(running) if d_at is None else int(d_at[k - len(running)])
                return decoded.req_ids[decoded.at[j]], int(decoded.nc[j])

            start, start_at = self._sweep_start(count, reader)
            k, o, left = start, start_at, budget
            for i in range(count + 1):
                req_id, computed_tokens = reader(k)
                table = self._read_pages(self.table(req_id), computed_tokens)
                # Back at the first reader after a whole round: only the pages it skipped.
                end = len(table) if i < count else min(start_at, len(table))
                piece = table[o : min(end, o + left)] if o < end else table[:0]
                if len(piece):
                    chosen.append(piece)
                    names.append(req_id)
                    left -= len(piece)
                if left <= 0:
                    at = o + len(piece)
                    self._read_cursor, self._read_offset = (k, at) if at < end else ((k + 1) % count, 0)
                    after = (self._read_cursor + 1) % count
                    self._read_anchor = (reader(self._read_cursor)[0], reader(after)[0])
                    break
                k, o = (k + 1) % count, 0
            if sum(len(t) for t in chosen) <= self._FEW_READS:
                return self._few_reads(chosen, names, now)
            ids = np.concatenate(chosen).astype(np.int64) if chosen else block_array()
            owner = np.repeat(np.arange(len(chosen)), [len(t) for t in chosen])
        # One numpy pass instead of a Python test per page: keep sealed pages, first
        # occurrence of each (pages shared by several requests are read once).
        states = self.state[ids]
        if np.count_nonzero(states == FREE):
            # A computed block of a running request that the ledger saw released: a
            # stale block table. Rare, so the owner lookup is per block here.
            for i in np.flatnonzero(states == FREE).tolist():
                if not self._released(names[owner[i]], int(ids[i])):
                    self.violations.append(
                        LifecycleViolation(int(ids[i]), names[owner[i]], Violation.FREE_BLOCK_READ)
                    )
        # First occurrences in order through a dict (C-level): several times cheaper than
        # np.unique's sort on a handful of ids, and it keeps the GIL (docs/design/decisions.md,
        # "The GIL").
        ids = np.fromiter(dict.fromkeys(ids.tolist()), dtype=np.int64)
        states = self.state[ids]
        sealed, filling = states == SEALED, states == FILLING
        self.mark_verified(ids[sealed | filling], now)
        return ids[sealed].tolist(), ids[filling].tolist()

    def _sweep_start(self, count: int, reader: Callable[[int], tuple[str, int]]) -> tuple[int, int]:
        """Where this step's sweep starts: the reader it stopped at, found by name where vLLM's
        order moved it (readers before it ended, or moved from prefill to decode), else the one
        that came after it (it ended: from its first page), else the same position."""
        k = self._read_cursor % count
        anchor = self._read_anchor
        if anchor is None or reader(k)[0] == anchor[0]:
            return k, self._read_offset
        names = [reader(i)[0] for i in range(count)]
        if anchor[0] in names:
            return names.index(anchor[0]), self._read_offset
        if anchor[1] in names:
            return names.index(anchor[1]), 0
        return k, 0

    def _few_reads(
        self, chosen: list[np.ndarray], names: list[str], now: float
    ) -> tuple[list[int], list[int]]:
        """:meth:`_reads` for a sampled step's few pages (the default budget reads one or two):
        the same checks and marks in Python over the handful of ids, a few times cheaper than
        the dozen numpy calls of the general path."""
        state, step = self.state, self.step
        first: dict[int, int] = {}
        for reader, table in enumerate(chosen):
            for block in table.tolist():
                if state[block] == FREE and not self._released(names[reader], block):
                    self.violations.append(
                        LifecycleViolation(block, names[reader], Violation.FREE_BLOCK_READ)
                    )
                first.setdefault(block, reader)
        sealed: list[int] = []
        filling: list[int] = []
        for block in first:
            s_ = state[block]
            if s_ == SEALED:
                sealed.append(block)
            elif s_ == FILLING:
                filling.append(block)
            else:
                continue
            # mark_verified, one block at a time.
            self.checked_at[block] = now
            last = self.verified_step[block]
            if last != step:
                self.verified_before[block] = last
            self.verified_step[block] = step
        return sealed, filling

    def _read_pages(self, table: np.ndarray, computed_tokens: int) -> np.ndarray:
        """The pages a running request's attention reads: its computed pages and, with rows
        written in earlier steps, its unfilled page (one more page of the rotation: its rows
        are verified, digest/rows.py)."""
        computed = computed_tokens // self.block_size
        if computed_tokens % self.block_size and computed < len(table):
            computed += 1
        return table[:computed]

    def _all_reads(
        self, running: list[tuple[str, int]], decoded: Decoded | None, d_at: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every page every running request reads (paranoid), with each page's reader index
        (``running`` first, then the decodes at ``d_at``): the decodes in one numpy pass."""
        parts = [self._read_pages(self.table(r), nc) for r, nc in running]
        owner = [np.full(len(p), i) for i, p in enumerate(parts)]
        if decoded is not None and len(d_at):
            rows, nc = decoded.rows[d_at], decoded.nc[d_at]
            pages = nc // self.block_size + (nc % self.block_size > 0)
            pages = np.minimum(pages, self._table_len[rows])
            mask = np.arange(self._table.shape[1])[None, :] < pages[:, None]
            parts.append(self._table[rows][mask])
            owner.append(len(running) + np.repeat(np.arange(len(rows)), pages))
        if not parts:
            return block_array(), block_array()
        return np.concatenate(parts).astype(np.int64), np.concatenate(owner).astype(np.int64)
