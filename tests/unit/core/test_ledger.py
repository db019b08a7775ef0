from typing import Any

import pytest

from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.core.plan import BlockState, ScheduledRequest, Violation

BS = 4


def req(req_id, computed, new, fresh, new_blocks, table):
    return ScheduledRequest(req_id, computed, new, fresh, new_blocks, lambda: table)


def test_prefill_seals_only_full_blocks_after_the_step() -> None:
    ledger = BlockLedger(16, BS)
    plan = ledger.plan([req("a", 0, 10, True, [1, 2, 3], [1, 2, 3])])
    assert plan.seal == [1, 2] and plan.verify == [] and plan.forget == []
    assert ledger.state[1] == BlockState.SEALED and ledger.state[3] == BlockState.FILLING


def test_decode_seals_the_block_its_last_slot_fills() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 6, True, [1, 2], [1, 2])])
    assert ledger.plan([req("a", 6, 1, False, [], [1, 2])]).seal == []
    assert ledger.plan([req("a", 7, 1, False, [], [1, 2])]).seal == [2]


def test_prefix_hit_is_verified_and_readers_collected() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 9, True, [1, 2, 3], [1, 2, 3])])
    plan = ledger.plan([req("b", 8, 2, True, [4], [1, 2, 4]), req("c", 4, 3, True, [5], [1, 5])])
    assert plan.verify == [1, 2]
    assert plan.readers == {1: ["b", "c"], 2: ["b"]}


def test_running_requests_are_not_reverified() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 9, True, [1, 2, 3], [1, 2, 3])])
    assert ledger.plan([req("a", 9, 1, False, [], [1, 2, 3])]).verify == []


def test_same_step_hit_on_unsealed_block_is_counted_not_verified() -> None:
    ledger = BlockLedger(16, BS)
    plan = ledger.plan([req("a", 0, 8, True, [1, 2], [1, 2]), req("b", 4, 1, True, [3], [1, 3])])
    # Block 1 is sealed by a's plan earlier in the same step, before b's view.
    assert plan.verify == [1] and plan.unverified_hits == 0
    ledger2 = BlockLedger(16, BS)
    plan2 = ledger2.plan([req("b", 4, 1, True, [3], [7, 3])])
    assert plan2.verify == [] and plan2.unverified_hits == 1


def test_reallocated_sealed_block_is_forgotten_and_gets_new_generation() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 4, True, [1], [1])])
    assert ledger.generation[1] == 1
    plan = ledger.plan([req("b", 0, 4, True, [1], [1])])
    assert plan.forget == [1] and plan.seal == [1]
    assert ledger.generation[1] == 2


def test_resumed_request_verifies_its_hits_again() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 8, True, [1, 2], [1, 2])])
    plan = ledger.plan([req("a", 8, 1, True, [3], [1, 2, 3])])
    assert plan.verify == [1, 2]


def test_quarantined_block_is_never_resealed_and_reuse_is_a_violation() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 4, True, [1], [1])])
    assert ledger.quarantine([1, 1]) == [1]
    assert ledger.quarantine([1]) == []
    assert ledger.quarantined() == 1
    plan = ledger.plan([req("a", 0, 4, False, [], [1])])
    assert plan.seal == []
    ledger.plan([req("x", 4, 1, True, [2], [1, 2])])
    ledger.plan([req("y", 0, 1, True, [1], [1])])
    whats = [v.what for v in ledger.take_violations()]
    assert whats == ["quarantined_block_reused", "quarantined_block_allocated"]
    assert ledger.take_violations() == []


def test_release_returns_block_to_circulation() -> None:
    ledger = BlockLedger(16, BS)
    ledger.quarantine([3])
    ledger.release_quarantined([3])
    assert ledger.state[3] == BlockState.FREE and ledger.quarantined() == 0


def test_idle_sealed_filters_blocks_in_use() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 12, True, [1, 2, 3], [1, 2, 3])])
    assert ledger.idle_sealed(lambda b: b == 2) == [1, 3]


def test_block_table_is_not_fetched_for_plain_decode_steps() -> None:
    ledger = BlockLedger(16, BS)
    calls = []

    def table():
        calls.append(1)
        return [1, 2]

    # Once, when the ledger first sees the request (its mirror of the table); then never.
    ledger.plan([ScheduledRequest("a", 5, 1, False, [], table)])
    ledger.plan([ScheduledRequest("a", 6, 1, False, [], table)])
    plan = ledger.plan([ScheduledRequest("a", 7, 1, False, [], table)])
    assert calls == [1]
    assert (plan.written_blocks.tolist(), plan.written_slots.tolist()) == ([2], [3])


def _running_ledger():
    ledger = BlockLedger(32, BS)
    ledger.plan([req("a", 0, 12, True, [1, 2, 3], [1, 2, 3]), req("b", 0, 8, True, [4, 5], [4, 5])])
    running = [req("a", 12, 1, False, [], [1, 2, 3, 6]), req("b", 8, 1, False, [], [4, 5, 7])]
    return ledger, running


def test_reuse_policy_verifies_no_reads() -> None:
    ledger, running = _running_ledger()
    assert ledger.plan(running, read_budget=0).read_verify == []


def test_paranoid_verifies_every_page_read() -> None:
    ledger, running = _running_ledger()
    assert ledger.plan(running, read_budget=None).read_verify == [1, 2, 3, 4, 5]


