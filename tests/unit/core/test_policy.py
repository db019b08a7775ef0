"""Every mode x finding of core/policy.py: what the scheduler side is told to do."""

from __future__ import annotations

import pytest

from vllm_kvguard.config import Mode, SuspectAction
from vllm_kvguard.core import policy
from vllm_kvguard.core.events import Action
from vllm_kvguard.core.plan import Violation


@pytest.mark.parametrize(
    ("mode", "action", "outcome", "evict", "quarantine", "fail"),
    [
        (Mode.QUARANTINE, Action.QUARANTINED_RECOMPUTED, "healed", True, True, False),
        # vLLM's fail policy evicts only the first reader's later blocks: the guard evicts all.
        (Mode.RAISE, Action.REQUESTS_FAILED, "failed", True, True, True),
        (Mode.LOG, Action.LOGGED, "suspect", False, False, False),
    ],
)
def test_corruption(
    mode: Mode, action: Action, outcome: str, evict: bool, quarantine: bool, fail: bool
) -> None:
    d = policy.on_corruption(mode)
    assert (d.action, d.outcome, d.evict, d.quarantine, d.fail_readers) == (
        action,
        outcome,
        evict,
        quarantine,
        fail,
    )
    assert not d.invalidate and not d.fail_holder


@pytest.mark.parametrize(
    ("mode", "again", "action", "outcome", "invalidate", "fail", "counted"),
    [
        (Mode.QUARANTINE, False, Action.RECOMPUTED, "healed", True, False, True),
        # Written non-finite again after one recompute: the model computes it; no loop, and
        # the request goes on from an evicted page: suspect.
        (Mode.QUARANTINE, True, Action.EVICTED, "suspect", False, False, False),
        (Mode.RAISE, False, Action.REQUESTS_FAILED, "failed", True, True, True),
        (Mode.RAISE, True, Action.REQUESTS_FAILED, "failed", True, True, True),
        (Mode.LOG, False, Action.LOGGED, "suspect", False, False, False),
        (None, True, Action.LOGGED, "suspect", False, False, False),
    ],
)
def test_nonfinite(
    mode: Mode | None, again: bool, action: Action, outcome: str, invalidate: bool, fail: bool, counted: bool
) -> None:
    d = policy.on_nonfinite(mode, again)
    assert (d.action, d.outcome, d.invalidate, d.fail_readers, d.count_recompute) == (
        action,
        outcome,
        invalidate,
        fail,
        counted,
    )
    # Out of the prefix cache whenever the guard acts at all.
    assert d.evict == (mode in (Mode.QUARANTINE, Mode.RAISE))
    assert (d.reason == policy.NONFINITE_AGAIN) == (mode == Mode.QUARANTINE and again)


@pytest.mark.parametrize("mode", [Mode.QUARANTINE, Mode.RAISE])
def test_block_stolen_from_its_holder_fails_the_holder_in_both_acting_modes(mode: Mode) -> None:
    d = policy.on_violation(mode, Violation.DOUBLE_ALLOCATION, has_holder=True)
    # Reported unreadable too: the holder's output of the step that read the new owner's
    # writes is dropped before the guard ends it.
    assert (d.action, d.outcome, d.fail_holder, d.invalidate, d.fail_readers, d.subject) == (
        Action.REQUESTS_FAILED,
        "failed",
        True,
        True,
        False,
        "holder",
    )


@pytest.mark.parametrize("what", [Violation.QUARANTINED_REUSED, Violation.FREE_BLOCK_READ])
@pytest.mark.parametrize(
    ("mode", "action", "fail"),
    [(Mode.QUARANTINE, Action.RECOMPUTED, False), (Mode.RAISE, Action.REQUESTS_FAILED, True)],
)
def test_unreadable_block_is_reported_to_vllm(
    what: Violation, mode: Mode, action: Action, fail: bool
) -> None:
    d = policy.on_violation(mode, what, has_holder=False)
    assert (d.action, d.invalidate, d.fail_readers, d.fail_holder) == (action, True, fail, False)
    assert d.subject == "reader" and d.outcome == ("failed" if fail else "healed")


@pytest.mark.parametrize(
    ("what", "holder"),
    [(Violation.QUARANTINED_ALLOCATED, False), (Violation.DOUBLE_ALLOCATION, False)],
)
@pytest.mark.parametrize("mode", list(Mode))
def test_violations_that_touch_no_request_are_logged(what: Violation, holder: bool, mode: Mode) -> None:
    d = policy.on_violation(mode, what, has_holder=holder)
    assert d.action == Action.LOGGED and d.subject is None and not (d.invalidate or d.fail_holder)


@pytest.mark.parametrize("what", list(Violation))
def test_log_mode_only_logs_violations_and_flags_who_read_them(what: Violation) -> None:
    d = policy.on_violation(Mode.LOG, what, has_holder=True)
    assert (d.action, d.outcome, d.invalidate, d.fail_holder, d.fail_readers) == (
        Action.LOGGED,
        "suspect",
        False,
        False,
        False,
    )


