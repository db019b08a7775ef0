"""The metric deltas that travel worker -> scheduler -> vLLM's stats path every step."""

from __future__ import annotations

from vllm_kvguard.core.counters import GuardCounters


def _filled() -> GuardCounters:
    c = GuardCounters()
    c.add("sealed", 3)
    c.add("verified", 2, label="sampled")
    c.observe("verify_seconds", 0.5)
    c.set("state_bytes", 10, label="worker")
    return c


def test_take_hands_the_delta_over_and_starts_again_empty() -> None:
    c = _filled()
    expected = c.to_dict()
    taken = c.take()
    assert taken == expected and c.empty() and c.to_dict() == GuardCounters().to_dict()
    c.add("sealed", 1)  # the next step's counts do not reach the delta handed over
    assert taken["counts"] == {"sealed": 3}
    merged = GuardCounters.from_dict(taken)
    merged.absorb(_filled().take())
    assert merged.counts == {"sealed": 6} and merged.labelled == {"verified": {"sampled": 4}}
    assert merged.observations == {"verify_seconds": [0.5, 0.5]}


def test_empty_reads_a_delta_as_written() -> None:
    assert GuardCounters.empty_data({}) and GuardCounters.empty_data(GuardCounters().take())
    zero = GuardCounters()
    zero.add("sealed", 0)
    zero.add("verified", 0, label="reuse")
    assert zero.empty() and GuardCounters.empty_data(zero.to_dict())
    for key in ("sealed", "verified", "verify_seconds", "state_bytes"):
        c = GuardCounters()
        if key == "sealed":
            c.add(key)
        elif key == "verified":
            c.add(key, label="paranoid")
        elif key == "verify_seconds":
            c.observe(key, 0.0)
        else:
            c.set(key, 0, label="worker")
        assert not c.empty() and not GuardCounters.empty_data(c.to_dict()), key
