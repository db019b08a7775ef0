"""The ledger's state: per-block arrays, each live request's block table mirrored, who holds
and who wrote each block (the lifecycle audit's bookkeeping), when each was last known good,
what each page holds (identity) and who it was handed to (lost writes), quarantine.

The ledger is one class (:class:`~vllm_kvguard.core.ledger.BlockLedger`) built in layers:
this state, :mod:`.reads` (which pages of running requests a step verifies) and
:mod:`.ledger` (the step's plan).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from vllm_kvguard.core.compiled import compiled
from vllm_kvguard.core.plan import (
    FILLING,
    FREE,
    QUARANTINED,
    SEALED,
    Decodes,
    IdentityMismatch,
    LifecycleViolation,
    Violation,
    block_array,
)


class LedgerState:
    """The ledger's state and bookkeeping (module docstring); :class:`BlockLedger` plans on it."""

    def __init__(self, num_blocks: int, block_size: int, read_every: int = 1) -> None:
        if read_every < 1:
            raise ValueError(f"read_every must be a positive number of steps, not {read_every}")
        self.block_size = block_size
        # Sampled reads are verified on every read_every-th step, read_every budgets at once
        # (:meth:`plan`): the step's fixed cost of sampling paid once per read_every steps.
        self.read_every = read_every
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
        self._given_count = 0  # blocks in _given, kept as they come and go (the state gauge)
        self._next_number = 0
        self.step = 0
        self.violations: list[LifecycleViolation] = []
        # Where the sampled reads' sweep stands: a reader's index and a page in its table.
        self._read_cursor = 0
        self._read_offset = 0
        # The reader at the cursor and the one after it, by name: readers that end or move in
        # vLLM's order must not make the sweep skip one (:meth:`_sweep_start`).
        self._read_anchor: tuple[str, str] | None = None
        # Each live request's block table as vLLM handed it out (its first view, then the blocks
        # appended): where this step's rows go, without asking vLLM for the table every step.
        # One row of a numpy array per live request (rows and columns grow on demand, rows are
        # reused), so that a decode step places every request's row in a few numpy calls.
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._table = np.full((0, 0), -1, dtype=np.int32)
        self._table_len = np.zeros(0, dtype=np.int64)
        # The last decode batch's request list and rows: vLLM sends the same requests in the
        # same order step after step, and a list compare is far cheaper than a lookup each.
        self._last_decodes: tuple[list[str], np.ndarray, np.ndarray] | None = None
        # Who each block was handed to (a key of the writer and page position, set by the
        # connector; 0: unknown), and the same for the block's previous owner: a row that
        # reads back as the previous owner's is a lost write only if that owner's row was
        # not the same computation (digest/identity.py).
        self.owner_key = np.zeros(num_blocks, dtype=np.uint64)
        self.previous_key = np.zeros(num_blocks, dtype=np.uint64)
        # Per block, kept with the two keys: both known and different (:meth:`lost_write_rows`,
        # one gather a step instead of comparing the keys every step).
        self.lost_evidence = np.zeros(num_blocks, dtype=bool)
        # Whether a request's block table in vLLM still has a block (set by the connector). vLLM
        # frees pages behind a sliding window while their request runs and tells no connector:
        # before the audit reports a block taken from (or read by) a holder, it asks; a holder
        # that no longer has it released it. None: every holder the ledger knows still does.
        self.still_held: Callable[[str, int], bool] | None = None
        compiled()  # built (or loaded) now, not in the first decode step

    @property
    def num_blocks(self) -> int:
        return len(self.state)

    def live_requests(self) -> int:
        return len(self._numbers)

    def footprint(self) -> dict[str, int]:
        """Entries of the per-request tables (0 once every request has ended)."""
        return {
            "requests": len(self._numbers),
            "blocks_given": self._given_count,
            "tables": len(self._row_of),
        }

    def nbytes(self) -> int:
        """Bytes of the per-block arrays (fixed at start) and of the block-table mirror (one
        row per live request, as wide as the longest table seen)."""
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray))

    def quarantined(self) -> int:
        return int(np.count_nonzero(self.state == QUARANTINED))

    def _row(self, req_id: str) -> int:
        """The mirror row of ``req_id`` (a new one on first sight)."""
        row = self._row_of.get(req_id)
        if row is None:
            if not self._free_rows:
                grown = max(16, 2 * len(self._table_len))
                table = np.full((grown, self._table.shape[1]), -1, dtype=np.int32)
                table[: len(self._table)] = self._table
                self._table = table
                self._table_len = np.concatenate(
                    [self._table_len, np.zeros(grown - len(self._table_len), np.int64)]
                )
                self._free_rows = list(range(grown - 1, len(self._row_of) - 1, -1))
            row = self._row_of[req_id] = self._free_rows.pop()
            self._last_decodes = None
        return row

    def _set_table(self, req_id: str, blocks: Sequence[int] | np.ndarray, keep: int = 0) -> int:
        """Mirror ``req_id``'s table as ``blocks`` appended after its first ``keep`` entries."""
        row = self._row(req_id)
        end = keep + len(blocks)
        self._widen(end)
        self._table[row, keep:end] = blocks
        self._table_len[row] = end
        return row

    def _widen(self, width: int) -> None:
        """Room for tables of ``width`` blocks in the mirror (columns grow on demand)."""
        if width > self._table.shape[1]:
            wider = np.full((len(self._table), max(width, 2 * self._table.shape[1], 16)), -1, dtype=np.int32)
            wider[:, : self._table.shape[1]] = self._table
            self._table = wider

    def table(self, req_id: str) -> np.ndarray:
        """The mirror of ``req_id``'s block table (empty if unknown)."""
        row = self._row_of.get(req_id)
        return self._table[row, : self._table_len[row]] if row is not None else block_array()

    def _place_decodes(
        self, nc: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int] | None:
        """(blocks, slots, table positions, pages filled, pages begun, decodes with no full
        page yet) of the decodes' rows (``nc``: tokens computed, ``rows``: mirror rows), in one
        compiled call; None without numba, for arrays of other kinds, or where some decode's
        page lies past its mirrored table (the plan's numpy path then)."""
        kernels = compiled()
        if (
            kernels is None
            or nc.dtype != np.int64
            or rows.dtype != np.int64
            or not (nc.flags.c_contiguous and rows.flags.c_contiguous)
        ):
            return None
        out = np.empty((3, len(nc)), dtype=np.int64)
        fills, begun, short = kernels.place_decodes(
            nc, rows, self._table, self._table_len, self.block_size, out
        )
        if fills < 0:
            return None
        return out[0], out[1], out[2], fills, begun, short

    def _decode_rows(self, decodes: Decodes) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(positions in ``decodes.req_ids``, mirror rows, which of them were read whole from
        vLLM now (None: none)) of the decoding requests."""
        ids = decodes.req_ids
        last = self._last_decodes
        if last is not None and last[0] == ids:
            every, positions = last[1], last[2]
        else:
            every = np.fromiter(
                map(self._row_of.get, ids, itertools.repeat(-1)), dtype=np.int64, count=len(ids)
            )
            positions = np.arange(len(ids))
            # Cached only where every request is known (the usual step: no check of it again).
            self._last_decodes = None
            if every.min(initial=0) >= 0:
                every.flags.writeable = positions.flags.writeable = False
                self._last_decodes = (ids, every, positions)
        # (``rows`` and ``at`` may be the cached arrays themselves: read-only; the plan only
        # reads them.)
        if decodes.at is None:
            at, rows = positions, every
        else:
            at, rows = decodes.at, every[decodes.at]
        fetched = None
        if self._last_decodes is None and np.count_nonzero(rows < 0):
            # First sight of a running request: its table from vLLM.
            fetched = rows < 0
            rows = rows.copy()
            for i in np.flatnonzero(fetched).tolist():
                rows[i] = self._set_table(ids[at[i]], decodes.block_ids(ids[at[i]]))
        return at, rows, fetched

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
        self._owned(blocks, number)
        self._hold(number, blocks)

    def _owned(self, blocks: np.ndarray, writers: int | list[int]) -> None:
        """Blocks handed to new writers (a request number, or one per block)."""
        self.state[blocks] = FILLING
        self.fingerprint[blocks] = 0
        # Nothing of the new owner's is known good yet (a previous life's checks do not count).
        self.verified_step[blocks] = -1
        self.verified_before[blocks] = -1
        self.previous_key[blocks] = self.owner_key[blocks]
        self.owner_key[blocks] = 0
        self.lost_evidence[blocks] = False
        self.writer_of[blocks] = writers

    def _hold(self, number: int, blocks: np.ndarray) -> None:
        self.held[blocks] += 1
        self._given.setdefault(number, []).append(blocks)
        self._given_count += len(blocks)

    def holders_of(self, block_id: int) -> list[str]:
        """Live requests whose block table holds ``block_id`` (the rare path: a scan)."""
        return [
            self._names[number]
            for number, given in self._given.items()
            if any(block_id in blocks for blocks in given)
        ]

    @property
    def writer(self) -> dict[int, str]:
        """{block: request writing it} for FILLING blocks (diagnostics and tests)."""
        blocks = np.flatnonzero(self.writer_of >= 0)
        return {int(b): self._names[int(self.writer_of[b])] for b in blocks}

    def record_identity(self, req_id: str | list[str], blocks: np.ndarray, fingerprints: np.ndarray) -> None:
        """The fingerprints of pages ``req_id`` sealed (0 where not known); ``req_id`` may name
        the sealer of each block (a decode batch's pages)."""
        self.fingerprint[blocks] = fingerprints
        if isinstance(req_id, str):
            self.sealed_by[blocks] = req_id
        else:
            names = np.empty(len(req_id), dtype=object)
            names[:] = req_id
            self.sealed_by[blocks] = names

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
        now, before = self.owner_key[blocks], self.previous_key[blocks]
        self.lost_evidence[blocks] = (now != before) & (now != 0) & (before != 0)

    def lost_write_rows(self, blocks: Sequence[int] | np.ndarray) -> np.ndarray:
        """Which of the rows written this step (their blocks, in order) could tell a lost write:
        the block's previous owner computed something else at that page position (both owners
        known), so a row that reads back as that owner's is then a lost write. Where they
        computed the same (a resumed or recomputed request) or either is unknown, equal rows are
        no evidence. One gather, no sort: it runs on every step."""
        return self.lost_evidence[np.asarray(blocks, dtype=np.int64)]

    def forget_owners(self, blocks: Sequence[int] | np.ndarray) -> None:
        """The worker forgot these blocks' rows (a page found changed, reported unreadable or
        zeroed): whoever is given one next has no previous owner's rows to tell a lost write
        by, so none of its rows is sent as evidence (conservative: rows recomputed since are
        not counted on)."""
        self.owner_key[np.asarray(blocks, dtype=np.int64)] = 0

    def lost_write_candidates(self, blocks: Sequence[int] | np.ndarray) -> list[int]:
        """The blocks of :meth:`lost_write_rows`, once each."""
        ids = np.asarray(blocks, dtype=np.int64)
        return sorted(set(ids[self.lost_write_rows(ids)].tolist()))

    def forget_identity(self, block_ids: Sequence[int]) -> None:
        """A page whose content is no longer what it was sealed for (being recomputed)."""
        self.fingerprint[np.asarray(block_ids, dtype=np.int64)] = 0

    def quarantine(self, block_ids: Iterable[int]) -> list[int]:
        """Mark blocks quarantined; return those that were not already."""
        new = [b for b in dict.fromkeys(block_ids) if self.state[b] != QUARANTINED]
        self.state[new] = QUARANTINED
        return new

    def release_quarantined(self, block_ids: Iterable[int]) -> None:
        """Return quarantined blocks to circulation (the quarantine is full)."""
        blocks = list(block_ids)
        self.state[blocks] = FREE

    def idle_sealed(self, in_use: Callable[[int], bool]) -> list[int]:
        """Sealed blocks that no request holds: pages at rest (fault-injection targets)."""
        sealed = np.flatnonzero(self.state == SEALED).tolist()
        return [b for b in sealed if not in_use(b)]

    def take_violations(self) -> list[LifecycleViolation]:
        out, self.violations = self.violations, []
        return out

    def _taken_from_reader(self, block: int, req_id: str) -> None:
        """A full page handed to ``req_id`` while a live request holds it: a violation unless
        the holder is ``req_id`` itself, or vLLM released it from the holder's table."""
        for holder in self.holders_of(block):
            if holder != req_id and not self._released(holder, block):
                self.violations.append(LifecycleViolation(block, req_id, Violation.DOUBLE_ALLOCATION, holder))
                return

    def _released(self, req_id: str, block: int) -> bool:
        """Whether vLLM took ``block`` out of ``req_id``'s block table without the request ending
        (a page behind its sliding window): if so, the ledger lets go of it too. The rare path
        only: asked where the audit would otherwise report a violation."""
        if self.still_held is None or self.still_held(req_id, block):
            return False
        number = self._numbers.get(req_id)
        given = self._given.get(number) if number is not None else None
        if given:
            kept = [blocks[blocks != block] for blocks in given]
            dropped = sum(len(a) for a in given) - sum(len(a) for a in kept)
            self._given[number] = [a for a in kept if len(a)]  # type: ignore[index]
            self._given_count -= dropped
            self.held[block] = max(0, int(self.held[block]) - dropped)
            if self.writer_of[block] == number:
                self.writer_of[block] = -1
        return True
