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
from types import ModuleType
from typing import NamedTuple

import numpy as np


class BlockState(IntEnum):
    FREE = 0
    FILLING = 1
    SEALED = 2
    QUARANTINED = 3


# The states as plain ints for the per-step code: an IntEnum member looked up on its class goes
# through EnumType.__getattr__ on Python 3.11 (about a microsecond each, several per request).
FREE, FILLING, SEALED, QUARANTINED = (int(s) for s in BlockState)


class ScheduledRequest(NamedTuple):
    """One request in one scheduler step, as the ledger needs to see it.

    ``num_computed`` counts tokens whose KV existed before this step; for a
    ``fresh`` request (new, or resumed after preemption) those are prefix-cache
    hits that this step will read. ``num_new`` tokens get their KV written this
    step (draft tokens excluded: they may be rejected and rewritten).
    ``new_block_ids`` are the blocks allocated to it this step (for a fresh
    request: all its blocks past the hits). ``block_ids`` returns the request's
    whole block table; it is only called when needed. ``loaded``: of the ``num_new``
    tokens, how many another KV connector loaded (the first ones) rather than the forward
    computing them: the ledger treats them alike (pages given, rows written, sealed when
    full). (A NamedTuple: one is built per scheduled request per step, and a frozen
    dataclass costs several times more.)
    """

    req_id: str
    num_computed: int
    num_new: int
    fresh: bool
    new_block_ids: Sequence[int]
    block_ids: Callable[[], Sequence[int]]
    loaded: int = 0


@dataclass(slots=True)
class Decodes:
    """The bulk of a decode step, as arrays: running requests that each write one token this
    step into a page they hold or into the one new block they were given (not resumed). The ledger places
    their rows from its own mirror of each request's block table, with numpy, so that a
    request that only decodes costs no Python per step (docs/performance.md). ``block_ids``
    returns a request's whole table where the mirror lacks it (first sight)."""

    req_ids: list[str]  # vLLM's list of running requests, as it came (kept by reference)
    at: np.ndarray | None  # the positions in it that decode (None: all of them)
    num_computed: np.ndarray  # int64, per decoding request: tokens with KV before this step
    block_ids: Callable[[str], Sequence[int]]
    # Decodes handed one new block this step (their last page filled): indices into the arrays
    # above, and the block each was given (appended to its table). None: none.
    grown: np.ndarray | None = None
    grown_blocks: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.num_computed)


def _ids(values: Sequence[int] | np.ndarray = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# The empty block array every plan starts with (read-only: a plan's arrays are replaced, never
# written in place), so that a step's plan allocates no arrays it does not fill.
_NONE = _ids()
_NONE.flags.writeable = False
# No table read whole this step (grow_decodes' ``fetched``; writeable, as the arrays it stands
# for are: numba compiles read-only arrays apart).
_NO_FLAGS = np.zeros(0, dtype=bool)


def _none() -> np.ndarray:
    return _NONE


_compiled: ModuleType | None = None
_why_not = ""


def compiled() -> ModuleType | None:
    """The ledger's compiled loops (core/_plankernels.py), built or loaded once; None where
    numba cannot be used (the plan then takes its numpy path, which computes the same):
    :func:`backend` says which. A decode step's placement is then one call instead of a dozen
    numpy expressions, each of which costs 10-25 µs in the engine, where the forward has pushed
    numpy's code out of the CPU's caches (docs/performance.md)."""
    global _compiled, _why_not
    if _compiled is None and not _why_not:
        try:
            # Imported here, not with this module (see digest/rowhash.py's compiled(): numba
            # imported before vLLM's worker starts trips vLLM 0.32's kernel scan, which the
            # plugin guards).
            from vllm_kvguard.core import _plankernels

            # Compile (or load from numba's cache) now, not in a step: the kinds the plan passes.
            for args in _warm_args():
                _plankernels.place_decodes(*args)
            for args in _warm_grow_args():
                _plankernels.grow_decodes(*args)
            for args in _warm_close_args():
                _plankernels.close_decodes(*args)
            _compiled = _plankernels
        except Exception as exc:  # numba missing or unusable here: numpy computes the same
            _why_not = f"{type(exc).__name__}: {exc}"
    return _compiled


def _warm_args() -> list[tuple[object, ...]]:
    """place_decodes' arguments of every kind a step passes: the mirror rows are writeable, or
    read-only where they are the cached rows of the last step's request list (numba compiles
    each kind apart: one missed here would be compiled in a step, 0.16 s on the machine of
    docs/performance.md with an empty numba cache)."""
    one = np.zeros(1, dtype=np.int64)
    cached = one.copy()
    cached.flags.writeable = False
    table = np.zeros((1, 1), dtype=np.int32)
    return [(one, rows, table, one + 1, 16, np.empty((3, 1), dtype=np.int64)) for rows in (one, cached)]


def _warm_grow_args() -> list[tuple[object, ...]]:
    """grow_decodes' arguments of every kind a step passes (the mirror rows writeable or the
    cached read-only ones, as for :func:`_warm_args`), on tables of one block: block 0 is
    handed to writer 0 and appended to mirror row 0 (scratch tables, thrown away)."""
    one = np.zeros(1, dtype=np.int64)
    cached = one.copy()
    cached.flags.writeable = False
    # table_len, writers, then the ledger's tables in grow_decodes' order (state .. held)
    tables = (
        np.int64,
        np.int64,
        np.uint8,
        np.uint64,
        np.int64,
        np.int64,
        np.uint64,
        np.uint64,
        bool,
        np.int64,
    )
    return [
        (
            one,
            one.copy(),
            rows,
            _NO_FLAGS,
            False,
            np.full((1, 2), -1, dtype=np.int32),
            *(np.zeros(1, dtype=t) for t in tables),
            np.zeros(1, dtype=np.int32),
            np.empty(1, dtype=np.int64),
            np.empty(1, dtype=np.int8),
        )
        for rows in (one, cached)
    ]


def _warm_close_args() -> list[tuple[object, ...]]:
    """close_decodes' arguments as a step passes them (the placement's rows of blocks and slots,
    the ledger's tables), on one block (scratch tables, thrown away)."""
    placed = np.zeros((3, 1), dtype=np.int64)
    # state, generation, writer_of, checked_at, verified_step, verified_before
    tables = (np.uint8, np.uint32, np.int64, np.float64, np.int64, np.int64)
    out = (np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64))
    return [(placed[0], placed[1], 16, *(np.zeros(1, dtype=t) for t in tables), 0.0, 1, *out)]