def test_sampled_covers_every_page_within_the_bound() -> None:
    ledger, running = _running_ledger()
    budget = 2
    seen: list[int] = []
    steps = -(-5 // budget)  # ceil(pages read per step / budget)
    for _ in range(steps + 1):
        plan = ledger.plan(running, read_budget=budget)
        assert len(plan.read_verify) <= budget
        seen.extend(plan.read_verify)
    assert set(seen) == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("decodes", [False, True])
@pytest.mark.parametrize("every", [1, 2, 4, 7])
@pytest.mark.parametrize("budget", [1, 2, 3])
def test_sampled_reads_batched_every_n_steps_keep_the_bound(every: int, budget: int, decodes: bool) -> None:
    """The sampled reads' sweep, and VLLM_KVGUARD_VERIFY_EVERY: reads verified on every Nth step
    only, N budgets at once, and every page the running requests read verified within
    N x ceil(their pages, a page once per reader / (N x budget)) steps, readers of unequal
    length, a page shared by two readers and an unfilled page (its rows) among them."""
    import numpy as np

    from vllm_kvguard.core.plan import Decodes

    ledger = BlockLedger(32, BS, read_every=every)
    ledger.plan([req("a", 0, 12, True, [1, 2, 3], [1, 2, 3]), req("b", 0, 8, True, [4, 5], [4, 5])])
    ledger.plan([req("c", 8, 2, True, [9], [4, 5, 9])])  # c hits b's two pages, writes 2 rows of 9
    tables = {"a": [1, 2, 3, 6], "b": [4, 5, 7], "c": [4, 5, 9]}
    computed = {"a": 12, "b": 8, "c": 10}
    pages = 3 + 2 + 3  # a's 3, b's 2, c's 2 shared with b and its unfilled 9
    bound = every * -(-pages // (every * budget))
    verified: list[set[int]] = []
    for _ in range(3 * bound + every):
        if decodes:
            views = [req("b", 8, 1, False, [], tables["b"])]
            ids = ["a", "c"]
            batch = Decodes(ids, None, np.array([computed[r] for r in ids], dtype=np.int64), tables.get)
            plan = ledger.plan(views, read_budget=budget, decodes=batch)
        else:
            running = [req(r, computed[r], 1, False, [], t) for r, t in tables.items()]
            plan = ledger.plan(running, read_budget=budget)
        read = plan.read_verify + plan.read_partial
        if plan.step % every:
            assert read == [], plan.step
        else:
            assert 0 < len(read) <= every * budget
        assert set(plan.read_partial) <= {9}
        verified.append(set(read))
    for start in range(len(verified) - bound + 1):
        window = set().union(*verified[start : start + bound])
        assert window == {1, 2, 3, 4, 5, 9}, (start, verified)
    # Reuse (no budget) and paranoid (every page, every step) are not batched.
    running = [req(r, computed[r], 1, False, [], t) for r, t in tables.items()]
    assert ledger.plan(running, read_budget=0).read_verify == []
    assert ledger.plan(running, read_budget=None).read_verify == [1, 2, 3, 4, 5]


def test_read_every_must_be_a_positive_number_of_steps() -> None:
    with pytest.raises(ValueError, match="positive number of steps"):
        BlockLedger(32, BS, read_every=0)


def test_pages_shared_by_readers_are_verified_once_in_first_read_order() -> None:
    """Dedup of a step's reads: each page once, in the order first read."""
    ledger = BlockLedger(32, BS)
    ledger.plan([req("a", 0, 12, True, [1, 2, 3], [1, 2, 3]), req("b", 0, 8, True, [4, 5], [4, 5])])
    ledger.plan([req("c", 8, 2, True, [9], [4, 5, 9])])  # c hits b's two pages
    running = [
        req("b", 8, 1, False, [], [4, 5, 7]),
        req("a", 12, 1, False, [], [1, 2, 3, 6]),
        req("c", 10, 1, False, [], [4, 5, 9]),
    ]
    plan = ledger.plan(running, read_budget=None)
    assert plan.read_verify == [4, 5, 1, 2, 3]
    assert plan.read_partial == [9]  # c's page with rows written, not yet full
    assert all(ledger.verified_step[b] == ledger.step for b in [4, 5, 1, 2, 3, 9])


def test_reads_skip_unsealed_and_quarantined_pages() -> None:
    ledger, running = _running_ledger()
    ledger.quarantine([2])
    assert ledger.plan(running, read_budget=None).read_verify == [1, 3, 4, 5]


def test_block_allocated_while_another_request_writes_it_names_both() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 6, True, [1, 2], [1, 2])])  # a writes block 2 (half full)
    ledger.plan([req("b", 0, 3, True, [2], [2])])  # the allocator hands 2 to b as well
    (v,) = ledger.take_violations()
    assert (v.block_id, v.req_id, v.holder, v.what) == (2, "b", "a", Violation.DOUBLE_ALLOCATION)
    assert ledger.writer[2] == "b"


def test_blocks_given_back_may_be_allocated_again() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 6, True, [1, 2], [1, 2])])
    ledger.release_request("a")  # finished: its half-written block 2 is free
    assert ledger.state[2] == BlockState.FREE and ledger.state[1] == BlockState.SEALED
    ledger.plan([req("b", 0, 3, True, [2], [2])])
    ledger.plan([req("c", 0, 6, True, [3, 4], [3, 4])])
    ledger.plan([req("d", 0, 1, True, [4], [4])], released=["c"])  # c preempted this step
    assert ledger.take_violations() == []


