"""Scheduler-side cost of the ledger's per-step plan, in isolation (no engine).

    python benchmarks/plan_micro.py

Two step shapes on an 8192-block pool: a decode step (16 running requests, one token
each, sampled read verification of 8 pages) and an allocation-heavy step (8 new
requests each hitting 12 cached blocks and given 2 new ones). Medians in µs. Then the
finish check's scheduler side (:func:`finish_check`: held requests; :func:`finish_ahead`:
requests ending at their length, checked in their last step), and the stop-string check
(:func:`stop_strings`: vLLM's incremental detokenizer run in the engine for requests with stop
strings, µs per request per step; needs the tiny model, built in .cache/). The plan cases call
``BlockLedger.plan(requests, read_budget)`` only, so it runs unchanged against older
versions of the ledger too (e.g. ``git worktree add /tmp/old <commit>`` and
``PYTHONPATH=/tmp/old python benchmarks/plan_micro.py``).
"""

from __future__ import annotations

import statistics
import time

from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.core.plan import ScheduledRequest


def _req(req_id: str, computed: int, new: int, fresh: bool, new_blocks: list[int], table: list[int]):
    return ScheduledRequest(req_id, computed, new, fresh, new_blocks, lambda: table)


def decode_step() -> float:
    ledger = BlockLedger(8192, 32)
    tables = {r: list(range(1 + 14 * r, 15 + 14 * r)) for r in range(16)}
    ledger.plan([_req(str(r), 0, 400, True, t, t) for r, t in tables.items()], 8)
    times = []
    for step in range(400):
        requests = [_req(str(r), 400 + step, 1, False, [], t) for r, t in tables.items()]
        start = time.perf_counter()
        ledger.plan(requests, 8)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def allocation_step() -> float:
    times = []
    for _ in range(200):
        ledger = BlockLedger(8192, 32)
        prefixes = {r: list(range(1 + 12 * r, 13 + 12 * r)) for r in range(8)}
        ledger.plan([_req(f"a{r}", 0, 384, True, t, t) for r, t in prefixes.items()], 8)
        requests = [
            _req(f"b{r}", 384, 40, True, [200 + 2 * r, 201 + 2 * r], [*t, 200 + 2 * r, 201 + 2 * r])
            for r, t in prefixes.items()
        ]
        start = time.perf_counter()
        ledger.plan(requests, 8)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def finish_check(pages: int, finishing: int) -> tuple[float, float, int]:
    """The finish check's scheduler side (connector/finish.py): deciding to hold one finished
    request (µs a request) and planning the held requests' pages into the next step (µs a
    step with ``finishing`` of 64 running requests of ``pages`` pages each finished), and the
    pages that step verifies. The workers' side is hashing those pages once each."""
    from vllm_kvguard.connector.finish import FinishCheck
    from vllm_kvguard.connector.metadata import KVGuardMetadata

    ledger = BlockLedger(64 * pages + 8, 32)
    tables = {f"r{i}": list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(64)}
    ledger.plan([_req(r, 0, pages * 32, True, t, t) for r, t in tables.items()])
    plan = ledger.plan([_req(r, pages * 32, 1, False, [], t) for r, t in tables.items()], 4)
    check = FinishCheck(ledger, rows=True)
    holds, plans, verified = [], [], 0
    for _ in range(200):
        check.held.clear()
        start = time.perf_counter()
        for r in list(tables)[:finishing]:
            check.hold(r, 0, False, 10, ledger.step + 1)
        holds.append((time.perf_counter() - start) / finishing)
        meta = KVGuardMetadata(plan)
        start = time.perf_counter()
        check.plan(meta, 0.0)
        plans.append(time.perf_counter() - start)
        verified = len(meta.finish) + len(meta.finish_filling)
    return statistics.median(holds) * 1e6, statistics.median(plans) * 1e6, verified


