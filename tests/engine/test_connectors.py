"""The guard beside another KV connector: no false alarm on the pages that connector loads.

vLLM's own ``ExampleConnector`` saves each prompt's KV to disk and loads it back when the
prompt comes again; the plugin puts the guard beside it in a ``MultiConnector``. vLLM tells
the guard ``num_external_tokens=0`` (the tokens were another child's), so pages the other
connector filled once looked like prefix-cache hits on whatever the guard had sealed in those
blocks before: identity mismatches and checksum failures on clean pages, and a clean request
ended with an error. Every run here compares the guard's texts with the same workload with
the guard off, request by request, and requires that the guard reported nothing at all.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.engine.harness import (
    BLOCK,
    FINDINGS,
    INPROC,
    affected_once,
    core_scheduler,
    engine,
    events,
    greedy,
    guard_env,
    honest,
    metric,
    read_log,
    words,
)
from vllm_kvguard.tools import report

pytestmark = pytest.mark.engine
# Three prompts of 4 full pages and 2 tokens (the connector stores whole pages), then three
# others that take the pool's free blocks (with prefix caching on, the first three's cached
# pages are evicted, so their second pass loads them from the connector instead).
PROMPTS = [words(17 + 40 * i, 4 * BLOCK + 2) for i in range(3)]
FILLER = [words(211 + 40 * i, 4 * BLOCK + 2, step=11) for i in range(3)]


def _connector_engine(
    model: str, env: dict[str, str], store: Path, prefix_caching: bool = False, role: str = "kv_both"
) -> contextlib.AbstractContextManager[Any]:
    """An engine with vLLM's ExampleConnector (saving to and loading from ``store``) beside the
    guard, in a pool of 24 blocks, whole prompts in one step (the example connector saves a
    prompt's pages as it is computed)."""
    connector = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return engine(
        model,
        env,
        kv_transfer_config=connector,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=1024,
        num_gpu_blocks_override=24,
    )


def _workload(llm: Any) -> list[str]:
    """The prompts, the filler, the prompts again (their KV loaded by the connector)."""
    texts = []
    for batch in (PROMPTS, FILLER, PROMPTS):
        outs = llm.generate(batch, greedy(16), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        texts += [o.outputs[0].text for o in outs]
    return texts


def _run(model: str, env: dict[str, str], store: Path, prefix_caching: bool) -> tuple[list[str], float]:
    with _connector_engine(model, env, store, prefix_caching) as llm:
        texts = _workload(llm)
        loaded = metric(llm, "vllm:kvguard_pages_loaded", verified="exact")
        assert metric(llm, "vllm:kvguard_pages_loaded", verified="no") == 0
    return texts, loaded


@pytest.fixture(scope="module")
def plain(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, list[str]]:
    """The workload with the guard off, beside the same connector: per prefix-caching setting."""
    out = {}
    for prefix_caching in (True, False):
        store = tmp_path_factory.mktemp("plain-store")
        out[prefix_caching], _ = _run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, store, prefix_caching)
    return out


@pytest.mark.parametrize(
    ("verify", "prefix_caching"),
    [("sampled", True), ("sampled", False), ("reuse", True), ("paranoid", True), ("paranoid", False)],
)
def test_pages_another_connector_loads_raise_no_false_alarm(
    tiny_model: str, tmp_path: Path, plain: dict[bool, list[str]], verify: str, prefix_caching: bool
) -> None:
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, **INPROC, VLLM_KVGUARD_VERIFY=verify, VLLM_KVGUARD_REPAIR="1")
    texts, loaded = _run(tiny_model, env, tmp_path / "store", prefix_caching)
    lines = read_log(log)
    assert [line["event"] for line in lines if line["event"] in FINDINGS] == []
    # Request by request, the same text as with the guard off.
    assert texts == plain[prefix_caching]
    # The second pass really loaded pages through the other connector (4 full pages a prompt,
    # less those still in the local prefix cache), and each was checked against the digests
    # sealed here for the same inputs when they were computed (verified="exact").
    assert loaded >= (4 if prefix_caching else 12), loaded
    started = [line for line in lines if line["event"] == "kvguard_started" and line["role"] == "scheduler"]
    assert started and started[0]["config"]["verify"] == verify


