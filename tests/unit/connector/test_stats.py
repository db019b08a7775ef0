"""vLLM's view of the guard's metric deltas (connector/stats.py)."""

from __future__ import annotations

from vllm_kvguard.core.counters import GuardCounters


def _filled() -> GuardCounters:
    c = GuardCounters()
    c.add("sealed", 3)
    c.add("verified", 2, label="sampled")
    c.observe("verify_seconds", 0.5)
    return c


def test_the_stats_object_vllm_merges() -> None:
    from vllm_kvguard.connector.stats import KVGuardStats

    a, b = KVGuardStats(data=_filled().take()), KVGuardStats(data=_filled().take())
    merged = a.aggregate(b)
    assert not merged.is_empty() and KVGuardStats(data={}).is_empty()
    assert merged.reduce()["sealed"] == 6 and merged.reduce()["verified_sampled"] == 4