def finish_ahead(pages: int, finishing: int) -> tuple[float, float, int]:
    """The finish check for requests ending at their length (connector/finish.py, ``ahead``):
    µs a step that ends ``finishing`` of 64 running requests of ``pages`` pages each (none
    verified lately: every page goes into the step's check), µs a step with none due, and the
    pages that step verifies."""
    from types import SimpleNamespace

    from vllm_kvguard.connector.finish import FinishCheck
    from vllm_kvguard.connector.metadata import KVGuardMetadata
    from vllm_kvguard.core.plan import StepPlan

    ledger = BlockLedger(64 * pages + 8, 32)
    tables = {f"r{i}": list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(64)}
    ledger.plan([_req(r, 0, pages * 32, True, t, t) for r, t in tables.items()])
    known = pages * 32 + 1
    so = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(tables, 1), scheduled_spec_decode_tokens={})
    ahead, idle, verified = [], [], 0
    for _ in range(200):
        check = FinishCheck(ledger, rows=True)
        for i, r in enumerate(tables):
            request = SimpleNamespace(
                request_id=r,
                sampling_params=True,
                num_prompt_tokens=pages * 32,
                max_tokens=2 if i < finishing else 64,
                num_tokens=known,
                num_computed_tokens=known - 1,
            )
            check.watch(request)
        meta = KVGuardMetadata(StepPlan(ledger.step + 1))
        start = time.perf_counter()
        check.ahead(meta, so, 0.0)
        ahead.append(time.perf_counter() - start)
        verified = len(meta.finish) + len(meta.finish_filling)
        meta = KVGuardMetadata(StepPlan(ledger.step + 1))
        start = time.perf_counter()
        check.ahead(meta, so, 0.0)
        idle.append(time.perf_counter() - start)
    return statistics.median(ahead) * 1e6, statistics.median(idle) * 1e6, verified


def stop_strings(requests: int, tokens: int = 256) -> float:
    """µs per request per decode step for the engine-side stop-string check (the tiny model's
    tokenizer, one token a step, no stop found: the steady state)."""
    from pathlib import Path
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_kvguard.config import load_config
    from vllm_kvguard.connector.stop_strings import StopStrings
    from vllm_kvguard.logs import GuardLog
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    model = build_tiny_model(Path(__file__).resolve().parents[1] / ".cache" / "tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    stops = StopStrings(None, GuardLog(load_config({})), tokenizer=tokenizer)
    reqs = [
        SimpleNamespace(
            request_id=str(r),
            sampling_params=SamplingParams(max_tokens=tokens, stop=["w479 w478"]),
            prompt_token_ids=tokenizer.convert_tokens_to_ids([f"w{i}" for i in range(64)]),
            prompt_embeds=None,
            output_token_ids=[],
        )
        for r in range(requests)
    ]
    stream = tokenizer.convert_tokens_to_ids([f"w{(7 * i) % 400}" for i in range(tokens)])
    times = []
    for token in stream:
        start = time.perf_counter()
        for req in reqs:
            req.output_token_ids.append(token)
            stops.ends(req, [token])
        times.append(time.perf_counter() - start)
    return statistics.median(times[16:]) * 1e6 / requests


if __name__ == "__main__":
    for _ in range(3):
        print(f"decode step {decode_step():7.1f} us   allocation-heavy step {allocation_step():7.1f} us")
    for pages in (4, 16, 64):
        for finishing in (1, 8):
            hold, plan, verified = finish_check(pages, finishing)
            ahead, idle, ahead_verified = finish_ahead(pages, finishing)
            print(
                f"finish check, {pages:2d} pages a request, {finishing} finishing: held: hold {hold:5.1f} us "
                f"a request, plan {plan:5.1f} us a step, {verified} pages verified; ending at their "
                f"length: {ahead:5.1f} us a step, {idle:4.1f} us with none due, {ahead_verified} pages"
            )
    for requests in (16, 128):
        print(
            f"stop-string check, {requests} requests with stop strings: "
            f"{stop_strings(requests):5.2f} us a request a step"
        )
