"""The core guarantee on a real vLLM engine (CPU build, tiny random-weight Llama).

Engines are expensive (30-40 s each on 2 cores), so each mode gets one engine
shared by the tests of that mode, in the order the tests are written.
"""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import engine, events, greedy, guard_env, preemptions, read_log
from tests.engine.scenario import prompts_b, run_clean, seal_prefix_and_corrupt
from vllm_kvguard import KVCacheCorruptionError, raise_for_corruption

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> dict[str, Any]:
    """Plain vLLM, guard off: the outputs every guarded run must reproduce."""
    with engine(tiny_model, {"VLLM_KVGUARD": "0"}) as llm:
        texts, cached = run_clean(llm)
        return {"texts": texts, "cached": cached, "preemptions": preemptions(llm)}


@pytest.fixture(scope="module")
def quarantine_engine(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("quarantine") / "guard.jsonl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = guard_env("quarantine", log, VLLM_KVGUARD_METRICS_PORT=str(port))
    with engine(tiny_model, env, served_model_name="tiny") as llm:
        llm.metrics_port = port
        yield llm, log


def test_clean_run_with_guard_equals_plain_vllm(reference: dict[str, Any], quarantine_engine) -> None:
    llm, log = quarantine_engine
    texts, cached = run_clean(llm)
    # The workload exercised what it must: prefix hits, preemption (tiny KV pool),
    # chunked prefill (prompts of 150+ tokens, 96-token step budget).
    assert sum(cached) > 0 and sum(reference["cached"]) > 0
    assert preemptions(llm) > 0 and reference["preemptions"] > 0
    assert texts == reference["texts"]
    assert events(log, "kv_block_corrupted") == []
    started = events(log, "kvguard_started")
    assert {line["role"] for line in started} == {"scheduler", "worker"}
    assert started[0]["config"]["mode"] == "quarantine"
    assert events(log, "kvguard_internal_error") == []


def test_bit_flip_is_detected_quarantined_and_recomputed(quarantine_engine) -> None:
    llm, log = quarantine_engine
    bad = seal_prefix_and_corrupt(llm)
    outs = llm.generate(prompts_b(), greedy(16), use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == bad.clean
    assert all(o.outputs[0].finish_reason != "error" for o in outs)
    (line,) = events(log, "kv_block_corrupted")
    assert line["block_id"] == bad.block_id
    assert line["layer"] == bad.layers[0] and line["layers"] == [bad.layers[0]]
    assert line["rank"] == 0 and line["action"] == "quarantined_and_recomputed"
    assert line["expected_digest"] != line["actual_digest"]
    assert len(line["expected_digest"]) == 16
    # The engine's request ids are the caller's ids plus a random suffix.
    assert line["request_ids"] and {r.rsplit("-", 1)[0] for r in line["request_ids"]} <= {
        o.request_id for o in outs
    }
    assert line["level"] == "error" and line["model_name"]
    (q,) = events(log, "kv_block_quarantined")
    assert q["block_id"] == bad.block_id and q["pinned"] is True
    assert {a["outcome"] for a in events(log, "kv_request_affected")} == {"healed"}
    # The finding's line comes first, then what was done about it (the runbook reads them so).
    order = [
        e["event"] for e in read_log(log) if e["event"] in ("kv_block_corrupted", "kv_block_quarantined")
    ]
    assert order == ["kv_block_corrupted", "kv_block_quarantined"]


def test_third_pass_after_quarantine_is_still_correct(quarantine_engine) -> None:
    llm, log = quarantine_engine
    (line,) = events(log, "kv_block_corrupted")
    outs = llm.generate(prompts_b(), greedy(16), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    again = llm.generate(prompts_b(), greedy(16), use_tqdm=False)
    assert [o.outputs[0].text for o in again] == texts
    # No new detection: the quarantined block is out of the prefix cache for good.
    assert len(events(log, "kv_block_corrupted")) == 1
    assert any(o.num_cached_tokens > 0 for o in again)
    del line


def test_standalone_exporter_serves_the_guard_series(quarantine_engine) -> None:
    """The LLM class has no HTTP server: VLLM_KVGUARD_METRICS_PORT exports the same series."""
    from prometheus_client.parser import text_string_to_metric_families

    llm, _ = quarantine_engine
    text = urllib.request.urlopen(f"http://127.0.0.1:{llm.metrics_port}/metrics", timeout=10).read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    base = (("engine", "0"), ("model_name", "tiny"))

    def value(name: str, *extra: tuple[str, str]) -> float:
        return samples[(name, tuple(sorted(base + extra)))]

    assert value("vllm:kvguard_corruptions_detected_total", ("kind", "checksum_mismatch")) == 1
    assert value("vllm:kvguard_blocks_quarantined") == 1
    assert value("vllm:kvguard_requests_affected_total", ("outcome", "healed")) >= 1
    assert value("vllm:kvguard_blocks_sealed_total") > 0
    assert value("vllm:kvguard_verifications_total", ("trigger", "reuse")) > 0


def test_internal_error_is_logged_counted_and_serving_continues(quarantine_engine) -> None:
    llm, log = quarantine_engine
    from vllm_kvguard import testing

    clean = [o.outputs[0].text for o in llm.generate(prompts_b(), greedy(16), use_tqdm=False)]
    llm.collective_rpc(testing.break_hashing)
    outs = llm.generate([*prompts_b(), "w7 " * 40], greedy(16), use_tqdm=False)
    assert [o.outputs[0].text for o in outs[:2]] == clean
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    errors = events(log, "kvguard_internal_error")
    assert errors and all(e["level"] == "error" and "injected guard bug" in e["traceback"] for e in errors)
    assert {e["role"] for e in errors} == {"worker"}
    forwarded = events(log, "kvguard_worker_internal_error")
    assert forwarded and forwarded[0]["role"] == "scheduler"
    text = urllib.request.urlopen(f"http://127.0.0.1:{llm.metrics_port}/metrics", timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("vllm:kvguard_internal_errors_total"))
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_raise_mode_fails_only_the_readers(tiny_model: str, tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("raise", log)) as llm:
        bad = seal_prefix_and_corrupt(llm)
        other = "w1 w2 w3 w4 w5 w6 w7 w8"
        outs = llm.generate([*prompts_b(), other], greedy(16), use_tqdm=False)
        bystander = outs[2]
        (line,) = events(log, "kv_block_corrupted")
        # Requests reach the engine one by one: the readers are those scheduled in
        # the step that verified the page; a later one finds it evicted and recomputes.
        readers = {r.rsplit("-", 1)[0] for r in line["request_ids"]}
        assert readers
        for out, clean in zip(outs[:2], bad.clean, strict=True):
            if out.request_id not in readers:
                assert out.outputs[0].text == clean
                continue
            assert out.outputs[0].finish_reason == "error"
            assert out.outputs[0].stop_reason.startswith("KV-cache corruption: block ")
            # Its hit was verified before the forward: the message says so, never that it
            # emitted tokens computed from the page (true of this request, not the block).
            assert "before this request read it" in out.outputs[0].stop_reason
            assert "unverified" not in out.outputs[0].stop_reason
            with pytest.raises(KVCacheCorruptionError) as info:
                raise_for_corruption(out)
            assert info.value.block_id == bad.block_id and info.value.layer == bad.layers[0]
        assert bystander.outputs[0].finish_reason == "length"
        raise_for_corruption(bystander)
        assert line["action"] == "requests_failed" and line["block_id"] == bad.block_id
        assert line["trigger"] == "reuse"
        assert {a["outcome"] for a in events(log, "kv_request_affected")} == {"failed"}
        # The engine keeps serving, and the prefix recomputes cleanly.
        after = llm.generate(prompts_b(), greedy(16), use_tqdm=False)
        assert [o.outputs[0].text for o in after] == bad.clean


def test_log_mode_only_logs(tiny_model: str, tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("log", log)) as llm:
        bad = seal_prefix_and_corrupt(llm)
        outs = llm.generate(prompts_b(), greedy(16), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        # Nothing healed it: the corrupted page fed attention (which is why log is not the default).
        assert [o.outputs[0].text for o in outs] != bad.clean
        # Nothing is quarantined, so every read of the page is detected (and logged) again.
        lines = events(log, "kv_block_corrupted")
        assert lines
        assert {(line["action"], line["block_id"]) for line in lines} == {("logged", bad.block_id)}
        assert events(log, "kv_block_quarantined") == []
