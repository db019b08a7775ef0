"""What the guard does about a finding, by mode: pure decisions, no side effects.

The scheduler side of the connector finds something (a page that failed its checksum,
NaN/Inf in a page as it was sealed, a block the scheduler misused), asks this module
what to do, and carries the :class:`Decision` out against vLLM (evict, pin, report
unreadable, end requests). Keeping the table here lets every mode x finding be
unit-tested without an engine; docs/design.md explains each row.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvguard.config import Mode, SuspectAction
from vllm_kvguard.core.events import Action
from vllm_kvguard.core.plan import Violation

# What happened to a request that held a bad page (``kv_request_affected``, the
# requests_affected metric label), once per request, the worst it came to:
HEALED = "healed"  # recomputed before any token computed from the bad page left the engine
SUSPECT = "suspect"  # finished, but tokens may come from the bad page: flagged (stop_reason, log)
FAILED = "failed"  # ended with an error that names the block
OUTCOMES = (HEALED, SUSPECT, FAILED)


def worst(a: str | None, b: str) -> str:
    """The more severe of two outcomes (healed < suspect < failed)."""
    return b if a is None or OUTCOMES.index(b) > OUTCOMES.index(a) else a


def reader_outcome(mode: Mode, suspect: SuspectAction, base: str, *, read_unverified: bool) -> str:
    """The outcome of one request that held a bad page.

    ``base`` is the finding's outcome for a request whose every read of the page was
    verified first (its tokens never came from bad data). ``read_unverified``: the
    request ran forwards that read the page after it was last known good and emitted
    their tokens; recomputing now cannot take them back, so it cannot be healed: raise
    mode fails it, log mode flags it, quarantine mode fails it unless
    ``VLLM_KVGUARD_SUSPECT=flag``.
    """
    if not read_unverified or mode == Mode.RAISE:
        return base
    if mode == Mode.LOG or suspect == SuspectAction.FLAG:
        return worst(base, SUSPECT)
    return FAILED


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
    # For a lifecycle violation, whose request ``outcome`` is: "holder" (the request the
    # block was taken from), "reader" (the request that reads it) or None (nobody's).
    subject: str | None = None


def on_repaired(mode: Mode, *, read_unverified: bool = False) -> Decision:
    """A sealed page changed in one 64-bit word, and the worker mended it from its syndrome
    before this step's forward read it (quarantine mode, ``VLLM_KVGUARD_REPAIR`` on), the
    digest confirming the mended page is the sealed one: nothing to recompute, nothing to
    hold out. ``read_unverified``: requests read the page unverified before it was caught;
    what they computed from it is evicted and they fail or are flagged (reader_outcome)."""
    assert mode == Mode.QUARANTINE, "the worker repairs in quarantine mode only"
    if read_unverified:
        # The mended page is right again, but what its earlier readers computed from it is
        # not: out of the prefix cache with their pages, and held out, as on_corruption does.
        return Decision(Action.REPAIRED, HEALED, evict=True, quarantine=True)
    return Decision(Action.REPAIRED, HEALED)


def on_corruption(mode: Mode) -> Decision:
    """A sealed page no longer matches its seal.

    Under raise mode vLLM's ``fail`` policy evicts the block and the readers' later
    blocks itself; under quarantine (``recompute`` policy) vLLM rewrites blocks in place
    and leaves them cached, so the guard evicts.
    """
    if mode == Mode.LOG:
        return Decision(Action.LOGGED, SUSPECT)
    # Out of the prefix cache with every block its readers computed from it, in both modes:
    # vLLM's fail policy evicts only the first reader's downstream blocks, so a second
    # reader's pages, written from the bad page in the same step, would stay cached.
    if mode == Mode.RAISE:
        return Decision(Action.REQUESTS_FAILED, FAILED, evict=True, quarantine=True, fail_readers=True)
    return Decision(Action.QUARANTINED_RECOMPUTED, HEALED, evict=True, quarantine=True)


def on_bad_load(mode: Mode) -> Decision:
    """A page another KV connector loaded differs from what was computed here for the same
    inputs, found before attention read it: the block is reported unreadable in that step (the
    worker did), so vLLM recomputes its readers (``quarantine``: healed) or they fail
    (``raise``); ``log`` lets them read it (suspect). The block itself is not bad memory: taken
    out of the prefix cache, not quarantined."""
    if mode == Mode.LOG:
        return Decision(Action.LOGGED, SUSPECT)
    if mode == Mode.RAISE:
        return Decision(Action.REQUESTS_FAILED, FAILED, evict=True, fail_readers=True)
    return Decision(Action.RECOMPUTED, HEALED, evict=True)


def on_unfilled_corruption(mode: Mode) -> Decision:
    """Written rows of a page still being written changed (row digests). As on_corruption, but
    the page is not quarantined: its writer still holds it and rewrites it as it recomputes (a
    quarantined block in a live block table would be cached again by vLLM when it fills, and
    every later hit on it would be a violation). A cell that keeps failing shows up again."""
    if mode == Mode.LOG:
        return Decision(Action.LOGGED, SUSPECT)
    if mode == Mode.RAISE:
        return Decision(Action.REQUESTS_FAILED, FAILED, evict=True, fail_readers=True)
    return Decision(Action.RECOMPUTED, HEALED, evict=True)


NONFINITE_AGAIN = "non-finite again after a recompute: the model computes it, not a memory fault"


def on_nonfinite(mode: Mode | None, rewritten_after_recompute: bool) -> Decision:
    """NaN/Inf in a page just sealed (``mode``: the non-finite mode; None: check off).

    Found after the forward that wrote it, so the block is reported unreadable in the
    next step. A writer that writes non-finite values again after one recompute has a
    numerical problem, not a memory one: evicted, no recompute loop.
    """
    if mode is None or mode == Mode.LOG:
        return Decision(Action.LOGGED, SUSPECT)
    if mode == Mode.QUARANTINE and rewritten_after_recompute:
        return Decision(Action.EVICTED, SUSPECT, evict=True, reason=NONFINITE_AGAIN)
    if mode == Mode.RAISE:
        return Decision(
            Action.REQUESTS_FAILED,
            FAILED,
            evict=True,
            invalidate=True,
            fail_readers=True,
            count_recompute=True,
        )
    return Decision(Action.RECOMPUTED, HEALED, evict=True, invalidate=True, count_recompute=True)


def on_violation(mode: Mode, what: Violation, has_holder: bool) -> Decision:
    """A block used in a way only a scheduler bug explains.

    A block handed to a second request while another still holds it (writing it, or
    reading it as a full page) cannot be healed by recomputing (both would keep using the
    same block): the holder is failed, and the block is reported unreadable so that the
    holder's output of this step, read from a page the new owner is writing, is dropped.
    A quarantined block reused from the prefix cache, or a released block in a running
    request's block table, is reported unreadable, so its reader recomputes
    (quarantine) or fails (raise). A quarantined block handed out as a new block is
    overwritten before anyone reads it: logged only.
    """
    stolen = what == Violation.DOUBLE_ALLOCATION and has_holder
    read = what in (Violation.QUARANTINED_REUSED, Violation.FREE_BLOCK_READ)
    subject = "holder" if stolen else "reader" if read else None
    if mode == Mode.LOG or subject is None:
        return Decision(Action.LOGGED, SUSPECT, subject=subject)
    if stolen:
        return Decision(Action.REQUESTS_FAILED, FAILED, invalidate=True, fail_holder=True, subject=subject)
    if mode == Mode.RAISE:
        return Decision(Action.REQUESTS_FAILED, FAILED, invalidate=True, fail_readers=True, subject=subject)
    return Decision(Action.RECOMPUTED, HEALED, invalidate=True, subject=subject)


SHARED_IDENTITY = (
    "another live request holds the page for its own inputs: recomputing the reader into it "
    "would overwrite that request's KV (and vLLM would let the reader keep the page), so the "
    "reader is ended"
)


def on_identity_mismatch(mode: Mode, *, shared: bool) -> Decision:
    """A request hit a page sealed for other inputs (the page itself is intact).

    The page leaves the prefix cache with every page the reader computed from it. When the
    mismatched readers alone hold the page, it is reported unreadable: vLLM recomputes them
    into it (quarantine) or fails them (raise). When another request holds it for its own
    inputs (``shared``), reporting it would make vLLM recompute the first holder it finds,
    which may be the page's rightful owner, and leave the reader reading it: the readers are
    ended by the guard instead (quarantine and raise). Log mode flags the readers.
    """
    if mode == Mode.LOG:
        return Decision(Action.LOGGED, SUSPECT)
    if shared:
        return Decision(Action.REQUESTS_FAILED, FAILED, evict=True, fail_readers=True, reason=SHARED_IDENTITY)
    if mode == Mode.RAISE:
        return Decision(Action.REQUESTS_FAILED, FAILED, evict=True, invalidate=True, fail_readers=True)
    return Decision(Action.RECOMPUTED, HEALED, evict=True, invalidate=True)


def on_write_lost(mode: Mode) -> Decision:
    """Slots of a page being written still hold the previous owner's rows after the forward
    that wrote them. The writer's own later tokens were computed with those slots: report
    the block unreadable so that vLLM recomputes the writer (quarantine) or fails it (raise)
    from that page on, and keep what was computed from it out of the prefix cache."""
    if mode == Mode.LOG:
        return Decision(Action.LOGGED, SUSPECT)
    if mode == Mode.RAISE:
        return Decision(Action.REQUESTS_FAILED, FAILED, evict=True, invalidate=True, fail_readers=True)
    return Decision(Action.RECOMPUTED, HEALED, evict=True, invalidate=True)


def quarantine_limit(max_fraction: float, num_blocks: int) -> int:
    """How many blocks the quarantine may pin (``VLLM_KVGUARD_QUARANTINE_MAX_FRACTION``)."""
    return max(1, int(max_fraction * num_blocks)) if max_fraction > 0 else 0


def pins(quarantined: int, limit: int) -> bool:
    """Whether a newly quarantined block is pinned (never handed out again) or, the
    quarantine being full, only evicted and returned to circulation."""
    return quarantined <= limit