# ------------------------------------------------------------- a connector that loads wrong KV
# The LMCache class of bug (LMCache #4463: KV restored permuted into the pages after vLLM
# changed its layout): the bytes loaded back are not the bytes saved. Reproduced by making the
# example connector's load return each saved tensor reversed in its last axis (head_dim).


def _reversed(t: Any) -> Any:
    return t.flip(-1).contiguous()


def _heads_swapped(t: Any) -> Any:
    """The first two heads traded (the example connector saves [tokens, heads, dim] a layer)."""
    out = t.clone()
    out[:, 0], out[:, 1] = t[:, 1], t[:, 0]
    return out


def _block_off(t: Any) -> Any:
    """A transfer one page (32 tokens) off: each page gets the one before it, the first stays,
    the last is lost."""
    out = t.clone()
    out[BLOCK:] = t[:-BLOCK]
    return out


TRANSFORMS = {"reversed": _reversed, "heads swapped": _heads_swapped, "one block off": _block_off}


@contextlib.contextmanager
def _loads_reversed(store: Path, transform: Any = _reversed) -> Iterator[list[str]]:
    import safetensors.torch

    load_file = safetensors.torch.load_file
    loads: list[str] = []

    def wrong_load(filename: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        tensors = load_file(filename, *args, **kwargs)
        if str(filename).startswith(str(store)):
            loads.append(str(filename))
            return {name: transform(t) for name, t in tensors.items()}
        return tensors

    safetensors.torch.load_file = wrong_load
    try:
        yield loads
    finally:
        safetensors.torch.load_file = load_file


def _bad_load_run(
    model: str, env: dict[str, str], store: Path, transform: Any = _reversed
) -> tuple[list[str], list[Any], float, str]:
    """The prompts computed (and saved), then again with every load reversed: the first
    pass's texts, the second pass's outputs, the pages checked at load, and the load-failure
    policy vLLM's scheduler applies."""
    with _connector_engine(model, env, store) as llm:
        # What vLLM's scheduler does with a block reported unreadable (its top-level policy).
        applied = "recompute" if core_scheduler(llm).recompute_kv_load_failures else "fail"
        first = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(16), use_tqdm=False)]
        with _loads_reversed(store, transform) as loads:
            second = [o.outputs[0] for o in llm.generate(PROMPTS, greedy(16), use_tqdm=False)]
        assert len(loads) >= len(PROMPTS)  # every prompt's layers were loaded (wrongly)
        checked = metric(llm, "vllm:kvguard_pages_loaded", verified="bad")
    return first, second, checked, applied


@pytest.mark.parametrize("wrong", list(TRANSFORMS))
def test_control_a_load_restored_wrong_changes_the_text(tiny_model: str, tmp_path: Path, wrong: str) -> None:
    first, second, _, _ = _bad_load_run(
        tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path / "store", TRANSFORMS[wrong]
    )
    # Served as usual (wrong KV can make a request stop early), with different text.
    assert all(c.finish_reason in ("length", "stop") for c in second)
    assert [c.text for c in second] != first


@pytest.mark.parametrize("wrong", ["heads swapped", "one block off"])
def test_other_wrong_restores_are_caught_at_load_and_healed(
    tiny_model: str, tmp_path: Path, wrong: str
) -> None:
    log = tmp_path / "guard.jsonl"
    first, second, _, _ = _bad_load_run(
        tiny_model, guard_env("quarantine", log, **INPROC), tmp_path / "store", TRANSFORMS[wrong]
    )
    found = events(log, "kv_block_corrupted")
    assert found and {line["trigger"] for line in found} == {"external_load"}
    if wrong == "one block off":
        # Each page but the first holds what the page before it should: a copy, and of which.
        copies = [line for line in found if line["shape"] == "copy_of_block"]
        assert copies and all(line["where"]["source_block"] != line["block_id"] for line in copies)
    else:
        # Two heads traded: nothing of the page as computed is kept but its digests.
        assert {line["shape"] for line in found} == {"undiagnosed"}
        assert all("no syndrome" in line["where"]["why"] for line in found)
    assert set(affected_once(log).values()) == {"healed"}
    assert [c.text for c in second] == first


