"""What the ledger plans and reports, as types: block states, the per-request views and the
decode batch it is fed (:class:`ScheduledRequest`, :class:`Decodes`), the step's
:class:`StepPlan`, and the misuses and mismatches it finds. Pure data, no logic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
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


def block_array(values: Sequence[int] | np.ndarray = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# The empty block array every plan starts with (read-only: a plan's arrays are replaced, never
# written in place), so that a step's plan allocates no arrays it does not fill.
NO_BLOCKS = block_array()
NO_BLOCKS.flags.writeable = False
# No table read whole this step (grow_decodes' ``fetched``; writeable, as the arrays it stands
# for are: numba compiles read-only arrays apart).
NO_FLAGS = np.zeros(0, dtype=bool)


def no_blocks() -> np.ndarray:
    return NO_BLOCKS


class Decoded(NamedTuple):
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


# What the workers read of a step's plan: all a pickled plan carries (StepPlan.__getstate__).
WORKER_FIELDS = (
    "step",
    "seal",
    "forget",
    "verify",
    "readers",
    "read_verify",
    "given",
    "written_blocks",
    "written_slots",
    "read_partial",
)


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
    written_blocks: np.ndarray = field(default_factory=no_blocks)
    written_slots: np.ndarray = field(default_factory=no_blocks)
    read_partial: list[int] = field(default_factory=list)
    # Pages whose first slot this step writes: every row they hold is known good after it.
    started: np.ndarray = field(default_factory=no_blocks)
    # Per request with pages handed out this step: (request, positions in its table, blocks).
    given_pages: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    # The same for the decode batch, one entry per page (in neither list above).
    given_decodes: PageBatch | None = None
    sealed_decodes: PageBatch | None = None

    def __getstate__(self) -> tuple[object, ...]:
        # Pickled once a step into the workers' message (vLLM's multiprocess executor): only
        # what the workers read. The rest (page identity, the pages begun, the hand-outs per
        # request) stays with the scheduler's own copy; a pickled plan has their defaults.
        return tuple(getattr(self, name) for name in WORKER_FIELDS)

    def __setstate__(self, state: tuple[object, ...]) -> None:
        for name, value in zip(WORKER_FIELDS, state, strict=True):
            setattr(self, name, value)
        # The scheduler's fields, as a new plan has them (tests/unit/core/test_plan.py checks
        # that every field is one or the other).
        self.unverified_hits = 0
        self.sealed_pages, self.hit_pages, self.given_pages = [], [], []
        self.started = NO_BLOCKS
        self.given_decodes = self.sealed_decodes = None

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