def backend() -> str:
    """Which code places a decode step's rows: ``numba`` or ``numpy (why)``."""
    return "numba" if compiled() is not None else f"numpy ({_why_not})"


class _Decoded(NamedTuple):
    """The decodes the ledger placed this step: ``req_ids[at[i]]`` has computed ``nc[i]``
    tokens and mirror row ``rows[i]``; ``short``: how many have no full page yet (-1: not
    counted)."""

    req_ids: list[str]
    at: np.ndarray
    nc: np.ndarray
    rows: np.ndarray
    short: int = -1


class PageBatch(NamedTuple):
    """Pages of many requests, one entry per page (a decode batch's given or sealed pages):
    ``req_ids[i]``'s page at table position ``positions[i]`` is ``blocks[i]``."""

    req_ids: list[str]
    positions: np.ndarray
    blocks: np.ndarray

    def by_request(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """The per-request form of :attr:`StepPlan.given_pages` / ``sealed_pages`` (one page each)."""
        return [(r, self.positions[i : i + 1], self.blocks[i : i + 1]) for i, r in enumerate(self.req_ids)]


@dataclass(slots=True)
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
    # (Arrays: one entry per running request per step, never a Python loop over them.)
    given: list[int] = field(default_factory=list)
    written_blocks: np.ndarray = field(default_factory=_none)
    written_slots: np.ndarray = field(default_factory=_none)
    read_partial: list[int] = field(default_factory=list)
    # Pages whose first slot this step writes: every row they hold is known good after it.
    started: np.ndarray = field(default_factory=_none)
    # Per request with pages handed out this step: (request, positions in its table, blocks).
    given_pages: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    # The same for the decode batch, one entry per page (in neither list above).
    given_decodes: PageBatch | None = None
    sealed_decodes: PageBatch | None = None

    def all_given_pages(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``given_pages`` and ``given_decodes`` in the per-request form."""
        return self.given_pages + (self.given_decodes.by_request() if self.given_decodes else [])

    def all_sealed_pages(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``sealed_pages`` and ``sealed_decodes`` in the per-request form."""
        return self.sealed_pages + (self.sealed_decodes.by_request() if self.sealed_decodes else [])


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

    # ------------------------------------------------------------ block-table mirror

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
        return self._table[row, : self._table_len[row]] if row is not None else _ids()

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
        rows_b: list[int] = []
        rows_s: list[int] = []
        started: list[int] = []
        # Allocations first: a request may hit, in this same step, a block that a request
        # listed after it is given (vLLM caches a block as soon as its tokens are scheduled).
        for req in requests:
            new = req.new_block_ids
            if req.fresh or req.req_id not in self._row_of:
                self._set_table(req.req_id, req.block_ids())
            elif len(new):
                self._set_table(req.req_id, new, int(self._table_len[self._row_of[req.req_id]]))
            if len(new):
                blocks = _ids(new)
                self._allocate(req.req_id, blocks, plan)
                plan.given.extend(blocks.tolist())
                start = int(self._table_len[self._row_of[req.req_id]]) - len(blocks)
                plan.given_pages.append((req.req_id, np.arange(start, start + len(blocks)), blocks))
            if req.num_new:
                self._written(req, rows_b, rows_s, started)
        d_blocks = d_slots = d_index = col = _NONE
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
            decoded = _Decoded(decodes.req_ids, d_index, nc, d_rows, short)
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
            begun = d_blocks[d_slots == 0] if len(d_blocks) and begun_count else _NONE
            fill = np.flatnonzero(d_slots == bs - 1) if len(d_blocks) and fills else _NONE
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
            plan.written_blocks = np.concatenate([_ids(rows_b), d_blocks])
            plan.written_slots = np.concatenate([_ids(rows_s), d_slots])
        else:  # a step of decodes only
            plan.written_blocks, plan.written_slots = d_blocks, d_slots
        plan.started = np.concatenate([_ids(started), begun]) if started else begun
        if closed is not None:  # the decodes' pages are marked already: the views' only
            if view_seals or plan.verify or started:
                views = [_ids(plan.seal[:view_seals]), _ids(plan.verify), _ids(started)]
                self.mark_verified(np.concatenate(views), now)
        elif plan.seal or plan.verify or len(plan.started):
            self.mark_verified(np.concatenate([_ids(plan.seal), _ids(plan.verify), plan.started]), now)
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
            return _NONE
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
        return d_blocks[begun_out[:n_begun]] if n_begun else _NONE

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
                _NO_FLAGS if fetched is None else fetched,
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
        if np.count_nonzero(odd) or len(np.unique(blocks)) != len(blocks):
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
        self, req: ScheduledRequest, blocks: list[int], slots: list[int], started: list[int]
    ) -> None:
        """The (block, slot) rows the step's forward writes for ``req``."""
        bs = self.block_size
        first, end = req.num_computed, req.num_computed + req.num_new
        table = self.table(req.req_id)
        if (end - 1) // bs >= len(table):
            self._set_table(req.req_id, req.block_ids())  # a table the views did not show whole
            table = self.table(req.req_id)
            if (end - 1) // bs >= len(table):
                return
        if req.num_new == 1:
            block = int(table[first // bs])
            blocks.append(block)
            slots.append(first % bs)
            if first % bs == 0:
                started.append(block)
            return
        positions = np.arange(first, end)
        written = table[positions // bs].astype(np.int64)
        blocks.extend(written.tolist())
        slots.extend((positions % bs).tolist())
        started.extend(written[positions % bs == 0].tolist())

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

    @property
    def writer(self) -> dict[int, str]:
        """{block: request writing it} for FILLING blocks (diagnostics and tests)."""
        blocks = np.flatnonzero(self.writer_of >= 0)
        return {int(b): self._names[int(self.writer_of[b])] for b in blocks}

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

    def oldest_unverified_age(self, now: float) -> float:
        """Seconds since the least recently sealed-or-verified sealed page was checked."""
        sealed = self.state == SEALED
        if not np.count_nonzero(sealed):
            return 0.0
        return max(0.0, now - float(self.checked_at[sealed].min()))

    # Up to this many pages read in a step are deduplicated without numpy's sort.
    _SMALL_READS = 64
    # Up to this many are checked and marked in Python (:meth:`_few_reads`).
    _FEW_READS = 8

    def _reads(
        self, running: list[tuple[str, int]], decoded: _Decoded | None, budget: int | None, now: float
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
        d_at: np.ndarray | None = _NONE
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
            ids = np.concatenate(chosen).astype(np.int64) if chosen else _ids()
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
        if len(ids) <= self._SMALL_READS:
            # A sampled step's few pages: first occurrences in order through a dict (C-level),
            # several times cheaper than np.unique's sort on a handful of ids.
            ids = np.fromiter(dict.fromkeys(ids.tolist()), dtype=np.int64)
            states = self.state[ids]
        else:
            _, first = np.unique(ids, return_index=True)
            keep = np.sort(first)
            ids, states = ids[keep], states[keep]
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
        self, running: list[tuple[str, int]], decoded: _Decoded | None, d_at: np.ndarray
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
            return _ids(), _ids()
        return np.concatenate(parts).astype(np.int64), np.concatenate(owner).astype(np.int64)

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
        return np.unique(ids[self.lost_write_rows(ids)]).tolist()

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