@pytest.mark.parametrize("mode", ["quarantine", "raise", "log"])
def test_a_load_restored_reversed_is_caught_before_attention_reads_it(
    tiny_model: str, tmp_path: Path, mode: str
) -> None:
    log = tmp_path / "guard.jsonl"
    env = guard_env(mode, log, **INPROC, VLLM_KVGUARD_REPAIR="1")
    first, second, checked, applied = _bad_load_run(tiny_model, env, tmp_path / "store")
    assert checked >= 4 * len(PROMPTS)
    # The start-up line states the policy vLLM applies (it once said "fail" beside a connector
    # in quarantine mode, the guard's child entry's default, while vLLM recomputed).
    # (log mode keeps the user's policy: here vLLM's default, "fail"; the guard reports nothing.)
    assert applied == {"quarantine": "recompute", "raise": "fail", "log": "fail"}[mode]
    started = [e for e in read_log(log) if e["event"] == "kvguard_started" and e["role"] == "scheduler"]
    assert [e["details"]["kv_load_failure_policy"] for e in started] == [applied]
    found = events(log, "kv_block_corrupted")
    assert found and {line["trigger"] for line in found} == {"external_load"}
    assert {line["connector"] for line in found} == {"ExampleConnector"}
    assert not events(log, "kv_block_quarantined")  # a bad load is not bad memory
    # `kvguard report` names the connector and calls it a software fault, not memory.
    summary = report.summarize(report.read_events(log))
    assert summary["by"]["kind"] == {"loaded wrong by ExampleConnector": len(found)}
    assert summary["diagnosis"]["verdict"] == "software: a KV connector loaded wrong KV"
    outcomes = affected_once(log)
    expected = {"quarantine": "healed", "raise": "failed", "log": "suspect"}[mode]
    assert set(outcomes.values()) == {expected} and len(outcomes) == len(PROMPTS)
    for out, clean in zip(second, first, strict=True):
        # Never silently wrong: the same text, an error naming the block, or flagged.
        assert honest(SimpleNamespace(outputs=[out]), clean)
        if mode == "quarantine":
            assert out.text == clean and out.finish_reason == "length"
        elif mode == "raise":
            assert out.finish_reason == "error" and str(out.stop_reason).startswith(
                "KV-cache corruption: block "
            )
        else:
            assert str(out.stop_reason).endswith("(suspect)")


# ------------------------------------------------------------- prefill / decode on one machine
# A kv_producer engine computes the prompts (the connector saves their KV, the guard publishes
# their digests in VLLM_KVGUARD_DIGEST_DIR); a kv_consumer engine, which never computed them,
# loads them and checks them against what the producer published.


def _role_run(
    model: str, env: dict[str, str], store: Path, role: str, reverse: bool = False
) -> tuple[list[Any], float, float]:
    with _connector_engine(model, env, store, role=role) as llm:
        with _loads_reversed(store) if reverse else contextlib.nullcontext():
            outs = [o.outputs[0] for o in llm.generate(PROMPTS, greedy(16), use_tqdm=False)]
        checked = metric(llm, "vllm:kvguard_pages_loaded", verified="exact")
        unchecked = metric(llm, "vllm:kvguard_pages_loaded", verified="no")
    return outs, checked, unchecked


