"""Coverage beyond reuse: scrubbing, the write-time non-finite check, the lifecycle audit.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that
tests drive it step by step and reach its scheduler to force a scheduler bug.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.engine.harness import INPROC, engine, events, guard_env, steal_on_next_allocation, words
from vllm_kvguard import raise_for_corruption, testing
from vllm_kvguard.errors import KVCacheCorruptionError
from vllm_kvguard.tools.tinymodel import build_tiny_model

pytestmark = pytest.mark.engine
PROMPT = words(17, 128) + " w300 w301"  # 4 full blocks of 32, then 2 tokens


def _greedy(n: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def _text(llm: Any, prompt: str, n: int) -> str:
    return llm.generate([prompt], _greedy(n), use_tqdm=False)[0].outputs[0].text


def _metric(llm: Any, name: str, **labels: str) -> float:
    return sum(
        m.value
        for m in llm.get_metrics()
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())
    )


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _sealed_by(llm: Any, prompt: str) -> list[int]:
    before = llm.collective_rpc(testing.seal_snapshot)[0]
    llm.generate([prompt], _greedy(1), use_tqdm=False)
    after = llm.collective_rpc(testing.seal_snapshot)[0]
    return sorted(b for b, d in after.items() if before.get(b) != d)


def test_scrubber_catches_an_idle_cached_page_before_reuse(tiny_model: str, tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    env = guard_env(
        "quarantine",
        log,
        VLLM_KVGUARD_VERIFY="reuse",  # nothing but the scrubber looks at idle pages
        VLLM_KVGUARD_SCRUB_INTERVAL="0.5s",
        VLLM_KVGUARD_SCRUB_BUDGET="32KiB",  # one block (2 layers x 16 KiB) per step at most
        **INPROC,
    )
    with engine(tiny_model, env, num_gpu_blocks_override=64) as llm:
        blocks = _sealed_by(llm, PROMPT)
        assert len(blocks) == 4
        reference = _text(llm, PROMPT, 16)
        llm.collective_rpc(testing.flip_bit, args=(blocks[1], 0, 5, 3))

        # Unrelated traffic: the scrubber works inside its steps. It earns its pages from
        # wall-clock time, so how many steps that takes depends on how fast they run: another
        # request starts whenever none is left, until the page is caught (bounded in time).
        core = llm.llm_engine
        deadline = time.monotonic() + 300
        started: list[str] = []
        while not events(log, "kv_block_corrupted") and time.monotonic() < deadline:
            if not core.has_unfinished_requests():
                started.append(f"other-{len(started)}")
                core.add_request(started[-1], words(3, 40), _greedy(300))
            core.step()
        (line,) = events(log, "kv_block_corrupted")
        assert line["trigger"] == "scrub" and line["block_id"] == blocks[1]
        assert line["request_ids"] == [] and line["action"] == "quarantined_and_recomputed"
        assert line["layer"].startswith("model.layers.0.")
        while core.has_unfinished_requests():
            core.step()

        # Caught before reuse: the prompt's next reader recomputes and never sees the bad page.
        assert _text(llm, PROMPT, 16) == reference
        assert len(events(log, "kv_block_corrupted")) == 1
        assert _metric(llm, "vllm:kvguard_verifications", trigger="scrub") > 0
        name = "vllm:kvguard_oldest_unverified_page_age_seconds"
        age = [m.value for m in llm.get_metrics() if m.name == name]
        assert len(age) == 1 and 0.0 <= age[0] < 30.0, age


@pytest.mark.parametrize("mode", ["quarantine", "raise"])
def test_nan_written_into_a_page_is_reported_as_nonfinite(tiny_model: str, tmp_path: Path, mode: str) -> None:
    """A fire-drill fault writes NaN into a page between the forward and its seal."""
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env(mode, log, **INPROC)) as llm:
        reference = _text(llm, PROMPT, 16)
    spec = "nan:at=write,layer=1,seed=3"
    with engine(tiny_model, guard_env(mode, log, VLLM_KVGUARD_INJECT=spec, **INPROC)) as llm:
        out = llm.generate([PROMPT], _greedy(16), use_tqdm=False)[0]
        detected = _metric(llm, "vllm:kvguard_corruptions_detected", kind="nonfinite")
    (injected,) = events(log, "kv_fault_injected")
    (line,) = events(log, "kv_block_nonfinite")
    assert line["block_id"] == injected["block_id"] and line["layers"][0].startswith("model.layers.1.")
    assert [r.rsplit("-", 1)[0] for r in line["request_ids"]] == ["0"]
    assert events(log, "kv_block_corrupted") == []  # not reported as a change at rest
    assert [o["outcome"] for o in events(log, "kv_fault_outcome")] == ["detected"]
    assert detected == 1
    if mode == "quarantine":
        assert line["action"] == "recomputed"
        assert out.outputs[0].text == reference
    else:
        assert line["action"] == "requests_failed"
        assert out.outputs[0].finish_reason == "error"
        with pytest.raises(KVCacheCorruptionError, match="non-finite"):
            raise_for_corruption(out)


def test_a_model_that_computes_nan_is_recomputed_once_not_forever(tmp_path: Path) -> None:
    model = build_tiny_model(ROOT / ".cache" / "tiny-model-nan", nan_word=250)
    log = tmp_path / "guard.jsonl"
    with engine(str(model), guard_env("quarantine", log, **INPROC)) as llm:
        prompt = words(17, 20) + " w250 " + words(40, 80)
        clean_before = _text(llm, words(3, 40), 4)  # no w250 in it
        out = llm.generate([prompt], _greedy(8), use_tqdm=False)[0]
        assert out.finished  # no recompute loop
        # The engine keeps serving, and the NaN left in the blocks the request gave back
        # does not poison the next request that gets them (the guard zeroed it).
        assert _text(llm, words(3, 40), 4) == clean_before
    lines = events(log, "kv_block_nonfinite")
    assert lines[0]["action"] == "recomputed"
    assert lines[-1]["action"] == "evicted" and "model computes it" in lines[-1]["reason"]
    assert all(line["action"] in ("recomputed", "evicted") for line in lines)
    assert sum(line["action"] == "recomputed" for line in lines) <= 2  # one retry, not a loop


def test_auditor_catches_a_forced_double_allocation(tiny_model: str, tmp_path: Path) -> None:
    """The test breaks vLLM's allocator once: a running request's half-written block is
    handed to a new request. The guard names both and ends the request whose KV is lost."""
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("quarantine", log, **INPROC), num_gpu_blocks_override=64) as llm:
        core = llm.llm_engine
        scheduler = _scheduler(llm)
        core.add_request("victim", words(11, 40), _greedy(40))
        for _ in range(3):
            core.step()
        (victim,) = [r.request_id for r in scheduler.running]
        held = scheduler.kv_cache_manager.get_block_ids(victim)[0][-1]  # half written, writable
        steal_on_next_allocation(scheduler, held)
        core.add_request("thief", words(90, 20), _greedy(8))
        finished: dict[str, Any] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    finished[out.request_id.rsplit("-", 1)[0]] = out
        assert _text(llm, words(5, 50), 4)  # the engine keeps serving

    (line,) = events(log, "kv_block_lifecycle_violation")
    assert line["block_id"] == held and line["what"] == "allocated_while_held"
    assert line["holder_request_id"] == victim and line["request_id"].startswith("thief")
    assert line["action"] == "requests_failed"
    assert finished["victim"].outputs[0].finish_reason == "error"
    assert "lifecycle violation" in str(finished["victim"].outputs[0].stop_reason)
    # The thief wrote its prompt into the stolen block in the same forward as the victim wrote
    # its next row there: it finishes, or, where the finish check verifies that page before its
    # final output leaves (whether it is due depends on the scrubber's clock), it is ended or
    # flagged by a finding on that block, and the log says so. Never unexplained.
    thief = finished["thief"].outputs[0]
    if thief.finish_reason != "length":
        lines = [e for e in events(log, "kv_request_affected") if e["request_id"].startswith("thief")]
        assert [(e["block_id"], e["outcome"]) for e in lines] == [(held, "failed")], lines
        assert str(thief.stop_reason).startswith("KV-cache corruption: block ")


def _drop_seals(_worker: Any) -> int:
    guard = testing._guard()
    guard.unregister_kv_caches()
    return int(guard.table.sealed.sum())


def test_sleep_mode_unregister_drops_every_seal(tiny_model: str, tmp_path: Path) -> None:
    """vLLM 0.34's sleep mode discards the KV cache and calls unregister_kv_caches: no seal
    may outlive it (every later verification would be a false alarm), and pages written
    after wake-up are sealed anew. The guard also declares no KV hand-off to vLLM."""
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("quarantine", log, **INPROC)) as llm:
        assert _scheduler(llm).requires_kv_delivery is False
        first = _sealed_by(llm, PROMPT)
        assert len(first) == 4
        assert llm.collective_rpc(_drop_seals) == [0]
        assert llm.collective_rpc(testing.seal_snapshot)[0] == {}
        again = _sealed_by(llm, words(201, 64) + " w1")
        assert len(again) == 2
    (line,) = events(log, "kvguard_seals_dropped")
    assert line["pages"] >= 4 and line["reason"] == "kv_cache_unregistered"