def test_sealed_blocks_have_no_writer() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 8, True, [1, 2], [1, 2])])
    assert ledger.writer == {}
    ledger.release_request("a")  # finished: its full blocks stay cached, held by nobody
    ledger.plan([req("b", 0, 7, True, [1, 2], [1, 2])])  # evicted from the cache, reallocated
    assert ledger.take_violations() == [] and ledger.writer == {2: "b"}


def test_free_block_in_a_running_block_table_is_a_violation() -> None:
    ledger, running = _running_ledger()
    ledger.state[5] = BlockState.FREE  # the ledger saw block 5 given back
    plan = ledger.plan(running, read_budget=None)
    (v,) = ledger.take_violations()
    assert (v.block_id, v.req_id, v.what) == (5, "b", Violation.FREE_BLOCK_READ)
    assert 5 not in plan.read_verify


def test_checked_at_tracks_seals_and_verifications() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 8, True, [1, 2], [1, 2])], now=10.0)
    assert ledger.oldest_unverified_age(15.0) == 5.0
    ledger.plan([req("b", 4, 1, True, [3], [1, 3])], now=12.0)  # block 1 verified on reuse
    assert ledger.checked_at[1] == 12.0 and ledger.oldest_unverified_age(15.0) == 5.0
    assert BlockLedger(4, BS).oldest_unverified_age(3.0) == 0.0


def test_same_step_hit_on_a_block_allocated_later_in_the_step_is_no_violation() -> None:
    """vLLM lists new requests before running ones: b hits block 3, which a (listed
    after b) is given in this same step. Not a double allocation."""
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 8, True, [1, 2], [1, 2])])
    ledger.plan([req("b", 12, 2, True, [4], [1, 2, 3, 4]), req("a", 8, 6, False, [3, 5], [1, 2, 3, 5])])
    assert ledger.take_violations() == []
    assert ledger.writer.get(3) is None and ledger.state[3] == BlockState.SEALED


def test_a_full_block_allocated_while_a_running_request_holds_it_is_a_violation() -> None:
    """Use-after-free of a *full* page: the block pool hands a block still in a running
    request's block table to a new request (the writer audit alone misses it: it is sealed)."""
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 9, True, [1, 2, 3], [1, 2, 3])])
    ledger.plan([req("a", 9, 1, False, [], [1, 2, 3])])
    plan = ledger.plan([req("a", 10, 1, False, [], [1, 2, 3]), req("thief", 0, 4, True, [2], [2])])
    [v] = ledger.take_violations()
    assert (v.block_id, v.what, v.req_id, v.holder) == (2, Violation.DOUBLE_ALLOCATION, "thief", "a")
    assert plan.forget == [2]


def test_a_page_vllm_released_from_a_running_table_is_no_violation_when_reused() -> None:
    """vLLM frees the pages behind a sliding window while their request runs (its table gets
    the null block there) and tells no connector. Handing such a page to another request is no
    double allocation; the ledger asks before reporting, and lets go of it for the holder."""
    ledger = BlockLedger(16, BS)
    tables = {"a": [0, 2, 3]}  # block 1 behind the window: vLLM's null block (0) in its place
    ledger.still_held = lambda req_id, block: block != 0 and block in tables.get(req_id, [])
    ledger.plan([req("a", 0, 9, True, [1, 2, 3], [1, 2, 3])])
    ledger.plan([req("a", 9, 1, False, [], [1, 2, 3]), req("b", 0, 4, True, [1], [1])])
    assert ledger.take_violations() == []
    assert ledger.holders_of(1) == ["b"] and ledger.held[1] == 1
    # A page vLLM's table still has is a real use-after-free: reported as before.
    ledger.plan([req("a", 10, 1, False, [], [1, 2, 3]), req("c", 0, 4, True, [2], [2])])
    [v] = ledger.take_violations()
    assert (v.block_id, v.what, v.req_id, v.holder) == (2, Violation.DOUBLE_ALLOCATION, "c", "a")


def test_a_released_page_read_while_free_is_no_violation_but_a_held_one_is() -> None:
    ledger, running = _running_ledger()
    ledger.state[5] = BlockState.FREE
    ledger.still_held = lambda req_id, block: block != 5
    ledger.plan(running, read_budget=None)
    assert ledger.take_violations() == []
    ledger.state[5] = BlockState.FREE
    ledger.still_held = lambda req_id, block: True
    ledger.plan(running, read_budget=None)
    [v] = ledger.take_violations()
    assert (v.block_id, v.what) == (5, Violation.FREE_BLOCK_READ)


def test_a_shared_prefix_block_counts_every_holder() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 9, True, [1, 2, 3], [1, 2, 3])])
    ledger.plan([req("b", 8, 2, True, [4], [1, 2, 4])])
    assert ledger.held[[1, 2, 3, 4]].tolist() == [2, 2, 1, 1]
    ledger.release_request("a")
    assert ledger.held[[1, 2, 3, 4]].tolist() == [1, 1, 0, 1] and ledger.holders_of(1) == ["b"]
    ledger.release_request("b")
    ledger.plan([req("c", 0, 4, True, [1], [1])])  # cached, held by nobody: a normal reuse
    assert ledger.take_violations() == []


