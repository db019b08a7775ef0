import numpy as np
import pytest

from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.core.plan import BlockState
from vllm_kvguard.core.scrub import Scrubber


def _ledger(sealed: list[int], n: int = 10_000) -> BlockLedger:
    ledger = BlockLedger(n, 16)
    ledger.state[sealed] = BlockState.SEALED
    return ledger


def test_every_sealed_page_is_scrubbed_within_the_interval() -> None:
    sealed = list(range(3, 9_000, 7))  # 1286 pages spread over the pool
    ledger = _ledger(sealed)
    scrub = Scrubber(interval_s=10.0, max_pages_per_step=64)
    seen: list[int] = []
    now = 0.0
    scrub.select(ledger, now)
    while now < 10.0:
        now += 0.02  # 50 steps per second
        seen.extend(scrub.select(ledger, now))
    assert sorted(set(seen)) == sealed  # all of them in one interval...
    assert len(seen) - len(sealed) <= 2  # ...and no page twice (but for float rounding at the end)
    assert ledger.oldest_unverified_age(now) <= 10.0 and not scrub.behind


def test_scrubbing_spends_only_what_the_interval_needs() -> None:
    ledger = _ledger(list(range(100)))
    scrub = Scrubber(interval_s=100.0, max_pages_per_step=64)
    counts = [len(scrub.select(ledger, t * 0.1)) for t in range(101)]
    assert sum(counts) == 10 and max(counts) == 1  # 100 pages / 100 s * 10 s


def test_budget_caps_a_step_and_reports_falling_behind() -> None:
    ledger = _ledger(list(range(5_000)))
    scrub = Scrubber(interval_s=1.0, max_pages_per_step=4)
    scrub.select(ledger, 0.0)
    assert len(scrub.select(ledger, 1.0)) == 4 and scrub.behind


def test_scrub_wraps_round_the_pool_and_skips_unsealed_blocks() -> None:
    ledger = _ledger([2, 5, 9], n=12)
    scrub = Scrubber(interval_s=1.0, max_pages_per_step=2)
    scrub.select(ledger, 0.0)
    picks = [scrub.select(ledger, t * 1.0) for t in range(1, 4)]
    assert picks == [[2, 5], [9, 2], [5, 9]]
    assert ledger.checked_at[9] == 3.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="interval"):
        Scrubber(0.0, 4)


def test_the_compiled_walk_picks_what_the_numpy_walk_picks() -> None:
    """The scrubber's compiled walk (core/_plankernels.py, keeps the GIL) against its numpy
    definition: the same pages and the same cursor, step by step, round the pool and back, with
    pages sealed, filling and freed in between."""
    from vllm_kvguard.core.compiled import compiled

    assert compiled() is not None  # numba is a dependency: the compiled walk is the one that runs
    rng = np.random.default_rng(5)
    state = rng.choice(
        np.array(
            [BlockState.FREE, BlockState.SEALED, BlockState.FILLING, BlockState.QUARANTINED], dtype=np.uint8
        ),
        size=10_000,
        p=[0.5, 0.3, 0.1, 0.1],
    )
    fast, slow = Scrubber(10.0, 64), Scrubber(10.0, 64)
    for step in range(400):
        want = int(rng.integers(1, 300))
        got = fast._next_sealed(state, want)
        assert got == slow._next_sealed_numpy(state, want), step
        assert fast._cursor == slow._cursor and len(got) == min(
            want, np.count_nonzero((state == BlockState.SEALED) | (state == BlockState.FILLING))
        )
        state[rng.integers(0, len(state), 50)] = rng.integers(0, 4, 50).astype(np.uint8)
    count = compiled().count_states(state, int(BlockState.SEALED), int(BlockState.FILLING))  # type: ignore[union-attr]
    assert count == np.count_nonzero((state == BlockState.SEALED) | (state == BlockState.FILLING))
