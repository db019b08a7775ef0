"""Scheduler-side cost of the ledger's per-step plan, in isolation (no engine).

    python benchmarks/plan_micro.py

Two step shapes on an 8192-block pool: a decode step (16 running requests, one token
each, sampled read verification of 8 pages) and an allocation-heavy step (8 new
requests each hitting 12 cached blocks and given 2 new ones). Medians in µs. It calls
``BlockLedger.plan(requests, read_budget)`` only, so it runs unchanged against older
versions of the ledger too (e.g. ``git worktree add /tmp/old <commit>`` and
``PYTHONPATH=/tmp/old python benchmarks/plan_micro.py``).
"""

from __future__ import annotations

import statistics
import time

from vllm_kvguard.core.ledger import BlockLedger, ScheduledRequest


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


if __name__ == "__main__":
    for _ in range(3):
        print(f"decode step {decode_step():7.1f} us   allocation-heavy step {allocation_step():7.1f} us")