def test_last_good_step_is_the_seal_or_verification_before_the_detection() -> None:
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 8, True, [1, 2], [1, 2])])  # step 1: sealed
    for n in range(8, 12):  # steps 2-5: decoding, pages read unverified (reuse policy)
        ledger.plan([req("a", n, 1, False, [3] if n == 8 else [], [1, 2, 3])])
    assert ledger.last_good_step(1, 6) == 1
    ledger.plan([req("b", 8, 1, True, [4], [1, 2, 4])])  # step 6: a hit, verified before it is read
    # Found bad by the verification planned in step 6: good as of step 1, read unverified since.
    assert ledger.last_good_step(1, 6) == 1
    assert ledger.last_good_step(1, 7) == 6
    # Verified in every step (paranoid): the page was good one step before it was found bad.
    for n in range(12, 15):
        ledger.plan([req("a", n, 1, False, [], [1, 2, 3])], read_budget=None)
    assert ledger.last_good_step(1, ledger.step) == ledger.step - 1


def test_footprint_returns_to_zero_when_requests_end() -> None:
    ledger = BlockLedger(64, BS)
    ledger.plan([req("a", 0, 10, True, [1, 2, 3], [1, 2, 3]), req("b", 0, 5, True, [4, 5], [4, 5])], 1)
    ledger.plan([req("a", 10, 1, False, [], [1, 2, 3]), req("b", 5, 1, False, [], [4, 5])], 1)
    busy = ledger.footprint()
    assert busy["requests"] == 2 and busy["blocks_given"] == 5 and busy["tables"] == 2
    size = ledger.nbytes()
    ledger.release_request("a")
    ledger.release_request("b")  # finished or aborted: vLLM calls request_finished for both
    assert ledger.footprint() == {"requests": 0, "blocks_given": 0, "tables": 0}
    assert ledger.live_requests() == 0 and ledger.nbytes() == size > 64 * 8


def test_plan_lists_sealed_pages_and_hits_by_position_for_the_identity_check() -> None:
    ledger = BlockLedger(16, BS)
    plan = ledger.plan([req("a", 0, 9, True, [1, 2, 3], [1, 2, 3])])
    ((owner, positions, blocks),) = plan.sealed_pages
    assert owner == "a" and positions.tolist() == [0, 1] and blocks.tolist() == [1, 2]
    plan = ledger.plan([req("a", 9, 3, False, [], [1, 2, 3])])
    assert [(o, p.tolist(), b.tolist()) for o, p, b in plan.sealed_pages] == [("a", [2], [3])]
    plan = ledger.plan([req("b", 8, 1, True, [4], [1, 2, 4])])
    assert [(r, b.tolist()) for r, b in plan.hit_pages] == [("b", [1, 2])]


def test_identity_mismatch_names_block_position_both_requests_and_fingerprints() -> None:
    import numpy as np

    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 8, True, [1, 2], [1, 2])])
    ledger.record_identity("a", np.array([1, 2]), np.array([11, 12], dtype=np.uint64))
    same = ledger.identity_mismatches("b", np.array([1, 2]), np.array([11, 12], dtype=np.uint64))
    assert same == []
    (m,) = ledger.identity_mismatches("b", np.array([1, 2]), np.array([11, 99], dtype=np.uint64))
    assert (m.block_id, m.position, m.req_id, m.expected, m.found, m.sealed_by) == (2, 1, "b", 99, 12, "a")
    # Unknown on either side (0) is never a mismatch.
    assert ledger.identity_mismatches("b", np.array([1, 2]), np.array([0, 0], dtype=np.uint64)) == []
    # A block handed to a new writer holds nothing sealed: its fingerprint is forgotten.
    ledger.release_request("a")
    ledger.plan([req("c", 0, 2, True, [2], [2])])
    assert ledger.fingerprint[2] == 0 and ledger.fingerprint[1] == 11
    ledger.forget_identity([1])
    assert ledger.fingerprint[1] == 0


def test_plan_lists_the_rows_each_forward_writes_and_the_blocks_handed_out() -> None:
    ledger = BlockLedger(16, BS)
    plan = ledger.plan([req("a", 0, 6, True, [1, 2], [1, 2])])
    assert plan.given == [1, 2]
    assert list(zip(plan.written_blocks, plan.written_slots, strict=True)) == [
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 0),
        (2, 1),
    ]
    ((owner, positions, blocks),) = plan.given_pages
    assert owner == "a" and positions.tolist() == [0, 1] and blocks.tolist() == [1, 2]
    # Decode: the request's table mirror places the row; a new block is appended at position 2.
    plan = ledger.plan([req("a", 6, 1, False, [], [1, 2])])
    assert (plan.written_blocks.tolist(), plan.written_slots.tolist(), plan.given) == ([2], [2], [])
    ledger.plan([req("a", 7, 1, False, [], [1, 2])])
    plan = ledger.plan([req("a", 8, 1, False, [3], [1, 2, 3])])
    assert (plan.written_blocks.tolist(), plan.written_slots.tolist(), plan.given) == ([3], [0], [3])
    assert plan.given_pages[0][1].tolist() == [2]