def test_a_consumer_engine_checks_what_it_loads_against_the_producers_digests(
    tiny_model: str, tmp_path: Path
) -> None:
    store, digests = tmp_path / "store", tmp_path / "digests"
    env = {**INPROC, "VLLM_KVGUARD_REPAIR": "1"}
    produced, _, _ = _role_run(
        tiny_model,
        guard_env("quarantine", tmp_path / "producer.jsonl", **env, VLLM_KVGUARD_DIGEST_DIR=str(digests)),
        store,
        "kv_producer",
    )
    texts = [c.text for c in produced]
    assert list(digests.glob("*/*.bin")), "the producer published no digest"
    # Without the producer's digests (and with audits off) the consumer cannot check pages it never
    # computed: counted unverified, sealed as loaded, and never published as a reference.
    empty = tmp_path / "empty"
    alone, checked, unchecked = _role_run(
        tiny_model,
        guard_env(
            "quarantine",
            tmp_path / "alone.jsonl",
            **env,
            VLLM_KVGUARD_DIGEST_DIR=str(empty),
            VLLM_KVGUARD_LOAD_AUDIT="0",
        ),
        store,
        "kv_consumer",
    )
    assert checked == 0 and unchecked >= 4 * len(PROMPTS)
    assert [c.text for c in alone] == texts
    assert sum(f.stat().st_size for f in empty.glob("*/*.bin")) == 0
    # With it: every loaded page checked, the same text, no finding.
    log = tmp_path / "consumer.jsonl"
    consumed, checked, unchecked = _role_run(
        tiny_model,
        guard_env("quarantine", log, **env, VLLM_KVGUARD_DIGEST_DIR=str(digests)),
        store,
        "kv_consumer",
    )
    assert checked >= 4 * len(PROMPTS) and unchecked == 0
    assert [c.text for c in consumed] == texts
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    # A consumer whose loads come back reversed: caught at load, its requests recomputed.
    bad_log = tmp_path / "bad.jsonl"
    healed, _, _ = _role_run(
        tiny_model,
        guard_env("quarantine", bad_log, **env, VLLM_KVGUARD_DIGEST_DIR=str(digests)),
        store,
        "kv_consumer",
        reverse=True,
    )
    found = events(bad_log, "kv_block_corrupted")
    assert found and {line["trigger"] for line in found} == {"external_load"}
    assert set(affected_once(bad_log).values()) == {"healed"}
    assert [c.text for c in healed] == texts


# ------------------------------------------------------------- the same tokens, other bytes
# vLLM is not batch-invariant: the same tokens computed in another batch give other KV bytes.
# Here the KV a forward writes is made to depend on its token count (keys and values scaled by
# 1 + (tokens % 3) / 32), in the guard-off runs as in the guarded ones. A's pages are computed
# and stored by the connector (A alone: 130 tokens), computed again inside B (168 tokens: other
# bytes; the connector stores B apart and keeps A's first copy), then A is loaded from that
# first copy. With one digest kept per identity, the last sealed (B's), every such load was a
# false finding and raise mode failed clean requests.

VARIANT_B = PROMPTS[0] + " " + words(300, 38)
VERIFIED = ("exact", "approx", "bad", "no")


