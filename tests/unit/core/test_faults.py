import pytest

from vllm_kvguard.core.faults import FaultKind, FaultSpec, FaultTracker, parse_fault_spec
from vllm_kvguard.errors import KVGuardConfigError


def test_parse_full_spec() -> None:
    specs = parse_fault_spec("bitflip:count=3,seed=7; zero:rate=0.5,after=10 ;nan:layer=1")
    assert specs == [
        FaultSpec(FaultKind.BITFLIP, count=3, seed=7),
        FaultSpec(FaultKind.ZERO, rate=0.5, after=10),
        FaultSpec(FaultKind.NAN, count=1, layer=1),
    ]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("", "no fault given"),
        ("meteor", "unknown fault kind 'meteor'"),
        ("zero:count=0", "count must be >= 1"),
        ("zero:count=x", "count='x' is not an integer"),
        ("zero:rate=2", "rate must be in (0, 1]"),
        ("zero:count=1,rate=0.1", "count or rate, not both"),
        ("zero:colour=red", "'colour=red' is not key=value with a known key"),
        ("zero:seed=1,seed=2", "seed given twice"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, why: str) -> None:
    with pytest.raises(KVGuardConfigError) as info:
        parse_fault_spec(spec)
    assert str(info.value).startswith(f"VLLM_KVGUARD_INJECT={spec!r} is not valid")
    assert why in str(info.value)
    assert "bitflip | overwrite | zero | nan | partial | lost_write | identity" in str(info.value)


def test_count_faults_one_per_step_on_fresh_pages_deterministic() -> None:
    def run():
        tracker = FaultTracker(parse_fault_spec("bitflip:count=2,seed=3;zero:count=1"))
        return [tracker.inject(step, [10, 11, 12], 4) for step in range(5)]

    first = run()
    again = run()
    assert first == again
    assert [len(x) for x in first] == [1, 1, 1, 0, 0]
    assert [x[0].kind for x in first[:3]] == [FaultKind.BITFLIP, FaultKind.BITFLIP, FaultKind.ZERO]
    assert len({x[0].block_id for x in first[:3]}) == 3  # never twice on a pending page
    assert all(0 <= x[0].layer < 4 for x in first[:3])


def test_after_delays_injection() -> None:
    tracker = FaultTracker(parse_fault_spec("zero:after=3"))
    assert [len(tracker.inject(s, [1], 1)) for s in range(5)] == [0, 0, 0, 1, 0]


def test_outcomes_detected_escaped_not_read_no_change() -> None:
    tracker = FaultTracker(parse_fault_spec("bitflip:count=4"))
    ids = {}
    for step, block in enumerate([1, 2, 3, 4]):
        (inj,) = tracker.inject(step, [block], 1)
        ids[block] = inj.fault_id
    assert tracker.allocated([3]) == [ids[3]]
    tracker.no_change(ids[4])
    tracker.verifying(7, [1, 2, 4])
    assert sorted(tracker.verified(7, {1})) == [(ids[1], True), (ids[2], False)]
    assert tracker.verified(7, {1}) == []
    # Ended faults leave nothing behind (a drill at a steady rate runs for hours).
    assert tracker.faults == {} and tracker.footprint() == 0


def test_write_time_faults_are_nan_only_and_read_at_once() -> None:
    from vllm_kvguard.core.faults import FaultSite
    from vllm_kvguard.errors import KVGuardConfigError

    (spec,) = parse_fault_spec("nan:at=write")
    assert spec.at == FaultSite.WRITE
    for bad, why in [("bitflip:at=write", "at=write needs kind nan"), ("nan:at=later", "not rest or write")]:
        with pytest.raises(KVGuardConfigError, match=why):
            parse_fault_spec(bad)
    tracker = FaultTracker(parse_fault_spec("nan:at=write;zero"))
    assert tracker.inject(1, [5, 6], 2, FaultSite.WRITE)[0].at == FaultSite.WRITE
    (rest,) = tracker.inject(1, [7], 2)  # the other spec, at rest
    assert rest.kind == FaultKind.ZERO
    assert tracker.verified(1, {5, 6}) == [(1, True)]  # read by the seal check of step 1


def test_rank_key_targets_one_worker() -> None:
    from vllm_kvguard.errors import KVGuardConfigError

    (spec,) = parse_fault_spec("bitflip:count=1,rank=1")
    assert spec.rank == 1
    (default,) = parse_fault_spec("bitflip")
    assert default.rank is None
    with pytest.raises(KVGuardConfigError, match="rank must be >= 0"):
        parse_fault_spec("bitflip:rank=-1")
    (inj,) = FaultTracker([spec]).inject(0, [5], 2)
    assert inj.rank == 1 and inj.block_id == 5


def test_the_new_kinds_have_their_own_site() -> None:
    from vllm_kvguard.core.faults import FaultSite

    specs = parse_fault_spec("partial:count=2;lost_write:seed=3;identity")
    assert [(s.kind, s.at) for s in specs] == [
        (FaultKind.PARTIAL, FaultSite.FILLING),
        (FaultKind.LOST_WRITE, FaultSite.FORWARD),
        (FaultKind.IDENTITY, FaultSite.CACHE),
    ]
    with pytest.raises(KVGuardConfigError, match="partial has its own site; leave at= out"):
        parse_fault_spec("partial:at=rest")
    with pytest.raises(KVGuardConfigError, match="at='filling' is not rest or write"):
        parse_fault_spec("bitflip:at=filling")


def test_partial_faults_are_read_when_their_rows_are_checked_and_lost_writes_at_once() -> None:
    from vllm_kvguard.core.faults import FaultSite

    tracker = FaultTracker(parse_fault_spec("partial:count=1;lost_write:count=1"))
    (partial,) = tracker.inject(1, [7], 1, FaultSite.FILLING)
    (lost,) = tracker.inject(1, [8], 1, FaultSite.FORWARD)
    assert tracker.verified(1, {8}) == [(lost.fault_id, True)]
    tracker.verifying(3, [7])  # its rows verified (or checked at fill) at step 3
    assert tracker.verified(3, set()) == [(partial.fault_id, False)]
    assert tracker.footprint() == 0


def test_an_identity_fault_is_read_through_either_page_once() -> None:
    from vllm_kvguard.core.faults import FaultSite

    tracker = FaultTracker(parse_fault_spec("identity:count=1"))
    (fault,) = tracker.inject(1, [4], 1, FaultSite.CACHE)
    tracker.pair(fault.fault_id, 9)
    tracker.verifying(2, [9])
    tracker.verifying(2, [4])  # the other page in the same step: still one fault
    assert tracker.verified(2, {9}) == [(fault.fault_id, True)]
    assert tracker.allocated([4]) == [] and tracker.footprint() == 0


def test_a_load_fault_has_its_own_site_and_is_read_where_it_is_injected() -> None:
    from vllm_kvguard.core.faults import FaultSite, FaultTracker, parse_fault_spec

    (spec,) = parse_fault_spec("load:count=1,seed=2")
    assert spec.at == FaultSite.LOAD
    with pytest.raises(KVGuardConfigError, match="load has its own site"):
        parse_fault_spec("load:at=rest")
    tracker = FaultTracker([spec])
    assert tracker.inject(3, [7], 2, FaultSite.REST) == []  # not at rest
    (injection,) = tracker.inject(3, [7], 2, FaultSite.LOAD)
    assert injection.block_id == 7 and injection.at == FaultSite.LOAD
    # Checked in the step that loads it: its verdict comes with that step's output.
    assert tracker.verified(3, {7}) == [(injection.fault_id, True)]