def test_unfilled_pages_are_verified_with_the_pages_read_and_owner_keys_roll() -> None:
    import numpy as np

    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 6, True, [1, 2], [1, 2])])
    ledger.record_owners(np.array([1, 2]), np.array([5, 6], dtype=np.uint64))
    plan = ledger.plan([req("a", 6, 1, False, [], [1, 2])], read_budget=None)
    # Block 2 holds 2 rows written before this step: verified with the sealed page 1.
    assert plan.read_verify == [1] and plan.read_partial == [2]
    assert ledger.last_good_step(2, plan.step + 1) == plan.step
    ledger.release_request("a")
    plan = ledger.plan([req("b", 0, 1, True, [2], [2])])
    assert ledger.previous_key[2] == 6 and ledger.owner_key[2] == 0
    # A new owner's page is known good from its own first write on (a previous life's checks
    # do not count).
    assert plan.started.tolist() == [2] and ledger.last_good_step(2, plan.step + 1) == plan.step
    assert ledger.last_good_step(2, plan.step) == -1
    # Unknown owner: never evidence of a lost write; the same computation again neither.
    assert ledger.lost_write_candidates([2, 2]) == []
    ledger.record_owners(np.array([2]), np.array([6], dtype=np.uint64))
    assert ledger.lost_write_candidates([2]) == []
    ledger.record_owners(np.array([2]), np.array([7], dtype=np.uint64))
    assert ledger.lost_write_candidates([2, 2]) == [2]
    assert ledger.lost_write_rows([3, 2]).tolist() == [False, True]
    # Handed out again: its new owner unknown until recorded (the evidence is kept per block,
    # and must follow the keys).
    ledger.release_request("b")
    ledger.plan([req("c", 0, 1, True, [2], [2])])
    assert ledger.previous_key[2] == 7 and ledger.lost_write_candidates([2]) == []
    ledger.record_owners(np.array([2]), np.array([7], dtype=np.uint64))
    assert ledger.lost_write_candidates([2]) == []


@pytest.mark.parametrize("forgotten", [False, True])
def test_a_block_whose_rows_the_worker_forgot_is_no_lost_write_evidence_for_its_next_owner(
    forgotten: bool,
) -> None:
    """After a page's rows changed (or it was reported unreadable, or zeroed) the worker forgets
    them: the next owner's rows there have nothing to be told apart from, so the ledger must
    not send them as lost-write evidence (a drill's lost write would land where it cannot show)."""
    import numpy as np

    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, 6, True, [1, 2], [1, 2])])
    ledger.record_owners(np.array([1, 2]), np.array([5, 6], dtype=np.uint64))
    if forgotten:
        ledger.forget_owners([2])
    ledger.release_request("a")
    ledger.plan([req("b", 0, 1, True, [2], [2])])
    ledger.record_owners(np.array([2]), np.array([7], dtype=np.uint64))
    assert ledger.lost_write_candidates([2]) == ([] if forgotten else [2])


def _sampled_run(few: int) -> list[tuple]:
    """Sampled reads over several steps: shared pages, an unfilled page, a free block in a
    table; views and decodes (as arrays) both; every step's reads and what they marked."""
    import numpy as np

    from vllm_kvguard.core.plan import Decodes

    ledger = BlockLedger(32, BS)
    ledger._FEW_READS = few
    ledger.plan([req("a", 0, 12, True, [1, 2, 3], [1, 2, 3]), req("b", 0, 8, True, [4, 5], [4, 5])])
    ledger.plan([req("c", 8, 2, True, [9], [4, 5, 9])])  # c hits b's two pages
    ledger.plan([req("d", 0, 6, True, [10, 11], [10, 11])])
    ledger.state[11] = BlockState.FREE  # d's table holds a block the ledger saw given back
    out = []
    computed = {"b": 8, "a": 12, "c": 10, "d": 6}
    tables = {"b": [4, 5, 7], "a": [1, 2, 3, 6], "c": [4, 5, 9], "d": [10, 11]}
    for step in range(10):  # (the same decode position each step: enough for the reads)
        views = [req("b", computed["b"], 1, False, [], tables["b"])]
        ids = ["a", "c", "d"]
        decodes = Decodes(ids, None, np.array([computed[r] for r in ids], dtype=np.int64), tables.get)
        budget = 1 + step % 4
        plan = ledger.plan(views, read_budget=budget, now=float(step), decodes=decodes)
        out.append(
            (
                plan.read_verify,
                plan.read_partial,
                [(v.block_id, v.req_id, v.what) for v in ledger.take_violations()],
                ledger.verified_step.tolist(),
                ledger.verified_before.tolist(),
                ledger.checked_at.tolist(),
            )
        )
    return out


def test_sampled_reads_of_a_few_pages_match_the_general_path() -> None:
    """The Python path for a sampled step's few pages (_few_reads) against the numpy path."""
    few, general = _sampled_run(8), _sampled_run(0)
    assert few == general
    assert any(step[0] for step in few) and any(step[1] for step in few) and any(step[2] for step in few)


@pytest.mark.parametrize("use_compiled", [True, False], ids=["compiled", "numpy"])
def test_two_decodes_filling_one_block_close_it_once(
    monkeypatch: pytest.MonkeyPatch, use_compiled: bool
) -> None:
    """Two decodes whose last slot falls in the same block (one handed to both: a double
    allocation) seal it once: one generation more, one entry in the plan's seals per writer as
    vLLM sent them, the same with the compiled closing of the step's pages (which leaves such a
    step to the numpy path) as without."""
    import numpy as np

    from vllm_kvguard.core import compiled as ledger_module
    from vllm_kvguard.core.plan import Decodes

    if not use_compiled:
        monkeypatch.setattr(ledger_module, "_compiled", None)
        monkeypatch.setattr(ledger_module, "_why_not", "ImportError: no numba")
    ledger = BlockLedger(16, BS)
    ledger.plan([req("a", 0, BS - 1, True, [1], [1]), req("b", 0, BS - 1, True, [1], [1])])
    assert [v.what for v in ledger.take_violations()] == [Violation.DOUBLE_ALLOCATION]
    before = int(ledger.generation[1])
    decodes = Decodes(["a", "b"], None, np.array([BS - 1, BS - 1], dtype=np.int64), lambda r: [1])
    plan = ledger.plan([], now=5.0, decodes=decodes)
    assert plan.seal == [1, 1] and ledger.state[1] == BlockState.SEALED
    assert int(ledger.generation[1]) == before + 1
    assert ledger.verified_step[1] == ledger.step and ledger.checked_at[1] == 5.0