@contextlib.contextmanager
def _batch_variant_kv() -> Iterator[None]:
    from vllm.model_executor.layers.attention.attention import Attention

    forward = Attention.forward

    def variant(self: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        scale = 1.0 + (key.shape[0] % 3) / 32
        return forward(self, query, key * scale, value * scale, *args, **kwargs)

    Attention.forward = variant  # type: ignore[method-assign]
    try:
        yield
    finally:
        Attention.forward = forward  # type: ignore[method-assign]


def _variant_run(
    model: str, env: dict[str, str], store: Path, role: str = "kv_both", prompts: Any = None
) -> Any:
    """Each prompt alone, in order (A, B, A by default), under batch-variant KV: the outputs, the
    pages loaded by how they were verified, and each kept identity's number of digest sets."""
    from vllm_kvguard import testing

    with _batch_variant_kv(), _connector_engine(model, env, store, role=role) as llm:
        outs = [
            llm.generate([p], greedy(16), use_tqdm=False)[0].outputs[0]
            for p in prompts or (PROMPTS[0], VARIANT_B, PROMPTS[0])
        ]
        loaded = {v: metric(llm, "vllm:kvguard_pages_loaded", verified=v) for v in VERIFIED}
        sets = llm.collective_rpc(testing.load_digest_sets)[0] if env.get("VLLM_KVGUARD") == "1" else {}
    return outs, loaded, sets


@pytest.fixture(scope="module")
def variant_plain(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    outs, _, _ = _variant_run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path_factory.mktemp("vstore"))
    return [o.text for o in outs]


def test_control_batch_variant_kv_gives_the_same_pages_other_bytes(tiny_model: str, tmp_path: Path) -> None:
    """What makes the case: A's pages as computed alone and as computed inside B differ."""
    log = tmp_path / "guard.jsonl"
    _, _, sets = _variant_run(
        tiny_model, guard_env("log", log, **INPROC), tmp_path / "store", prompts=[PROMPTS[0], VARIANT_B]
    )
    # A's 4 full pages were sealed twice with other digests (B's fifth page once).
    assert sorted(sets.values()).count(2) == 4, sets


@pytest.mark.parametrize("mode", ["quarantine", "raise", "log"])
def test_a_load_of_an_earlier_computation_is_no_false_alarm(
    tiny_model: str, tmp_path: Path, variant_plain: list[str], mode: str
) -> None:
    log = tmp_path / "guard.jsonl"
    outs, loaded, sets = _variant_run(tiny_model, guard_env(mode, log, **INPROC), tmp_path / "store")
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    # Request by request, the same text as with the guard off in the same schedule.
    assert [o.text for o in outs] == variant_plain
    assert all(o.finish_reason == "length" for o in outs)
    # A's 4 pages were loaded from the connector's first copy and checked against it.
    assert loaded == {"exact": 4, "approx": 0, "bad": 0, "no": 0}
    assert sorted(sets.values()).count(2) >= 4, sets


def test_a_bad_load_is_still_caught_under_batch_variant_kv(tiny_model: str, tmp_path: Path) -> None:
    """Several digests kept per identity loosen nothing for a load that matches none of them:
    A's first copy restored reversed, after A was computed again inside B."""
    log = tmp_path / "guard.jsonl"
    store = tmp_path / "store"
    with (
        _batch_variant_kv(),
        _connector_engine(tiny_model, guard_env("quarantine", log, **INPROC), store) as llm,
    ):
        first = [
            llm.generate([p], greedy(16), use_tqdm=False)[0].outputs[0].text for p in (PROMPTS[0], VARIANT_B)
        ]
        with _loads_reversed(store) as loads:
            again = llm.generate([PROMPTS[0]], greedy(16), use_tqdm=False)[0].outputs[0]
        assert loads
    found = events(log, "kv_block_corrupted")
    assert len(found) >= 4 and {line["trigger"] for line in found} == {"external_load"}
    assert set(affected_once(log).values()) == {"healed"}
    # Healed: recomputed alone, as A was first (same batch, same bytes, same text).
    assert again.text == first[0]


def test_a_consumer_checks_loads_against_every_computation_the_producer_published(
    tiny_model: str, tmp_path: Path
) -> None:
    """Prefill/decode under batch-variant KV: the producer computes A, then A's pages again
    inside B, and publishes both digest sets; the consumer loads A's stored first copy."""
    store, digests = tmp_path / "store", tmp_path / "digests"
    env = {**INPROC, "VLLM_KVGUARD_DIGEST_DIR": str(digests)}
    _variant_run(
        tiny_model,
        guard_env("raise", tmp_path / "producer.jsonl", **env),
        store,
        "kv_producer",
        [PROMPTS[0], VARIANT_B],
    )
    log = tmp_path / "consumer.jsonl"
    consumed, loaded, sets = _variant_run(
        tiny_model, guard_env("raise", log, **env), store, "kv_consumer", [PROMPTS[0]]
    )
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert consumed[0].finish_reason == "length" and loaded == {"exact": 4, "approx": 0, "bad": 0, "no": 0}
    assert sorted(sets.values()).count(2) >= 4, sets  # both of the producer's sets arrived
    # The same text as a guard-off consumer loading the same stored copy.
    plain, _, _ = _variant_run(
        tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, store, "kv_consumer", [PROMPTS[0]]
    )
    assert consumed[0].text == plain[0].text


# ------------------------------------------------------------- without the exact digest
# One digest set kept per identity (VLLM_KVGUARD_LOAD_DIGEST_SETS=1): once A's pages are computed
# again inside B, only B's computation is kept exactly, and A's first copy (what the connector
# loads) matches it in no layer. The sketch of A's first computation, kept beside the digests,
# still tells a clean copy (within the tolerance) from a wrong one (far outside it).
ONE_SET = {"VLLM_KVGUARD_LOAD_DIGEST_SETS": "1"}


@pytest.mark.parametrize("mode", ["quarantine", "raise", "log"])
def test_a_load_whose_exact_digest_is_not_kept_is_verified_by_its_sketch(
    tiny_model: str, tmp_path: Path, variant_plain: list[str], mode: str
) -> None:
    log = tmp_path / "guard.jsonl"
    outs, loaded, sets = _variant_run(
        tiny_model, guard_env(mode, log, **INPROC, **ONE_SET), tmp_path / "store"
    )
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert [o.text for o in outs] == variant_plain
    # No exact digest of A's first computation left: A's 4 loaded pages verified by their sketch.
    assert set(sets.values()) == {1}
    assert loaded == {"exact": 0, "approx": 4, "bad": 0, "no": 0}


# Another engine sharing the connector's store (one that publishes no digests: here with the guard
# off) computed A alone and the connector kept that copy; this engine computed A's pages only
# inside B (other bytes), then loads A: no digest set of its own matches the other engine's bytes,
# and A's sketch (from B's computation) is within the tolerance: batch variance, not a bug.


def _shared_store_run(
    model: str, env: dict[str, str], store: Path, reverse: bool = False, transform: Any = _reversed
) -> tuple[list[Any], dict[str, float]]:
    """Engine 1 (guard off): A alone, stored. Engine 2 (``env``): B, then A loaded from engine
    1's copy (restored reversed with ``reverse``). The three outputs (engine 1's A, engine 2's B
    and A) and engine 2's loads by verdict."""
    with _batch_variant_kv():
        with _connector_engine(model, {"VLLM_KVGUARD": "0", **INPROC}, store) as llm:
            outs = [llm.generate([PROMPTS[0]], greedy(16), use_tqdm=False)[0].outputs[0]]
        with _connector_engine(model, env, store) as llm:
            outs.append(llm.generate([VARIANT_B], greedy(16), use_tqdm=False)[0].outputs[0])
            with _loads_reversed(store, transform) if reverse else contextlib.nullcontext([1]) as loads:
                outs.append(llm.generate([PROMPTS[0]], greedy(16), use_tqdm=False)[0].outputs[0])
            assert loads
            guarded = env.get("VLLM_KVGUARD") == "1"
            verdicts = (
                {v: metric(llm, "vllm:kvguard_pages_loaded", verified=v) for v in VERIFIED} if guarded else {}
            )
    return outs, verdicts


@pytest.fixture(scope="module")
def shared_plain(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    outs, _ = _shared_store_run(
        tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path_factory.mktemp("shared")
    )
    return [o.text for o in outs]


@pytest.mark.parametrize("mode", ["quarantine", "raise", "log"])
def test_a_load_another_engine_computed_is_verified_by_the_sketch_of_our_computation(
    tiny_model: str, tmp_path: Path, shared_plain: list[str], mode: str
) -> None:
    log = tmp_path / "guard.jsonl"
    outs, loaded = _shared_store_run(tiny_model, guard_env(mode, log, **INPROC), tmp_path / "store")
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert [o.text for o in outs] == shared_plain
    # No exact match (engine 2 never saw engine 1's bytes): A's 4 pages verified by their sketch.
    assert loaded == {"exact": 0, "approx": 4, "bad": 0, "no": 0}


@pytest.mark.parametrize(
    ("mode", "outcome", "wrong"),
    [
        ("quarantine", "healed", "reversed"),
        ("raise", "failed", "reversed"),
        ("quarantine", "healed", "heads swapped"),
        ("quarantine", "healed", "one block off"),
    ],
)
def test_a_bad_load_another_engine_computed_is_caught_by_the_sketch(
    tiny_model: str, tmp_path: Path, shared_plain: list[str], mode: str, outcome: str, wrong: str
) -> None:
    transform = TRANSFORMS[wrong]
    # Control: the same wrong load with the guard off changes A's text.
    plain, _ = _shared_store_run(
        tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path / "plain", reverse=True, transform=transform
    )
    assert plain[2].text != shared_plain[2]
    log = tmp_path / "guard.jsonl"
    outs, loaded = _shared_store_run(
        tiny_model, guard_env(mode, log, **INPROC), tmp_path / "store", reverse=True, transform=transform
    )
    # One block off: the first page keeps its own bytes (verified by its sketch), 3 hold another's.
    bad = 3 if wrong == "one block off" else 4
    assert loaded == {"exact": 0, "approx": 4 - bad, "bad": bad, "no": 0}
    found = events(log, "kv_block_corrupted")
    assert len(found) == bad and {line["trigger"] for line in found} == {"external_load"}
    # Each found by its sketch: far outside the tolerance.
    assert all(line["where"]["sketch_distance"] > 0.5 for line in found), [line["where"] for line in found]
    assert set(affected_once(log).values()) == {outcome}
    if outcome == "failed":
        assert outs[2].finish_reason == "error"
    elif bad == 4:  # recomputed alone, as engine 1 computed A: the same bytes, the same text
        assert outs[2].text == shared_plain[0]
    else:
        # Recomputed from its second page on, in a step no reference has (the KV here depends
        # on the step's token count): no text to compare with; it finished, healed.
        assert outs[2].finish_reason == "length"
    assert outs[1].text == shared_plain[1]  # B read no bad page


# ------------------------------------------------------------- other weights, the same model
# A redeploy: the same model path (and name), other weights (a fine-tune pushed in place). The
# producer's stored KV and published digests were computed by the old weights; the consumer must
# never take them for its own computation's.


def _audit_run(model: str, env: dict[str, str], store: Path) -> tuple[list[Any], dict[str, float]]:
    """A consumer loading the prompts the producer stored (one batch): its outputs, and its
    audits and loads by result."""
    with _connector_engine(model, env, store, role="kv_consumer") as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, greedy(16), use_tqdm=False)]
        guarded = env.get("VLLM_KVGUARD") == "1"
        counts = (
            {
                **{
                    f"audit_{r}": metric(llm, "vllm:kvguard_load_audits", result=r)
                    for r in ("match", "mismatch")
                },
                **{v: metric(llm, "vllm:kvguard_pages_loaded", verified=v) for v in VERIFIED},
            }
            if guarded
            else {}
        )
    return outs, counts


