"""Start real vLLM (CPU build) engines for tests, with the guard configured by environment.

Rules every engine test follows (vLLM is not batch-invariant: the same tokens in another batch
give other KV bytes, and can give other greedy text):

- A text is compared only with a reference from the same batches: the guard-off run of the exact
  same schedule, or requests run one at a time on both sides, or requests whose batch cannot
  differ. A request the guard fails or holds changes its neighbours' batches: compare the
  requests that read the bad page with a reference that recomputed them in the same batch.
- Every fault test has a guard-off control in the same test that must change the output (the
  control differs from its reference in the fault alone); where a fault cannot change the
  output, the test says what else it proves and asserts that.
- No wall clock: time-based behaviour is driven by an injected clock or by step counts; no
  assertion on throughput.
- Shared helpers live here (``BLOCK``, ``INPROC``, ``greedy``, ``words``, ``engine``, ...), not
  redefined per module.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Tests reach into worker processes (collective_rpc with a function) to corrupt pages.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BLOCK = 32
# The engine core in the test's own process (its scheduler and worker objects reachable).
INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Small enough to force preemption under the clean workload, with chunked prefill.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 96,
    "block_size": BLOCK,
    "max_model_len": 512,
    "max_num_seqs": 8,
    "num_gpu_blocks_override": 20,
    "disable_log_stats": False,
}


_engines = 0


@contextlib.contextmanager
def _collections_of_new_objects() -> Iterator[None]:
    """vLLM collects every generation several times around an engine's life (the model loader,
    ``freeze_gc_heap`` at start, ``gc.unfreeze`` and a collection at shutdown). In a test process
    each of those walks the whole heap of torch, vLLM and the tests: most of an in-process
    engine's 2-3 s of start and stop. Here what already exists is frozen first, vLLM's freeze
    and unfreeze are skipped, so its collections walk only the engine's own objects, which are
    never frozen and are collected after it. Speed only: nothing is left uncollectable."""
    import vllm.v1.engine.core as engine_core

    global _engines
    _engines += 1
    if _engines % 16 == 0:
        # What an engine left in vLLM's globals (the current config, the connector group) is
        # frozen with the rest until the next engine replaces it: let it go now and then.
        gc.unfreeze()
    gc.collect()  # garbage first: frozen objects are never collected (cheap: most are frozen)
    gc.freeze()
    freeze, unfreeze = engine_core.freeze_gc_heap, gc.unfreeze
    engine_core.freeze_gc_heap = lambda: None  # type: ignore[assignment]
    gc.unfreeze = lambda: None
    try:
        yield
    finally:
        engine_core.freeze_gc_heap, gc.unfreeze = freeze, unfreeze  # type: ignore[assignment]


@contextlib.contextmanager
def engine(model: str, env: dict[str, str], **overrides: Any) -> Iterator[Any]:
    from vllm import LLM

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    llm = None
    try:
        with _collections_of_new_objects():
            llm = LLM(model=model, **{**ENGINE_ARGS, **overrides})
        yield llm
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if llm is not None:
            with _collections_of_new_objects():
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
        else:
            # An engine that failed to start in this process (an in-process engine core) can leave
            # its worker's KV connector as vLLM's process-wide transfer group: the next engine
            # here, even with no connector, would take it for its own.
            from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

            ensure_kv_transfer_shutdown()


def guard_env(mode: str, log_file: Path, **extra: str) -> dict[str, str]:
    return {
        "VLLM_KVGUARD": "1",
        "VLLM_KVGUARD_MODE": mode,
        "VLLM_KVGUARD_LOG_FILE": str(log_file),
        # These tests corrupt pages with single bit flips to exercise quarantine, recompute and
        # failure; with repair on (the default) those would be mended in place instead. The
        # repair tests (test_shapes.py, the drill, the server) run with it on.
        "VLLM_KVGUARD_REPAIR": "0",
        **extra,
    }


# What the guard reports when it finds something (its own start lines aside).
FINDINGS = {
    "kv_block_corrupted",
    "kv_block_nonfinite",
    "kv_block_identity_mismatch",
    "kv_block_write_lost",
    "kv_block_lifecycle_violation",
    "kv_block_quarantined",
    "kv_request_affected",
    "kv_load_audit_failed",
    "kvguard_connector_distrusted",
    "kvguard_internal_error",
    "kvguard_worker_internal_error",
}


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(path: Path, name: str) -> list[dict[str, Any]]:
    return [line for line in read_log(path) if line["event"] == name]


def words(start: int, n: int, step: int = 7) -> str:
    """``n`` one-token words (the tiny tokenizer has one token per word)."""
    return " ".join(f"w{(start + i * step) % 400}" for i in range(n))


def preemptions(llm: Any) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def record_invalid_blocks(llm: Any) -> list[set[int]]:
    """Spy on vLLM's own handling of bad blocks (in-process engines only)."""
    return spy_invalid_blocks(llm.llm_engine.engine_core.engine_core.scheduler)


