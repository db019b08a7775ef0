"""A valid page served for the wrong tokens: vLLM's block hasher gives two prompts' first
page the same hash (the class of missing-salt, missing-LoRA-id, missing-multimodal-hash and
colliding-hash bugs). The page is intact, so no checksum sees it; the guard's page identity
(digest/identity.py) does, in every verify mode, before the forward that reads it.

Each engine runs the same workload: B's clean text, then the buggy hasher, then A (its pages
cached), then B again, which is served A's first page. The control (guard off) must change
B's text; with the guard on B's text is the clean one (recomputed), or B ends with an error
(raise), or is flagged (log), and the log and metrics say which, once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import (
    BLOCK,
    INPROC,
    core_scheduler,
    engine,
    events,
    greedy,
    guard_env,
    metric,
    run_to_end,
    words,
)
from vllm_kvguard import KVCacheCorruptionError

pytestmark = pytest.mark.engine
PROMPT_A = words(3, 3 * BLOCK) + " w1 w2"
PROMPT_B = words(250, 3 * BLOCK, step=11) + " w1 w2"


def colliding_hasher(llm: Any) -> dict[str, int]:
    """Patch the engine's block hasher: B's first page gets A's first page's hash."""
    core = llm.llm_engine.engine_core.engine_core
    original = core.request_block_hasher
    seen: dict[str, Any] = {}
    tokens_a = None

    def buggy(request: Any) -> list[Any]:
        nonlocal tokens_a
        fresh = not request.block_hashes
        hashes = original(request)
        if not fresh or not hashes:
            return hashes
        head = list(request.all_token_ids[:BLOCK])
        if tokens_a is None:
            tokens_a = head  # the first request after the patch is A
            seen["a"] = hashes[0]
        elif head != tokens_a and "a" in seen:
            hashes[0] = seen["a"]
            seen["collisions"] = seen.get("collisions", 0) + 1
        return hashes

    core.request_block_hasher = buggy
    return seen


def _workload(llm: Any) -> tuple[str, Any, dict[str, Any]]:
    clean = llm.generate([PROMPT_B], greedy(24), use_tqdm=False)[0].outputs[0].text
    seen = colliding_hasher(llm)
    llm.generate([PROMPT_A], greedy(24), use_tqdm=False)
    out = llm.generate([PROMPT_B], greedy(24), use_tqdm=False)[0]
    return clean, out, seen


def test_control_a_colliding_block_hash_changes_the_text(tiny_model: str) -> None:
    with engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}) as llm:
        clean, out, seen = _workload(llm)
        hits = metric(llm, "vllm:prefix_cache_hits")
    assert seen.get("collisions") == 1 and hits >= BLOCK
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text != clean, "the collision must change B's text, else this proves nothing"


@pytest.mark.parametrize(
    ("mode", "verify"),
    [("quarantine", "reuse"), ("quarantine", "paranoid"), ("raise", "sampled"), ("log", "reuse")],
)
def test_identity_check_catches_a_colliding_block_hash(
    tiny_model: str, tmp_path: Path, mode: str, verify: str
) -> None:
    log = tmp_path / "guard.jsonl"
    env = {**guard_env(mode, log, VLLM_KVGUARD_VERIFY=verify, VLLM_KVGUARD_SCRUB_INTERVAL="0"), **INPROC}
    with engine(tiny_model, env) as llm:
        clean, out, seen = _workload(llm)
        counted = metric(llm, "vllm:kvguard_corruptions_detected", kind="identity_mismatch")
        checksum = metric(llm, "vllm:kvguard_corruptions_detected", kind="checksum_mismatch")
        scheduler = core_scheduler(llm)
        leftover = len(scheduler.requests)
    assert seen.get("collisions") == 1 and leftover == 0
    found = events(log, "kv_block_identity_mismatch")
    assert len(found) == 1, found
    (line,) = found
    assert line["position"] == 0 and line["request_id"] != line["sealed_by"]
    assert line["expected_fingerprint"] != line["found_fingerprint"]
    assert counted == 1 and checksum == 0  # the page itself is intact
    text, reason = out.outputs[0].text, out.outputs[0].finish_reason
    (affected,) = events(log, "kv_request_affected")
    assert affected["request_id"] == line["request_id"]
    if mode == "quarantine":
        assert line["action"] == "recomputed" and line["other_holders"] == 0
        assert reason == "length" and text == clean, "recomputed, so B's text is its own"
        assert affected["outcome"] == "healed"
    elif mode == "raise":
        assert line["action"] == "requests_failed"
        assert reason == "error" and KVCacheCorruptionError.parse(str(out.outputs[0].stop_reason)) is not None
        assert affected["outcome"] == "failed"
    else:
        assert line["action"] == "logged" and text != clean
        assert str(out.outputs[0].stop_reason).startswith(KVCacheCorruptionError.PREFIX)
        assert "identity mismatch" in str(out.outputs[0].stop_reason)
        assert affected["outcome"] == "suspect"


def test_a_collision_on_a_page_its_owner_still_reads_ends_the_reader_not_the_owner(
    tiny_model: str, tmp_path: Path
) -> None:
    """A is still decoding from its first page when B is served it: recomputing B into that
    page would overwrite A's KV (and vLLM would let B keep reading it), so B is ended and A
    goes on untouched."""
    log = tmp_path / "guard.jsonl"
    env = {**guard_env("quarantine", log, VLLM_KVGUARD_SCRUB_INTERVAL="0"), **INPROC}
    with engine(tiny_model, env) as llm:
        clean_a = llm.generate([PROMPT_A], greedy(48), use_tqdm=False)[0].outputs[0].text
        llm.reset_prefix_cache()
        seen = colliding_hasher(llm)
        core = llm.llm_engine
        core.add_request("a", PROMPT_A, greedy(48))
        for _ in range(4):
            core.step()
        core.add_request("b", PROMPT_B, greedy(24))
        out = run_to_end(core)
    assert seen.get("collisions") == 1
    (line,) = events(log, "kv_block_identity_mismatch")
    assert line["request_id"].startswith("b") and line["sealed_by"].startswith("a")
    assert line["other_holders"] == 1 and line["action"] == "requests_failed" and line["reason"]
    assert out["b"].outputs[0].finish_reason == "error" and out["b"].outputs[0].token_ids == []
    assert out["a"].outputs[0].text == clean_a, "the page's owner is not touched"
    outcomes = {e["request_id"].rsplit("-", 1)[0]: e["outcome"] for e in events(log, "kv_request_affected")}
    assert outcomes == {"b": "failed"}
