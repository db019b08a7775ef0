"""Read-time verification: a page of a *running* request corrupted mid-decode.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that
the test drives it one scheduler step at a time and corrupts a page between two
decode steps, while the request that owns the page is running.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.harness import engine, events, guard_env, record_invalid_blocks, words
from vllm_kvguard import testing

pytestmark = pytest.mark.engine
PROMPT = words(17, 128) + " w300 w301"  # 4 full blocks of 32, then 2 tokens


def _greedy(n: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def _run_with_mid_decode_flip(llm, log: Path) -> tuple[str, str | None, int | None, list[dict], int]:
    """Return (reference text, corrupted run's text, steps to detection, detections, bad block)."""
    before = llm.collective_rpc(testing.seal_snapshot)[0]
    llm.generate([PROMPT], _greedy(1), use_tqdm=False)
    after = llm.collective_rpc(testing.seal_snapshot)[0]
    prompt_blocks = sorted(b for b, d in after.items() if before.get(b) != d)
    assert len(prompt_blocks) == 4
    reference = llm.generate([PROMPT], _greedy(24), use_tqdm=False)[0].outputs[0].text

    core = llm.llm_engine
    core.add_request("mid-decode", PROMPT, _greedy(24))
    for _ in range(4):  # prefill (prompt pages hit the cache, verified on reuse) + 3 decode steps
        core.step()
    assert events(log, "kv_block_corrupted") == []
    llm.collective_rpc(testing.flip_bit, args=(prompt_blocks[2], 1, 1, 6))
    steps, text, detected_at = 0, None, None
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                text = None if out.outputs[0].finish_reason == "error" else out.outputs[0].text
        steps += 1
        if detected_at is None and events(log, "kv_block_corrupted"):
            detected_at = steps
    return reference, text, detected_at, events(log, "kv_block_corrupted"), prompt_blocks[2]


@pytest.mark.parametrize(
    ("policy", "budget", "every", "bound"),
    [
        ("paranoid", None, None, 1),
        # One page (2 layers x 16 KiB) per step, 4 full pages read and the unfilled page being
        # written (its rows are in the sweep too): caught within 5 steps.
        ("sampled", "32KiB", "1", 5),
        # The default batching: 4 pages every 4th step, caught within 4 x ceil(5 / 4) steps.
        ("sampled", "32KiB", None, 8),
    ],
)
def test_running_request_page_corrupted_mid_decode(
    tiny_model: str, tmp_path: Path, policy: str, budget: str | None, every: str | None, bound: int
) -> None:
    log = tmp_path / "guard.jsonl"
    extra = {"VLLM_KVGUARD_VERIFY": policy, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if budget:
        extra["VLLM_KVGUARD_VERIFY_BUDGET"] = budget
    if every:
        extra["VLLM_KVGUARD_VERIFY_EVERY"] = every
    with engine(tiny_model, guard_env("quarantine", log, **extra), num_gpu_blocks_override=64) as llm:
        handled = record_invalid_blocks(llm)
        reference, text, detected_at, lines, block = _run_with_mid_decode_flip(llm, log)
    (line,) = lines
    assert line["block_id"] == block
    # The text alone cannot show the recompute (this flip happens not to change it): vLLM's
    # bad-block handling got the block, once.
    assert handled == [{block}], handled
    assert detected_at is not None and 1 <= detected_at <= bound, detected_at
    assert line["trigger"] == policy
    if policy == "sampled":
        # Found on a step its reads were batched on (every step at 1; the default: every 4th).
        every_steps = int(every or 4)
        (started,) = [x for x in events(log, "kvguard_started") if x["role"] == "scheduler"]
        assert started["details"]["read_every_steps"] == every_steps
        assert line["step"] % every_steps == 0, line["step"]
    assert line["layer"].startswith("model.layers.1.")
    assert line["action"] == "quarantined_and_recomputed"
    assert [r.rsplit("-", 1)[0] for r in line["request_ids"]] == ["mid-decode"]
    (affected,) = events(log, "kv_request_affected")
    if line["last_good_step"] >= line["step"] - 1:
        # Verified in the step before (paranoid always): no token came from the bad page.
        assert affected["outcome"] == "healed" and text == reference
    else:
        # Read unverified for some steps (sampled): its tokens may come from the flipped page,
        # which the guard cannot rule out, so it ends the request rather than call it healed.
        assert policy == "sampled" and affected["outcome"] == "failed" and text is None


def test_reuse_only_policy_misses_the_running_page(tiny_model: str, tmp_path: Path) -> None:
    """The control: with VLLM_KVGUARD_VERIFY=reuse nothing checks pages being decoded."""
    log = tmp_path / "guard.jsonl"
    extra = {"VLLM_KVGUARD_VERIFY": "reuse", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with engine(tiny_model, guard_env("quarantine", log, **extra), num_gpu_blocks_override=64) as llm:
        _, text, detected_at, lines, _ = _run_with_mid_decode_flip(llm, log)
    assert text is not None
    assert detected_at is None and lines == []