def _handout_tables(ledger: BlockLedger) -> tuple[object, ...]:
    """What handing a block to a new writer changes in the ledger, besides its state and table
    (the compiled hand-out writes all of it in one call)."""
    return (
        ledger.held.tolist(),
        ledger.writer,
        ledger.footprint(),
        ledger.verified_before.tolist(),
        ledger.owner_key.tolist(),
        ledger.previous_key.tolist(),
        ledger.lost_evidence.tolist(),
        ledger.fingerprint.tolist(),
    )


@pytest.mark.parametrize("use_compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("case", ["free", "cached", "held", "quarantined", "filling", "twice", "unknown"])
def test_decodes_given_a_block_plan_as_views_would(
    monkeypatch: pytest.MonkeyPatch, case: str, use_compiled: bool
) -> None:
    """A decode handed one new block goes with the decode batch (arrays, one allocation call
    for all of them: the compiled hand-out, or its numpy path); planned as a view per request,
    the step is the same: tables, allocation audit, page identity entries, rows written."""
    import numpy as np

    from vllm_kvguard.core import compiled as ledger_module
    from vllm_kvguard.core.plan import Decodes

    if not use_compiled:
        monkeypatch.setattr(ledger_module, "_compiled", None)
        monkeypatch.setattr(ledger_module, "_why_not", "ImportError: no numba")

    def run(batch: bool):
        ledger = BlockLedger(32, BS)
        # a: 8 tokens (2 full pages); b: 4 (1); c: 8 tokens of a shared prefix, then done.
        ledger.plan([req("a", 0, 8, True, [1, 2], [1, 2]), req("b", 0, 4, True, [3], [3])])
        ledger.plan([req("c", 0, 12, True, [4, 5, 6], [4, 5, 6])])
        ledger.plan([req("d", 0, 2, True, [9], [9])])  # d writes block 9 (half full)
        ledger.release_request("c")  # c finished: 4, 5, 6 stay cached (sealed)
        # Owners' keys (the scheduler records them): a block handed out keeps its last
        # owner's as the previous one (lost-write evidence).
        ledger.record_owners(np.arange(4, 10), np.arange(11, 17, dtype=np.uint64))
        ledger.record_identity("c", np.arange(4, 7), np.arange(21, 24, dtype=np.uint64))
        # (what earlier lives of blocks leave: a hand-out must reset these as well)
        ledger.lost_evidence[4:10], ledger.verified_before[4:10] = True, 3
        if case == "held":
            ledger.plan([req("e", 8, 1, True, [10], [4, 5, 10])])  # e hits 4 and 5: held
        if case == "quarantined":
            ledger.quarantine([7])
        if case == "unknown":  # a: first sight, its table read whole from vLLM
            ledger.release_request("a")
        new = {
            "free": {"a": 7, "b": 8},
            "cached": {"a": 6, "b": 8},
            "held": {"a": 4, "b": 8},
            "quarantined": {"a": 7, "b": 8},
            "filling": {"a": 7, "b": 9},
            "twice": {"a": 7, "b": 7},
            "unknown": {"a": 7, "b": 8},
        }[case]
        full = {"a": [1, 2, new["a"]], "b": [3, new["b"]]}
        computed = {"a": 8, "b": 4}
        if batch:
            ids = ["a", "b"]
            decodes = Decodes(
                ids, None, np.array([computed[r] for r in ids], dtype=np.int64), lambda r: full[r]
            )
            decodes.grown = np.array([0, 1])
            decodes.grown_blocks = np.array([new["a"], new["b"]])
            plan = ledger.plan([], read_budget=None, decodes=decodes)
        else:
            views = [
                ScheduledRequest(r, computed[r], 1, False, [new[r]], lambda r=r: full[r]) for r in ("a", "b")
            ]
            plan = ledger.plan(views, read_budget=None)
        violations = [(v.block_id, v.req_id, v.holder, v.what) for v in ledger.take_violations()]
        return (
            sorted(zip(plan.written_blocks.tolist(), plan.written_slots.tolist(), strict=True)),
            sorted(plan.given),
            sorted(plan.forget),
            sorted(plan.started.tolist()),
            plan.read_verify,
            sorted((r, p.tolist(), b.tolist()) for r, p, b in plan.all_given_pages()),
            sorted(violations),
            [ledger.table(r).tolist() for r in ("a", "b")],
            ledger.state.tolist(),
            ledger.verified_step.tolist(),
            _handout_tables(ledger),
            # The gauge's count, kept as blocks come and go, against a count of the lists.
            ledger.footprint()["blocks_given"] == sum(len(a) for g in ledger._given.values() for a in g),
        ), plan

    (batched, plan), (viewed, _) = run(True), run(False)
    assert batched == viewed and batched[-1] is True
    assert plan.given_decodes is not None and plan.given_pages == []
    violations = batched[6]
    expected = {
        "held": [(4, "a", "e", Violation.DOUBLE_ALLOCATION)],
        "quarantined": [(7, "a", None, Violation.QUARANTINED_ALLOCATED)],
        "filling": [(9, "b", "d", Violation.DOUBLE_ALLOCATION)],
        "twice": [(7, "b", "a", Violation.DOUBLE_ALLOCATION)],
    }.get(case, [])
    assert violations == expected
    if case == "cached":
        assert batched[2] == [6]  # the cached page left the prefix cache for its new writer


def _decode_run(
    monkeypatch: pytest.MonkeyPatch, use_compiled: bool, budget: int | None
) -> tuple[list[tuple], dict[str, int]]:
    """Twelve decode steps of five requests in arrays (rows into pages they hold, a page filled,
    a block given, a request whose mirrored table lacks its page, a quarantined page that
    fills), planned with the ledger's compiled placement or its numpy path; per step what
    the plan says and what the ledger holds after it."""
    import numba
    import numpy as np

    from vllm_kvguard.core import compiled as ledger_module
    from vllm_kvguard.core.plan import Decodes

    calls: dict[str, Any] = {"placed": 0, "fell back": 0, "grown": 0, "closed": 0}
    kernels = ledger_module.compiled()
    assert kernels is not None, ledger_module.backend()

    kinds = calls.setdefault("kinds", set())  # type: ignore[arg-type]
    grow_kinds = calls.setdefault("grow_kinds", set())  # type: ignore[arg-type]
    close_kinds = calls.setdefault("close_kinds", set())  # type: ignore[arg-type]

    class Counted:
        @staticmethod
        def place_decodes(*args):
            got = kernels.place_decodes(*args)
            calls["placed" if got[0] >= 0 else "fell back"] += 1
            kinds.add(tuple(numba.typeof(a) for a in args))  # type: ignore[attr-defined]
            return got

        @staticmethod
        def close_decodes(*args):
            got = kernels.close_decodes(*args)
            calls["closed"] += got[0] >= 0
            close_kinds.add(tuple(numba.typeof(a) for a in args))  # type: ignore[attr-defined]
            return got

        @staticmethod
        def grow_decodes(*args):
            got = kernels.grow_decodes(*args)
            calls["grown"] += got[0] == 0
            grow_kinds.add(tuple(numba.typeof(a) for a in args))  # type: ignore[attr-defined]
            return got

    monkeypatch.setattr(ledger_module, "_compiled", Counted if use_compiled else None)
    monkeypatch.setattr(ledger_module, "_why_not", "" if use_compiled else "ImportError: no numba")
    ledger = BlockLedger(64, BS)
    tables = {"a": [1, 2, 3], "b": [4, 5], "c": [6], "d": [7, 8], "e": [9, 10]}
    computed = {"a": 9, "b": 6, "c": 1, "d": 7, "e": 5}
    ledger.plan([req(r, 0, computed[r], True, list(t), list(t)) for r, t in tables.items()])
    ledger.quarantine([8])  # d's page 1 fills at step 1 and must not be sealed
    spare = iter(range(20, 64))
    out = []
    for step in range(12):
        ids = list(tables)
        grown = [i for i, r in enumerate(ids) if computed[r] == len(tables[r]) * BS]
        for i in grown:
            tables[ids[i]].append(next(spare))
        if step == 5:  # e's page 2 appended in vLLM's table only: the mirror lacks it
            tables["e"].append(next(spare))
            computed["e"] = 2 * BS
        decodes = Decodes(ids, None, np.array([computed[r] for r in ids], dtype=np.int64), tables.get)
        if grown:
            decodes.grown = np.array(grown)
            decodes.grown_blocks = np.array([tables[ids[i]][-1] for i in grown])
        plan = ledger.plan([], read_budget=budget, now=float(step), decodes=decodes)
        sealed, given = plan.sealed_decodes, plan.given_decodes
        filled = sealed and (sealed.req_ids, sealed.positions.tolist(), sealed.blocks.tolist())
        out.append(
            (
                plan.written_blocks.tolist(),
                plan.written_slots.tolist(),
                plan.seal,
                filled,
                plan.started.tolist(),
                plan.given,
                plan.read_verify,
                plan.read_partial,
                ledger.state.tolist(),
                ledger.verified_step.tolist(),
                [ledger.table(r).tolist() for r in ids],
                # What a hand-out changes besides (the compiled grow does it all in one call).
                plan.forget,
                given and (given.req_ids, given.positions.tolist(), given.blocks.tolist()),
                _handout_tables(ledger),
                # What closing a step's pages changes besides (seals, checks).
                ledger.generation.tolist(),
                ledger.checked_at.tolist(),
            )
        )
        for r in ids:
            computed[r] += 1
    return out, calls


@pytest.mark.parametrize("budget", [2, None])
def test_compiled_decode_placement_plans_as_the_numpy_path(
    monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    """The ledger's compiled placement of a decode step (one call: blocks, slots, table
    positions, pages filled and begun, decodes with no full page to read) gives the plans of
    its numpy path, step by step, sampled reads and paranoid; a decode whose page lies past its
    mirrored table sends the step to the numpy path."""
    import numba

    from vllm_kvguard.core import compiled as ledger_module

    compiled, calls = _decode_run(monkeypatch, True, budget)
    numpy_path, none = _decode_run(monkeypatch, False, budget)
    assert compiled == numpy_path
    assert calls["placed"] == 11 and calls["fell back"] == 1 and none["placed"] == none["fell back"] == 0
    # The blocks handed to decodes went through the compiled hand-out (every step that gave one).
    given_steps = sum(1 for step in compiled if step[12])
    assert given_steps >= 3 and calls["grown"] == given_steps and none["grown"] == 0
    # Every kind of arguments the steps passed (fresh and cached, read-only mirror rows among
    # them) is one the ledger compiles when it is made: no step waits for numba.
    warmed = {tuple(numba.typeof(a) for a in args) for args in ledger_module._warm_args()}
    assert len(warmed) == 2 and calls["kinds"] and calls["kinds"] <= warmed
    warmed_grow = {tuple(numba.typeof(a) for a in args) for args in ledger_module._warm_grow_args()}
    assert len(warmed_grow) == 2 and calls["grow_kinds"] and calls["grow_kinds"] <= warmed_grow
    # Pages filled and begun by the decodes closed in one compiled call on the steps that had
    # any (sealed, marked verified); none through it on the numpy path.
    closing = sum(1 for step in compiled if step[3] or step[4])
    assert closing >= 3 and closing - calls["fell back"] <= calls["closed"] <= closing and none["closed"] == 0
    warmed_close = {tuple(numba.typeof(a) for a in args) for args in ledger_module._warm_close_args()}
    assert calls["close_kinds"] and calls["close_kinds"] <= warmed_close
    seals = [step[2] for step in compiled]
    started = [step[4] for step in compiled]
    # Every step verifies some read (a sealed page, or an unfilled page's rows).
    assert any(seals) and any(started) and all(step[6] or step[7] for step in compiled)
    assert all(8 not in s for s in seals)  # the quarantined page was not sealed


@pytest.mark.parametrize("leaving", [0, 1, 2, 5])
@pytest.mark.parametrize("every", [1, 4])
def test_sampled_bound_holds_while_readers_finish(leaving: int, every: int) -> None:
    """Readers ending mid-sweep (issue 43: 8 running requests, some finishing, caught a step or
    two past the stated bound): the sweep goes on from the reader it stopped at, so every page
    the remaining readers read is still verified within N x ceil(pages read / (N x budget))
    steps, pages read counted over the readers running at any time in that window."""
    ledger = BlockLedger(64, BS, read_every=every)
    names = [f"r{i}" for i in range(6)]
    tables = {n: [1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i, n in enumerate(names)}
    ledger.plan([req(n, 0, 12, True, t, t) for n, t in tables.items()])
    budget = 2
    pages = 3 * len(names)
    bound = every * -(-pages // (every * budget))
    last: dict[int, int] = {}
    gaps: dict[int, int] = {}
    for _ in range(6 * bound):
        running = [req(n, 12, 1, False, [], t) for n, t in tables.items()]
        plan = ledger.plan(running, read_budget=budget)
        for block in plan.read_verify:
            if block in last:
                gaps[block] = max(gaps.get(block, 0), plan.step - last[block])
            last[block] = plan.step
        if plan.step % every == 0 and plan.step == 2 * bound:
            # The reader just before the sweep's position, and others, finish.
            for n in names[:leaving]:
                tables.pop(n, None)
                ledger.release_request(n)
    remaining = {b for t in tables.values() for b in t}
    assert remaining <= set(last)
    worst = max(gaps[b] for b in remaining)
    assert worst <= bound, (worst, bound, gaps)


@pytest.mark.parametrize("move", [False, True])
@pytest.mark.parametrize("front", [True, False])
def test_sampled_bound_while_readers_join_or_move(front: bool, move: bool) -> None:
    """Readers joining the sweep (ahead of its position or behind it), and one moving in vLLM's
    order (the first reader to the end, as a request moves from the prefill views to the decode
    batch): every page is still verified within the bound counted over every reader in the
    window, plus one step (the budget's rounding where the sweep meets the joiners), plus the
    moved reader's pages once (it can come round twice in one sweep)."""
    ledger = BlockLedger(96, BS)
    tables = {f"r{i}": [1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(4)}
    ledger.plan([req(n, 0, 12, True, t, t) for n, t in tables.items()])
    budget = 2
    joined = {f"n{i}": [40 + 3 * i, 41 + 3 * i, 42 + 3 * i] for i in range(2)}
    bound = -(-3 * (len(tables) + len(joined)) // budget)
    allowed = bound + 1 + (-(-3 // budget) if move else 0)
    last: dict[int, int] = {}
    gaps: dict[int, int] = {}
    order = list(tables)
    for step in range(6 * bound):
        if step == bound + 1:
            ledger.plan([req(n, 0, 12, True, t, t) for n, t in joined.items()])
            tables |= joined
            order = (list(joined) + order) if front else (order + list(joined))
        if move and step == 3 * bound + 1:
            order = order[1:] + order[:1]
        plan = ledger.plan([req(n, 12, 1, False, [], tables[n]) for n in order], read_budget=budget)
        for block in plan.read_verify:
            if block in last:
                gaps[block] = max(gaps.get(block, 0), plan.step - last[block])
            last[block] = plan.step
    assert set(last) == {b for t in tables.values() for b in t}
    assert max(gaps.values()) <= allowed, (allowed, gaps)
