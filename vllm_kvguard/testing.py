"""Worker-side helpers for tests and fire drills, run through ``LLM.collective_rpc``.

They reach the guard inside a worker process (vLLM's KV transfer group) to read
which pages are sealed and to corrupt a page on purpose. ``collective_rpc``
with a function needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
"""

from __future__ import annotations

from typing import Any


def _guard() -> Any:
    """The guard's worker side (:class:`~vllm_kvguard.connector.worker.KVGuardWorker`) in this worker."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_kvguard.connector.facade import find_guard

    guard = find_guard(get_kv_transfer_group())
    if guard is None or guard.worker is None or guard.worker.table is None:
        raise RuntimeError("the KV guard is not running in this worker")
    return guard.worker


def flip_bit(
    _worker: Any, block_id: int, layer: int = 0, byte: int = 0, bit: int = 0, rank: int | None = None
) -> list[str]:
    """Flip one bit of one page in this worker's KV memory; return the layer names.

    ``rank``: only the worker of that rank flips (the others return their names).
    """
    import torch

    guard = _guard()
    if rank is not None and guard.rank != rank:
        return guard.pages.names
    page = guard.pages.page(block_id, layer).view(torch.uint8).reshape(-1)
    page[byte] ^= 1 << bit
    return guard.pages.names


def seal_snapshot(_worker: Any = None) -> dict[int, int]:
    """{block id: digest of its first layer} for every sealed block in this worker."""
    import numpy as np

    table = _guard().table
    blocks = np.flatnonzero(table.sealed)
    return dict(zip(blocks.tolist(), table.host_digests(blocks)[:, 0].tolist(), strict=True))


def break_hashing(_worker: Any = None) -> None:
    """Make every page hash in this worker raise: a stand-in for a bug in the guard."""

    def broken(block_ids: Any) -> Any:
        raise RuntimeError("injected guard bug (vllm_kvguard.testing.break_hashing)")

    _guard().pages.digest = broken


def load_digest_sets(_worker: Any = None) -> dict[int, int]:
    """{identity fingerprint: distinct digest sets kept for it} in this worker's store of sealed
    pages' digests (beside another KV connector; empty otherwise)."""
    loaded = getattr(_guard(), "loaded", None)
    return {} if loaded is None else loaded.digests.set_counts()
