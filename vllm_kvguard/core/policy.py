"""What the guard does about a finding, by mode: pure decisions, no side effects.

The scheduler side of the connector finds something (a page that failed its checksum,
NaN/Inf in a page as it was sealed, a block the scheduler misused), asks this module
what to do, and carries the :class:`Decision` out against vLLM (evict, pin, report
unreadable, end requests). Keeping the table here lets every mode x finding be
unit-tested without an engine; docs/design.md explains each row.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvguard.config import Mode
from vllm_kvguard.core.events import Action
from vllm_kvguard.core.ledger import Violation

# Per-request outcomes (``kv_request_affected`` and the requests_affected metric label).
RECOMPUTED = "recomputed"
FAILED = "failed"
LOGGED = "logged"


@dataclass(frozen=True)
class Decision:
    """What to do about one finding.

    ``evict``: take the block, and the blocks its readers computed from it, out of the
    prefix cache. ``quarantine``: hold the block out of circulation. ``invalidate``:
    report the block unreadable to vLLM, whose ``kv_load_failure_policy`` then
    recomputes (quarantine) or fails (raise) the requests holding it.
    ``fail_readers``: the readers end with the guard's message (raise mode).
    ``fail_holder``: the request that still owned a misused block is ended by the guard.
    ``count_recompute``: the writers' non-finite recompute count goes up by one.
    """

    action: Action
    outcome: str
    evict: bool = False
    quarantine: bool = False
    invalidate: bool = False
    fail_readers: bool = False
    fail_holder: bool = False
    count_recompute: bool = False
    reason: str = ""


def on_corruption(mode: Mode) -> Decision:
    """A sealed page no longer matches its seal.

    Under raise mode vLLM's ``fail`` policy evicts the block and the readers' later
    blocks itself; under quarantine (``recompute`` policy) vLLM rewrites blocks in place
    and leaves them cached, so the guard evicts.
    """
    if mode == Mode.LOG:
        return Decision(Action.LOGGED, LOGGED)
    if mode == Mode.RAISE:
        return Decision(Action.REQUESTS_FAILED, FAILED, quarantine=True, fail_readers=True)
    return Decision(Action.QUARANTINED_RECOMPUTED, RECOMPUTED, evict=True, quarantine=True)


NONFINITE_AGAIN = "non-finite again after a recompute: the model computes it, not a memory fault"


def on_nonfinite(mode: Mode | None, rewritten_after_recompute: bool) -> Decision:
    """NaN/Inf in a page just sealed (``mode``: the non-finite mode; None: check off).

    Found after the forward that wrote it, so the block is reported unreadable in the
    next step. A writer that writes non-finite values again after one recompute has a
    numerical problem, not a memory one: evicted, no recompute loop.
    """
    if mode is None or mode == Mode.LOG:
        return Decision(Action.LOGGED, LOGGED)
    if mode == Mode.QUARANTINE and rewritten_after_recompute:
        return Decision(Action.EVICTED, LOGGED, evict=True, reason=NONFINITE_AGAIN)
    if mode == Mode.RAISE:
        return Decision(
            Action.REQUESTS_FAILED,
            FAILED,
            evict=True,
            invalidate=True,
            fail_readers=True,
            count_recompute=True,
        )
    return Decision(Action.RECOMPUTED, RECOMPUTED, evict=True, invalidate=True, count_recompute=True)


def on_violation(mode: Mode, what: Violation, has_holder: bool) -> Decision:
    """A block used in a way only a scheduler bug explains.

    A block handed to a second request while the first still writes it cannot be
    healed by recomputing (both would keep writing the same block): the holder is
    failed. A quarantined block reused from the prefix cache, or a released block in a
    running request's block table, is reported unreadable, so its reader recomputes
    (quarantine) or fails (raise). A quarantined block handed out as a new block is
    overwritten before anyone reads it: logged only.
    """
    if mode == Mode.LOG:
        return Decision(Action.LOGGED, LOGGED)
    if what == Violation.DOUBLE_ALLOCATION and has_holder:
        return Decision(Action.REQUESTS_FAILED, FAILED, fail_holder=True)
    if what in (Violation.QUARANTINED_REUSED, Violation.FREE_BLOCK_READ):
        if mode == Mode.RAISE:
            return Decision(Action.REQUESTS_FAILED, FAILED, invalidate=True, fail_readers=True)
        return Decision(Action.RECOMPUTED, RECOMPUTED, invalidate=True)
    return Decision(Action.LOGGED, LOGGED)


def quarantine_limit(max_fraction: float, num_blocks: int) -> int:
    """How many blocks the quarantine may pin (``VLLM_KVGUARD_QUARANTINE_MAX_FRACTION``)."""
    return max(1, int(max_fraction * num_blocks)) if max_fraction > 0 else 0


def pins(quarantined: int, limit: int) -> bool:
    """Whether a newly quarantined block is pinned (never handed out again) or, the
    quarantine being full, only evicted and returned to circulation."""
    return quarantined <= limit