@pytest.mark.parametrize(
    ("mode", "suspect", "verified", "unverified"),
    [
        # Every read verified first: recomputed before any token from the page left (healed).
        # Tokens already emitted from the page: recomputing cannot take them back.
        (Mode.QUARANTINE, SuspectAction.FAIL, "healed", "failed"),
        (Mode.QUARANTINE, SuspectAction.FLAG, "healed", "suspect"),
        (Mode.RAISE, SuspectAction.FAIL, "failed", "failed"),
        (Mode.RAISE, SuspectAction.FLAG, "failed", "failed"),
        (Mode.LOG, SuspectAction.FAIL, "suspect", "suspect"),
    ],
)
def test_reader_outcome(mode: Mode, suspect: SuspectAction, verified: str, unverified: str) -> None:
    base = policy.on_corruption(mode).outcome
    assert policy.reader_outcome(mode, suspect, base, read_unverified=False) == verified
    assert policy.reader_outcome(mode, suspect, base, read_unverified=True) == unverified


def test_worst_outcome_wins() -> None:
    assert policy.worst(None, "healed") == "healed"
    assert policy.worst("healed", "suspect") == "suspect"
    assert policy.worst("failed", "healed") == "failed"
    assert policy.worst("suspect", "failed") == "failed"


def test_quarantine_limit_and_pinning() -> None:
    assert policy.quarantine_limit(0.01, 1000) == 10
    assert policy.quarantine_limit(0.0001, 1000) == 1  # at least one block
    assert policy.quarantine_limit(0.0, 1000) == 0  # 0 turns pinning off
    assert policy.pins(10, 10) and not policy.pins(11, 10) and not policy.pins(1, 0)


def test_repaired_page_needs_no_recompute_unless_it_was_read_unverified() -> None:
    from vllm_kvguard.core.events import Action

    quiet = policy.on_repaired(Mode.QUARANTINE)
    assert quiet.action == Action.REPAIRED and quiet.outcome == policy.HEALED
    assert not (quiet.evict or quiet.quarantine or quiet.invalidate)
    read = policy.on_repaired(Mode.QUARANTINE, read_unverified=True)
    assert read.evict and read.quarantine and not read.invalidate


@pytest.mark.parametrize(
    ("mode", "shared", "action", "outcome", "evict", "invalidate", "fail"),
    [
        (Mode.QUARANTINE, False, Action.RECOMPUTED, "healed", True, True, False),
        # Another request holds the page for its own inputs: recomputing into it would
        # overwrite that request's KV; the reader is ended instead.
        (Mode.QUARANTINE, True, Action.REQUESTS_FAILED, "failed", True, False, True),
        (Mode.RAISE, False, Action.REQUESTS_FAILED, "failed", True, True, True),
        (Mode.RAISE, True, Action.REQUESTS_FAILED, "failed", True, False, True),
        (Mode.LOG, False, Action.LOGGED, "suspect", False, False, False),
        (Mode.LOG, True, Action.LOGGED, "suspect", False, False, False),
    ],
)
def test_identity_mismatch(
    mode: Mode, shared: bool, action: Action, outcome: str, evict: bool, invalidate: bool, fail: bool
) -> None:
    d = policy.on_identity_mismatch(mode, shared=shared)
    assert (d.action, d.outcome, d.evict, d.invalidate, d.fail_readers) == (
        action,
        outcome,
        evict,
        invalidate,
        fail,
    )
    assert not d.quarantine, "the page is intact: nothing to hold out"
    assert bool(d.reason) == (shared and mode != Mode.LOG)


@pytest.mark.parametrize(
    ("mode", "action", "outcome", "invalidate"),
    [
        (Mode.QUARANTINE, Action.RECOMPUTED, "healed", True),
        (Mode.RAISE, Action.REQUESTS_FAILED, "failed", True),
        (Mode.LOG, Action.LOGGED, "suspect", False),
    ],
)
def test_write_lost(mode: Mode, action: Action, outcome: str, invalidate: bool) -> None:
    d = policy.on_write_lost(mode)
    assert (d.action, d.outcome, d.invalidate) == (action, outcome, invalidate)
    assert not d.quarantine


@pytest.mark.parametrize(
    ("mode", "action", "outcome", "evict", "fail"),
    [
        (Mode.QUARANTINE, Action.RECOMPUTED, "healed", True, False),
        (Mode.RAISE, Action.REQUESTS_FAILED, "failed", True, True),
        (Mode.LOG, Action.LOGGED, "suspect", False, False),
    ],
)
def test_unfilled_page_corruption_is_never_quarantined(
    mode: Mode, action: Action, outcome: str, evict: bool, fail: bool
) -> None:
    d = policy.on_unfilled_corruption(mode)
    assert (d.action, d.outcome, d.evict, d.fail_readers) == (action, outcome, evict, fail)
    assert not d.quarantine and not d.invalidate  # the worker reports the block itself