@pytest.mark.parametrize("mode", ["quarantine", "raise"])
def test_loads_nobody_here_can_check_are_audited_without_a_false_alarm(
    tiny_model: str, tmp_path: Path, mode: str
) -> None:
    """A consumer without the producer's digests audits its loads (here every one): each refused,
    computed again, compared with what was loaded: all match. No finding, and no request fails,
    in raise mode too (its "fail" policy is set aside for audited pages)."""
    store = tmp_path / "store"
    _role_run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, store, "kv_producer")
    plain, _ = _audit_run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, store)
    log = tmp_path / "guard.jsonl"
    outs, counts = _audit_run(tiny_model, guard_env(mode, log, **INPROC, VLLM_KVGUARD_LOAD_AUDIT="1"), store)
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    # Computed again in the step after the load (the CPU build's KV here is batch-invariant).
    assert [o.text for o in outs] == [o.text for o in plain]
    assert counts["audit_match"] == 4 * len(PROMPTS) and counts["audit_mismatch"] == 0
    assert counts["no"] == 4 * len(PROMPTS)


def test_a_consumer_with_other_weights_never_verifies_the_producers_pages(tmp_path: Path) -> None:
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    model = str(build_tiny_model(tmp_path / "model", seed=0))
    store, digests = tmp_path / "store", tmp_path / "digests"
    env = {**INPROC, "VLLM_KVGUARD_DIGEST_DIR": str(digests)}
    _role_run(model, guard_env("quarantine", tmp_path / "producer.jsonl", **env), store, "kv_producer")
    assert list(digests.glob("*/*.bin")), "the producer published no digest"
    build_tiny_model(tmp_path / "model", seed=1)  # the same path, other weights
    # Control: the old weights' KV, loaded, changes the text the new weights give.
    with engine(model, {"VLLM_KVGUARD": "0", **INPROC}) as llm:
        own = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(16), use_tqdm=False)]
    plain, _, _ = _role_run(model, {"VLLM_KVGUARD": "0", **INPROC}, store, "kv_consumer")
    assert [o.text for o in plain] != own
    log = tmp_path / "consumer.jsonl"
    consumed, counts = _audit_run(model, guard_env("quarantine", log, **env), store)
    # Other weights, another namespace: none of the producer's digests vouches for these pages.
    assert counts["exact"] == 0 and counts["no"] == 4 * len(PROMPTS)
    # Audited (the first loads after start): they differ from what these weights compute. Every
    # load was refused and computed again: the text these weights give, each request healed.
    failed = events(log, "kv_load_audit_failed")
    assert failed and counts["audit_mismatch"] == len(failed)
    assert all(line["sketch_distance"] > 0.5 for line in failed)
    assert len(events(log, "kvguard_connector_distrusted")) == 1
    assert [o.text for o in consumed] == own
    assert set(affected_once(log).values()) == {"healed"} and len(affected_once(log)) == len(PROMPTS)
    started = [e for e in read_log(log) if e["event"] == "kvguard_started" and e["role"] == "scheduler"]
    producer = [
        e
        for e in read_log(tmp_path / "producer.jsonl")
        if e["event"] == "kvguard_started" and e["role"] == "scheduler"
    ]
    weights = started[0]["details"]["weights"], producer[0]["details"]["weights"]
    assert weights[0] != weights[1] and all(w.endswith("(files)") for w in weights), weights


