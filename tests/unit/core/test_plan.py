"""The step plan as the workers receive it: vLLM's multiprocess executor pickles it into the
workers' message each step, so it carries only what the workers read."""

from __future__ import annotations

import pickle
from dataclasses import fields

import numpy as np

from vllm_kvguard.core.plan import WORKER_FIELDS, PageBatch, StepPlan


def _full_plan() -> StepPlan:
    blocks = np.array([4, 5], dtype=np.int64)
    return StepPlan(
        7,
        seal=[4],
        forget=[9],
        verify=[5],
        readers={5: ["req-a"]},
        read_verify=[6],
        unverified_hits=3,
        sealed_pages=[("req-a", np.array([0]), blocks[:1])],
        hit_pages=[("req-b", blocks)],
        given=[4, 5],
        written_blocks=blocks,
        written_slots=np.array([0, 31], dtype=np.int64),
        read_partial=[8],
        started=blocks[:1],
        given_pages=[("req-a", np.array([0, 1]), blocks)],
        given_decodes=PageBatch(["req-c"], np.array([2]), blocks[1:]),
        sealed_decodes=PageBatch(["req-c"], np.array([1]), blocks[:1]),
    )


def test_a_pickled_plan_carries_the_workers_fields_and_defaults_the_rest() -> None:
    plan = _full_plan()
    other = pickle.loads(pickle.dumps(plan, protocol=5))
    fresh = StepPlan(0)
    names = [f.name for f in fields(StepPlan)]
    assert set(WORKER_FIELDS) <= set(names)
    for name in names:
        got = getattr(other, name)
        want = getattr(plan, name) if name in WORKER_FIELDS else getattr(fresh, name)
        if isinstance(want, np.ndarray):
            assert (
                isinstance(got, np.ndarray) and got.dtype == want.dtype and got.tolist() == want.tolist()
            ), name
        else:
            assert got == want, name
    # The control: the scheduler's own copy still has every field it set.
    assert plan.hit_pages and plan.given_decodes is not None and plan.unverified_hits == 3


def test_the_pickled_plan_is_smaller_than_the_whole() -> None:
    plan = _full_plan()
    whole = pickle.dumps({f.name: getattr(plan, f.name) for f in fields(StepPlan)}, protocol=5)
    assert len(pickle.dumps(plan, protocol=5)) < len(whole) // 2