def spy_invalid_blocks(scheduler: Any) -> list[set[int]]:
    """The sets of block ids a vLLM scheduler's ``_handle_invalid_blocks`` receives, one per
    step that had any (recorded, then handled as usual)."""
    seen: list[set[int]] = []
    original = scheduler._handle_invalid_blocks

    def spy(invalid_block_ids: set[int], *args: Any, **kwargs: Any) -> Any:
        seen.append(set(invalid_block_ids))
        return original(invalid_block_ids, *args, **kwargs)

    scheduler._handle_invalid_blocks = spy
    return seen


def kv_layers(worker: Any) -> list[Any]:
    """A worker's KV tensors, one per attention layer (shared ones once), blocks on dim 0 (CPU)."""
    seen: dict[int, Any] = {}
    for t in worker.model_runner.kv_caches:
        seen.setdefault(t.data_ptr(), t)
    return list(seen.values())


def run_to_end(core: Any) -> dict[str, Any]:
    """Step an in-process engine until every request finished; final outputs by the caller's id."""
    finished: dict[str, Any] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finished[out.request_id.rsplit("-", 1)[0]] = out
    return finished


def honest(out: Any, clean: str) -> bool:
    """The contract for one request: the clean text, an error, or flagged by the guard."""
    from vllm_kvguard import KVCacheCorruptionError

    c = out.outputs[0]
    flagged = str(c.stop_reason or "").startswith(KVCacheCorruptionError.PREFIX)
    return c.text == clean or c.finish_reason == "error" or flagged


def affected_once(log: Path) -> dict[str, str]:
    """Each request's ``kv_request_affected`` outcome, by the caller's id; checks it came once."""
    lines = events(log, "kv_request_affected")
    ids = [line["request_id"].rsplit("-", 1)[0] for line in lines]
    assert len(ids) == len(set(ids)), f"reported more than once per request: {ids}"
    return dict(zip(ids, [line["outcome"] for line in lines], strict=True))


def greedy(max_tokens: int, *, ignore_eos: bool = False) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def core_scheduler(llm: Any) -> Any:
    """vLLM's scheduler of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def metric(llm: Any, name: str, **labels: str) -> float:
    return sum(
        m.value
        for m in llm.get_metrics()
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())
    )


def steal_on_next_allocation(scheduler: Any, held: int) -> None:
    """A ref-count bug in vLLM's block pool, once: the next allocation hands out block ``held``,
    which a running request still holds, as if it had been free (its prefix-cache entry, if
    any, is dropped the way the allocator drops a reused block's)."""
    pool = scheduler.kv_cache_manager.block_pool
    allocate = pool.get_new_blocks

    def buggy(num_blocks: int) -> list[Any]:
        pool.get_new_blocks = allocate
        blocks = allocate(num_blocks)
        pool.free_blocks([blocks[0]])
        stolen = pool.blocks[held]
        pool._maybe_evict_cached_block(stolen)
        stolen.ref_cnt += 1
        return [stolen, *blocks[1:]]

    pool.get_new_blocks = buggy


def block_table_of(llm: Any, prompt: str) -> list[int]:
    """Run ``prompt`` to the end; its block table, as vLLM freed it."""
    manager = core_scheduler(llm).kv_cache_manager
    seen: list[list[int]] = []
    free = manager.free

    def spy(request: Any) -> None:
        seen.append(list(manager.get_block_ids(request.request_id)[0]))
        free(request)

    manager.free = spy
    try:
        llm.generate([prompt], greedy(1), use_tqdm=False)
    finally:
        manager.free = free
    (table,) = seen
    return table
