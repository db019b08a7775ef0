"""Events the guard emits. The core produces them; logs (and metrics) consume them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Action(StrEnum):
    QUARANTINED_RECOMPUTED = "quarantined_and_recomputed"
    REQUESTS_FAILED = "requests_failed"
    LOGGED = "logged"
    RECOMPUTED = "recomputed"  # readers recompute; the block is not held out
    EVICTED = "evicted"  # out of the prefix cache, nothing recomputed (retry limit)
    REPAIRED = "repaired"  # mended in place from the syndrome, verified against the seal


@dataclass(frozen=True)
class Detection:
    """A page that failed verification on one worker (shipped worker -> scheduler)."""

    rank: int
    block_id: int
    layer: str
    expected: int
    actual: int
    readers: tuple[str, ...] = ()
    trigger: str = "reuse"  # reuse | sampled | paranoid | scrub | seal
    step: int = 0
    kind: str = "checksum_mismatch"  # or "nonfinite": NaN/Inf in a page being sealed
    shape: str = "undiagnosed"  # core.shapes.Shape
    # Where a located word is (word, element, flipped_bits), or the copy's source_block.
    where: dict[str, object] = field(default_factory=dict)
    repaired: bool = False  # mended in place before this step read it (and verified)


@dataclass(frozen=True)
class BlockCorrupted:
    """One corrupted block, as the operator sees it: all bad layers, all ranks."""

    block_id: int
    layer: str
    layers: tuple[str, ...]
    rank: int
    ranks: tuple[int, ...]
    expected_digest: str
    actual_digest: str
    request_ids: tuple[str, ...]
    action: Action
    generation: int
    step: int
    trigger: str = "reuse"
    # The step of the page's last seal or verification before it was found bad (-1: none
    # known): every forward of a holder after it and before ``step`` read the page unverified.
    last_good_step: int = -1
    shape: str = "undiagnosed"  # of the first bad layer (core.shapes.Shape); per layer in ``shapes``
    shapes: tuple[str, ...] = ()
    where: dict[str, object] = field(default_factory=dict)
    device: str = ""


@dataclass(frozen=True)
class BlockDiagnosed:
    """The shape of a page a device check found bad, diagnosed by the worker before its next
    forward (``kv_block_diagnosed``: the device path's follow-up to ``kv_block_corrupted``)."""

    block_id: int
    layer: str
    rank: int
    step: int
    shape: str
    where: dict[str, object] = field(default_factory=dict)
    device: str = ""


@dataclass(frozen=True)
class BlockNonFinite:
    """NaN/Inf found in a page as it was sealed: bad data written, not a change at rest."""

    block_id: int
    layers: tuple[str, ...]
    ranks: tuple[int, ...]
    request_ids: tuple[str, ...]
    action: Action
    step: int
    reason: str = ""


@dataclass(frozen=True)
class LifecycleViolationFound:
    """A block used in a way that only a scheduler bug explains."""

    block_id: int
    what: str
    request_id: str
    holder_request_id: str | None
    action: Action
    step: int


@dataclass(frozen=True)
class IdentityMismatchFound:
    """A prefix-cache hit on a page sealed for other inputs (``kv_block_identity_mismatch``):
    the page is intact but holds another prompt's KV (a block-hash bug or collision)."""

    block_id: int
    position: int  # the page's index in the reader's block table
    request_id: str  # the reader
    sealed_by: str  # the request whose inputs the page was sealed for
    expected_fingerprint: str  # the reader's own fingerprint for that position
    found_fingerprint: str  # the page's, from its seal
    other_holders: int  # live requests besides the mismatched readers that hold the page
    action: Action
    step: int
    reason: str = ""


@dataclass(frozen=True)
class WriteLost:
    """Slots of a page that still hold what the page's previous owner wrote after this owner's
    forward wrote them (``kv_block_write_lost``): the write went elsewhere (a stale slot
    mapping) or never happened."""

    block_id: int
    slots: tuple[int, ...]
    request_ids: tuple[str, ...]
    action: Action
    step: int


@dataclass(frozen=True)
class BlockQuarantined:
    block_id: int
    quarantined_total: int
    pinned: bool


@dataclass(frozen=True)
class RequestAffected:
    """What happened to one request that held a bad page, once, when it finishes."""

    request_id: str
    block_id: int  # the first bad block
    block_ids: tuple[int, ...]
    outcome: str  # "healed" | "suspect" | "failed" (core/policy.py)


@dataclass(frozen=True)
class FaultInjected:
    fault_id: int
    kind: str
    block_id: int
    layer: int
    step: int
    at: str = "rest"  # rest: a sealed idle page; write: a page being sealed, before its seal


@dataclass(frozen=True)
class FaultOutcome:
    fault_id: int
    outcome: str  # "detected" | "escaped" | "not_read" | "no_change"
    step: int


@dataclass(frozen=True)
class InternalError:
    where: str
    error: str
    count: int


@dataclass(frozen=True)
class GuardStarted:
    role: str
    config: dict[str, object] = field(default_factory=dict)
    details: dict[str, object] = field(default_factory=dict)
