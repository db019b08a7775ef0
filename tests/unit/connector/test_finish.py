"""The finish check's scheduler side (connector/finish.py): which step ends a request at its
length, and the pages that step checks ahead of its forward instead of a hold. The engine tests
(tests/engine/test_finish.py) show both paths on a real engine; these step the real ledger with
vLLM's per-step request counts as a stand-in ``Request``."""

from __future__ import annotations

import random
from types import SimpleNamespace

from vllm_kvguard.connector.finish import FinishCheck
from vllm_kvguard.connector.metadata import KVGuardMetadata
from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.core.plan import ScheduledRequest

BS = 4


def _request(req_id: str, prompt: int, max_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        sampling_params=object(),
        max_tokens=max_tokens,
        num_prompt_tokens=prompt,
        num_tokens=prompt,
        num_computed_tokens=0,
    )


def _advance(req: SimpleNamespace, scheduled: int, accepted: int = 0) -> None:
    """What vLLM does with the request after the step: positions computed, a token sampled
    (and accepted drafts) once its known tokens are all computed."""
    req.num_computed_tokens += scheduled
    if req.num_computed_tokens >= req.num_tokens:
        req.num_tokens += 1 + accepted


def _step(
    ledger: BlockLedger, check: FinishCheck, scheduled: dict[str, int], views=()
) -> tuple[int, KVGuardMetadata]:
    meta = KVGuardMetadata(ledger.plan(list(views)))
    so = SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens={})
    return check.ahead(meta, so, 0.0), meta


def test_the_last_step_checks_the_pages_not_verified_and_needs_no_hold() -> None:
    ledger = BlockLedger(16, BS)
    check = FinishCheck(ledger, rows=True, max_model_len=512)
    req = _request("a", prompt=10, max_tokens=4)  # ends at 14 tokens
    check.watch(req)
    table = [0, 1, 2, 3]
    found = []
    for step, (new, blocks) in enumerate([(10, [0, 1, 2]), (1, []), (1, []), (1, [3])], start=1):
        view = ScheduledRequest("a", req.num_computed_tokens, new, step == 1, blocks, lambda: table[:4])
        n, meta = _step(ledger, check, {"a": new}, [view])
        found.append(n)
        _advance(req, new)
        if n:
            # Pages 0 and 1 sealed at step 1, page 2 at step 3: none verified in this step.
            assert sorted(meta.finish) == [0, 1, 2]
            assert (ledger.verified_step[[0, 1, 2]] == step).all()
    assert found == [0, 0, 0, 1]
    assert req.num_tokens == 14
    # The step that produced its last token verified every page it holds: nothing to hold.
    assert not check.hold("a", 0, False, 4, ledger.step)
    check.forget("a")
    assert not check._ends


def test_every_length_end_is_foreseen_whatever_the_chunks_preemptions_and_gaps() -> None:
    """Random prefill chunks, steps it is not scheduled in, preemptions (recomputing from 0):
    the request is flagged in exactly the step that samples its last token."""
    rng = random.Random(5)
    for trial in range(200):
        ledger = BlockLedger(8, BS)
        check = FinishCheck(ledger, rows=True, max_model_len=rng.choice([0, 40, 512]))
        req = _request(f"r{trial}", prompt=rng.randint(1, 30), max_tokens=rng.randint(1, 20))
        end = req.num_prompt_tokens + req.max_tokens
        if check.max_model_len:
            end = min(end, check.max_model_len)
        check.watch(req)
        flagged, finished_at = [], None
        for step in range(1, 400):
            scheduled: dict[str, int] = {}
            left = req.num_tokens - req.num_computed_tokens
            if rng.random() < 0.8:
                scheduled = {req.request_id: min(left, rng.randint(1, 9))}
            n, _ = _step(ledger, check, scheduled)
            if n:
                flagged.append(step)
            if scheduled:
                _advance(req, scheduled[req.request_id])
            if req.num_tokens >= end:
                finished_at = step
                break
            if rng.random() < 0.05:  # preempted: recomputed from the start when resumed
                req.num_computed_tokens = 0
                check.watch(req)
        assert finished_at is not None
        assert flagged == [finished_at], (trial, flagged, finished_at)