def test_raise_mode_fails_a_bad_load_and_never_an_audited_one_in_the_same_step(
    tmp_path: Path, tiny_model: str
) -> None:
    """One step loads Y (computed here: checked by its digests) and X (computed by another engine
    only: audited), both restored reversed. Raise mode's "fail" policy is set aside for that step
    (X is audited); Y's bad load still fails its request, ended by the guard; X's audit finds the
    wrong KV and X is recomputed: healed, with the text X gets computed alone."""
    x, y = PROMPTS[1], PROMPTS[0]
    store, log = tmp_path / "store", tmp_path / "guard.jsonl"
    with _connector_engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, store) as llm:
        x_alone = llm.generate([x], greedy(16), use_tqdm=False)[0].outputs[0].text
    with _connector_engine(tiny_model, guard_env("raise", log, **INPROC), store) as llm:
        llm.generate([y], greedy(16), use_tqdm=False)  # y computed (and sealed) here
        with _loads_reversed(store) as loads:
            outs = {o.prompt: o.outputs[0] for o in llm.generate([x, y], greedy(16), use_tqdm=False)}
        assert loads
        applied = core_scheduler(llm).recompute_kv_load_failures
    assert applied is False  # vLLM's own policy is back after the step
    assert outs[y].finish_reason == "error"
    assert outs[x].finish_reason == "length" and outs[x].text == x_alone
    assert {line["trigger"] for line in events(log, "kv_block_corrupted")} == {"external_load"}
    assert events(log, "kv_load_audit_failed")
    outcomes = sorted(line["outcome"] for line in events(log, "kv_request_affected"))
    assert outcomes == ["failed", "healed"], outcomes
