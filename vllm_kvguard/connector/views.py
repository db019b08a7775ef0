"""vLLM's scheduler output as the ledger sees it: per-request views, the decode batch as
arrays, and what a request's pages are computed from (its inputs, for page identity).
"""

from __future__ import annotations

import bisect
import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_kvguard.core.plan import Decodes, ScheduledRequest
from vllm_kvguard.digest.identity import Media, RequestInputs, context_bytes

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def _same(table: list[int]) -> list[int]:
    return table


def _first_group(manager: Any, req_id: str) -> list[int]:
    # The request's block table (one KV cache group: the guard is inactive with several).
    return manager.get_block_ids(req_id)[0]


def _new_view(
    new: Any, ntok: dict[str, int], spec: dict[str, Any], bs: int, local: dict[str, int] | None = None
) -> ScheduledRequest:
    table = new.block_ids[0]
    num_new = ntok[new.req_id] - len(spec.get(new.req_id, ()))
    nc, loaded = _loaded(new.req_id, new.num_computed_tokens, local)
    return ScheduledRequest(
        new.req_id, nc, num_new + loaded, True, table[nc // bs :], functools.partial(_same, table), loaded
    )


def _loaded(req_id: str, nc: int, local: dict[str, int] | None) -> tuple[int, int]:
    """A fresh request's computed tokens as the ledger sees them, and the tokens another KV
    connector loaded: of ``nc`` computed tokens only the local prefix-cache hits (``local``,
    noted when vLLM asked the connectors for matches) are pages this request reads from the
    cache; the rest were loaded into blocks it was just given, and are sealed, fingerprinted
    and row-hashed after this step like the forward's own writes."""
    if not local:
        return nc, 0
    hits = local.pop(req_id, None)
    if hits is None or hits >= nc:
        return nc, 0
    return hits, nc - hits


def _cached_view(
    cached: Any,
    i: int,
    resumed_ids: Any,
    ntok: dict[str, int],
    spec: dict[str, Any],
    bs: int,
    manager: Any,
    local: dict[str, int] | None = None,
) -> ScheduledRequest:
    req_id = cached.req_ids[i]
    new_ids = cached.new_block_ids[i]
    added = new_ids[0] if new_ids else []
    nc = cached.num_computed_tokens[i]
    num_new = ntok[req_id] - len(spec.get(req_id, ()))
    # vLLM 0.34 sends resumed requests in full with the new ones (no resumed_req_ids).
    resumed = req_id in resumed_ids
    loaded = 0
    if resumed:
        nc, loaded = _loaded(req_id, nc, local)
    return ScheduledRequest(
        req_id,
        nc,
        num_new + loaded,
        resumed,
        added[nc // bs :] if resumed else added,
        functools.partial(_first_group, manager, req_id),
        loaded,
    )


def scheduled_requests(
    so: SchedulerOutput, block_size: int, manager: Any, local: dict[str, int] | None = None
) -> list[ScheduledRequest]:
    """vLLM's scheduler output as the ledger's per-request views (across vLLM versions).
    ``local``: fresh requests' local prefix-cache hits where another connector may have loaded
    more (taken out as their views are made)."""
    spec = so.scheduled_spec_decode_tokens
    ntok = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
    views = [_new_view(new, ntok, spec, block_size, local) for new in so.scheduled_new_reqs]
    return views + [
        _cached_view(cached, i, resumed_ids, ntok, spec, block_size, manager, local)
        for i in range(len(cached.req_ids))
    ]


def step_views(
    so: SchedulerOutput, block_size: int, manager: Any, local: dict[str, int] | None = None
) -> tuple[list[ScheduledRequest], Decodes | None]:
    """vLLM's scheduler output as the ledger sees it: a view per request that changed (new,
    resumed, given several blocks, more than one token) and, as arrays, the running requests
    that only decode one token, into a page they hold or the one block they were given
    (:class:`Decodes`). The same plan as
    :func:`scheduled_requests` (tests/unit/connector/test_scheduler.py); a quiet decode step
    costs a few C-level passes over vLLM's lists, no Python per request."""
    spec = so.scheduled_spec_decode_tokens
    ntok = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    ids = cached.req_ids
    n = len(ids)
    views = [_new_view(new, ntok, spec, block_size, local) for new in so.scheduled_new_reqs]
    if not n:
        return views, None
    resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
    new_blocks = cached.new_block_ids
    total = getattr(so, "total_num_scheduled_tokens", None)
    single = not spec and total is not None and total - sum(v.num_new for v in views) == n
    grown: dict[int, int] = {}  # index -> the one block a plain decode was given
    if single and not resumed_ids and new_blocks.count(None) == n:
        changed: list[int] = []
    else:
        given = [i for i, b in enumerate(new_blocks) if b is not None]
        changed = []
        for i in given:
            added = new_blocks[i]
            assert added is not None
            if len(added) == 1 and len(added[0]) == 1:
                grown[i] = added[0][0]  # one block for its next page: still a plain decode
            else:
                changed.append(i)
        if resumed_ids:
            changed += [i for i, r in enumerate(ids) if r in resumed_ids]
        if not single:
            # Every scheduled request has a token; a step with more than one per request for
            # some (chunked prefill, drafts) sends those through the views.
            changed += [i for i, r in enumerate(ids) if ntok[r] - len(spec.get(r, ())) != 1]
        changed = sorted(set(changed))
        for i in changed:
            grown.pop(i, None)
    nc = np.fromiter(cached.num_computed_tokens, dtype=np.int64, count=n)
    at = None
    if changed:
        views += [
            _cached_view(cached, i, resumed_ids, ntok, spec, block_size, manager, local) for i in changed
        ]
        keep = np.ones(n, dtype=bool)
        keep[changed] = False
        at = np.flatnonzero(keep)
        nc = nc[at]
    if not len(nc):
        return views, None
    decodes = Decodes(ids, at, nc, functools.partial(_first_group, manager))
    if grown:
        index = np.fromiter(grown, dtype=np.int64, count=len(grown))
        if at is not None:
            # Positions among the decodes (bisect, not np.searchsorted: docs/design/decisions.md, "The GIL").
            among = at.tolist()
            index = np.fromiter(
                (bisect.bisect_left(among, i) for i in index.tolist()), dtype=np.int64, count=len(index)
            )
        decodes.grown = index
        decodes.grown_blocks = np.fromiter(grown.values(), dtype=np.int64, count=len(grown))
    return views, decodes


def request_inputs(request: Request) -> RequestInputs:
    """What a request's pages are computed from, read from vLLM's ``Request`` by the guard
    itself (digest/identity.py): its live token list, LoRA adapter (name and path), cache
    salt, multimodal inputs (content hash and placement) and prompt embeddings."""
    lora = getattr(request, "lora_request", None)
    adapter = None
    if lora is not None:
        # Name and path: what the adapter's weights are (the numeric id is the server's handle).
        adapter = f"{getattr(lora, 'lora_name', '')}#" + str(
            getattr(lora, "lora_path", "") or getattr(lora, "path", "")
        )
    media = tuple(
        Media(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
        for f in getattr(request, "mm_features", None) or ()
        if getattr(f, "mm_position", None) is not None
    )
    embeds_tensor = getattr(request, "prompt_embeds", None)
    embeds = None
    if embeds_tensor is not None:

        def embeds(start: int, end: int) -> bytes:
            rows = embeds_tensor[start:end].detach().to("cpu").contiguous()
            return bytes(rows.view(-1).view(torch.uint8).numpy()) if rows.numel() else b""

    return RequestInputs(
        request.all_token_ids,
        context_bytes(lora=adapter, salt=getattr(request, "cache_salt", None)),
        media,
        embeds,
    )