def _draft_step(ledger: BlockLedger, check: FinishCheck, req: SimpleNamespace, accepted: int) -> int:
    """A decode step with 2 drafts; vLLM keeps ``accepted`` of them and samples one more."""
    meta = KVGuardMetadata(ledger.plan([]))
    so = SimpleNamespace(
        num_scheduled_tokens={req.request_id: 3}, scheduled_spec_decode_tokens={req.request_id: [7, 8]}
    )
    n = check.ahead(meta, so, 0.0)
    req.num_computed_tokens += 1 + accepted
    req.num_tokens += 1 + accepted
    return n


def test_with_drafts_only_the_step_sure_to_end_it_is_foreseen() -> None:
    """With speculative decoding a step may add more than one token: the guard flags only a
    step sure to end the request (its last token sampled even with no draft accepted). One that
    ends earlier, drafts accepted, is held (FinishCheck.hold), never unchecked."""
    for accepted, flagged in (([2, 2], [0, 0]), ([2, 0, 0], [0, 0, 1]), ([0, 0, 0, 0, 0], [0, 0, 0, 0, 1])):
        ledger = BlockLedger(8, BS)
        check = FinishCheck(ledger, rows=True, spec_tokens=2)
        req = _request("s", prompt=4, max_tokens=6)  # ends at 10 tokens
        check.watch(req)
        assert _step(ledger, check, {"s": 4})[0] == 0
        _advance(req, 4)  # 5 tokens
        seen = [_draft_step(ledger, check, req, a) for a in accepted]
        assert seen == flagged, accepted
        assert req.num_tokens >= 10


def test_requests_gone_leave_no_entries_behind() -> None:
    ledger = BlockLedger(8, BS)
    check = FinishCheck(ledger, rows=True)
    for i in range(500):
        check.watch(_request(f"x{i}", prompt=5, max_tokens=10_000))
        check.forget(f"x{i}")
    assert not check._ends and len(check._due) <= 64


def test_requests_ending_together_check_their_shared_pages_once() -> None:
    ledger = BlockLedger(16, BS)
    check = FinishCheck(ledger, rows=True)
    tables = {"a": [0, 1, 2], "b": [0, 1, 3]}
    a, b = _request("a", prompt=10, max_tokens=3), _request("b", prompt=10, max_tokens=2)
    check.watch(a)
    _step(ledger, check, {"a": 10}, [ScheduledRequest("a", 0, 10, True, [0, 1, 2], lambda: tables["a"])])
    _advance(a, 10)  # 11 tokens; pages 0 and 1 sealed
    b.num_computed_tokens = 8  # its prefix hits pages 0 and 1
    check.watch(b)
    views = [
        ScheduledRequest("a", 10, 1, False, [], lambda: tables["a"]),
        ScheduledRequest("b", 8, 2, True, [3], lambda: tables["b"]),
    ]
    assert _step(ledger, check, {"a": 1, "b": 2}, views)[0] == 0
    _advance(a, 1)
    _advance(b, 2)  # both 12 tokens: one more ends each
    views = [
        ScheduledRequest("a", 11, 1, False, [], lambda: tables["a"]),
        ScheduledRequest("b", 10, 1, False, [], lambda: tables["b"]),
    ]
    n, meta = _step(ledger, check, {"a": 1, "b": 1}, views)
    assert n == 2
    both = meta.finish + meta.finish_filling
    assert {0, 1} <= set(both) and len(both) == len(set(both))
    assert meta.finish == sorted(meta.finish)
    assert not check.hold("a", 0, False, 3, ledger.step) and not check.hold("b", 0, False, 2, ledger.step)
