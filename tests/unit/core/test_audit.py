"""The load audit's sampling plan (core/audit.py): counted, never timed."""

from __future__ import annotations

from vllm_kvguard.core.audit import FIRST, LoadAudit


def test_the_first_loads_then_a_share_of_them() -> None:
    audit = LoadAudit(rate=0.25)
    picks = [audit.choose() for _ in range(FIRST + 12)]
    assert picks[:FIRST] == [True] * FIRST
    assert picks[FIRST:] == [False, False, False, True] * 3


def test_an_error_owes_the_first_loads_again_and_off_means_off() -> None:
    audit = LoadAudit(rate=0.01)
    for _ in range(FIRST + 5):
        audit.choose()
    audit.error()
    assert [audit.choose() for _ in range(FIRST + 1)] == [True] * FIRST + [False]
    off = LoadAudit(rate=0.0)
    off.error()
    assert not any(off.choose() for _ in range(100))


def test_distrust_is_news_once() -> None:
    audit = LoadAudit(rate=0.05)
    assert audit.distrust() and not audit.distrust() and audit.distrusted
