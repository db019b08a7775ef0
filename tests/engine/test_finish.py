"""The default mode's window closed: no final text computed from a page that fails its checksum.

``sampled`` verification sweeps the pages running requests read, a few a step, so a page that
goes bad is caught some steps later. A request that finishes inside that window used to leave
with text computed from the bad page and no flag. The finish check (connector/finish.py) holds
such a request's final output until the pages it read since they were last verified are
verified again.

The class reproduced: prefix pages read by three running requests are scrambled while one of
them is a few tokens from its end (a stray write, a DMA gone astray: tests/engine/test_integrity.py's
``scramble``). The control (guard off) shows that request's text changes; without the finish
check it leaves changed and unflagged; with it, every request ends with its clean text, failed,
or flagged, and the log says which. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the test can step it and corrupt between two steps.

The short request ends three ways: at its length (``max_tokens``: the guard knows the step of its
last token and checks its pages before that step's forward, no hold), on a stop token id (which
no one can foresee: its final output is held one step while its pages are checked), or on a stop
string (found by vLLM's front end after the text left the engine, once a hole in the check; now
found in the engine too and held like a stop token: connector/stop_strings.py). A logits
processor (vLLM's own per-request interface) makes it produce that token exactly at its
``ENDING + 1``-th token and never before, whatever the scrambled page does to its other tokens.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import (
    BLOCK,
    INPROC,
    affected_once,
    core_scheduler,
    engine,
    events,
    greedy,
    guard_env,
    honest,
    metric,
    words,
)
from tests.engine.test_integrity import scramble

pytestmark = pytest.mark.engine
PREFIX = words(17, 8 * BLOCK)  # 8 full pages shared by every request
ENDING = 12  # the short request's max_tokens
LEFT = 3  # its tokens still to come when the page is scrambled
PROMPTS = {"ending": PREFIX + " w300 w301", "b": PREFIX + " w302 w303", "c": PREFIX + " w304 w305"}
MAX_TOKENS = {"ending": ENDING, "b": 32, "c": 32}
# One page (2 layers x 16 KiB) verified per step on average, 4 on every 4th step: the three
# readers' 27 page reads come round in about 28 steps, far more than the 3 the short request has.
SAMPLED = {"VLLM_KVGUARD_VERIFY_BUDGET": "32KiB", "VLLM_KVGUARD_SCRUB_INTERVAL": "0"}
STOP_TOKEN = 11  # the stop token id the short request ends on, in the "stop" cases
STOP_WORD, STOP_WORD_ID = "w433", 436  # the stop string it ends on in the "string" cases, and its token
ENDS = ("length", "stop", "string")
FINISH = {"length": "length", "stop": "stop", "string": "stop"}  # vLLM's finish_reason for each
STOP_REASON = {"length": None, "stop": STOP_TOKEN, "string": STOP_WORD}


@functools.cache
def stop_at_processor() -> type:
    """A vLLM logits processor that makes a request produce a token (``extra_args["force"]``, else
    its first stop token id) exactly at its ``extra_args["stop_at"]``-th output token, and never
    before (the token is masked until then)."""
    import torch
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class StopAt(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params: Any) -> Any:
            extra = params.extra_args or {}
            at = extra.get("stop_at")
            if at is None:
                return None
            stop = extra["force"] if "force" in extra else params.stop_token_ids[0]

            def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
                if len(output_ids) == at - 1:
                    only = torch.full_like(logits, float("-inf"))
                    only[stop] = 0.0
                    return only
                logits[stop] = float("-inf")
                return logits

            return force

    return StopAt


def stopping_at(params: Any, at: int, *, string: bool = False) -> Any:
    """``params`` ending on STOP_TOKEN (``string``: on the stop string STOP_WORD, its token forced)
    at output token ``at`` (with :func:`stop_at_processor`)."""
    if string:
        params.stop = [STOP_WORD]
        params.extra_args = {"stop_at": at, "force": STOP_WORD_ID}
    else:
        params.stop_token_ids = [STOP_TOKEN]
        params.extra_args = {"stop_at": at}
    return params


def _tokens(ends: str) -> int:
    """The short request's output tokens: ENDING, then its stop token (or the stop string's)."""
    return ENDING + (ends != "length")


def _params(name: str, streaming: bool, ends: str = "length") -> Any:
    from vllm.sampling_params import RequestOutputKind

    if name == "ending" and ends != "length":
        params = stopping_at(greedy(32, ignore_eos=True), _tokens(ends), string=ends == "string")
    else:
        params = greedy(MAX_TOKENS[name], ignore_eos=True)
    if streaming and name == "ending":
        params.output_kind = RequestOutputKind.DELTA
    return params


def _engine(model: str, env: dict[str, str]) -> Any:
    return engine(model, env, num_gpu_blocks_override=64, logits_processors=[stop_at_processor()])


def _run(llm: Any, guarded: bool, streaming: bool = False, ends: str = "length") -> dict[str, Any]:
    """The clean texts (each prompt alone, caching the prefix), then the three together, one
    prefix pages scrambled when the short request has LEFT tokens to go."""
    clean = {
        name: llm.generate([prompt], _params(name, False, ends), use_tqdm=False)[0].outputs[0].text
        for name, prompt in PROMPTS.items()
    }
    core, scheduler = llm.llm_engine, core_scheduler(llm)
    for name, prompt in PROMPTS.items():
        core.add_request(name, prompt, _params(name, streaming, ends))
    (ending,) = [r for r in scheduler.requests.values() if r.request_id.startswith("ending")]
    texts: dict[str, str] = dict.fromkeys(PROMPTS, "")
    finals: dict[str, Any] = {}

    def step() -> None:
        for out in core.step():
            name = out.request_id.rsplit("-", 1)[0]
            texts[name] = (
                texts[name] + out.outputs[0].text if name == "ending" and streaming else out.outputs[0].text
            )
            if out.finished:
                finals[name] = out

    while ending.num_output_tokens < ENDING - LEFT:
        step()
    blocks = _pages_to_scramble(scheduler, ending.request_id, guarded)
    for block in blocks:
        llm.collective_rpc(scramble, args=(block,))
    at = ending.num_output_tokens
    while core.has_unfinished_requests():
        step()
    return {"clean": clean, "finals": finals, "texts": texts, "blocks": blocks, "scrambled_at": at}


# The prefix pages scrambled, by position, in every run (guard off or on: the same fault): the
# four the guard's sweep verified last when the short request has LEFT tokens to go (asserted in
# the guarded runs), so the sweep's next look at them is the furthest away. Four, not one: on
# some CPUs one scrambled page left the short request's last tokens as they were.
SCRAMBLED = range(4, 8)


def _pages_to_scramble(scheduler: Any, req_id: str, guarded: bool) -> list[int]:
    blocks = scheduler.kv_cache_manager.get_block_ids(req_id)[0][:8]
    chosen = [blocks[i] for i in SCRAMBLED]
    if guarded:
        from vllm_kvguard.connector import find_guard

        guard = find_guard(scheduler.connector)
        assert guard is not None and guard.scheduler is not None
        steps = guard.scheduler.ledger.verified_step
        others = [int(steps[b]) for b in blocks if b not in chosen]
        assert min(int(steps[b]) for b in chosen) >= max(others), [int(steps[b]) for b in blocks]
    return chosen


@pytest.mark.parametrize("ends", ENDS)
def test_control_a_page_scrambled_near_a_requests_end_changes_its_text(tiny_model: str, ends: str) -> None:
    with _engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}) as llm:
        r = _run(llm, guarded=False, ends=ends)
    ending = r["finals"]["ending"].outputs[0]
    assert ending.finish_reason == FINISH[ends] and ending.stop_reason == STOP_REASON[ends]
    assert ending.text != r["clean"]["ending"]
    assert len(ending.token_ids) == _tokens(ends)


@pytest.mark.parametrize("ends", ENDS)
def test_without_the_finish_check_the_request_leaves_wrong_and_unflagged(
    tiny_model: str, tmp_path: Path, ends: str
) -> None:
    """The hole the finish check closes, shown on the guard itself (VLLM_KVGUARD_FINISH_CHECK=0)."""
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, **INPROC, **SAMPLED, VLLM_KVGUARD_FINISH_CHECK="0")
    with _engine(tiny_model, env) as llm:
        r = _run(llm, guarded=True, ends=ends)
    ending = r["finals"]["ending"].outputs[0]
    assert ending.finish_reason == FINISH[ends] and ending.stop_reason == STOP_REASON[ends]
    assert ending.text != r["clean"]["ending"]  # wrong text, no flag: not honest
    assert not honest(r["finals"]["ending"], r["clean"]["ending"])


@pytest.mark.parametrize(
    ("ends", "suspect", "streaming"),
    [(e, s, st) for e in ENDS for s, st in (("fail", False), ("flag", False), ("fail", True))],
)
def test_a_request_ending_inside_the_window_is_failed_or_flagged(
    tiny_model: str, tmp_path: Path, ends: str, suspect: str, streaming: bool
) -> None:
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, **INPROC, **SAMPLED, VLLM_KVGUARD_SUSPECT=suspect)
    with _engine(tiny_model, env) as llm:
        r = _run(llm, guarded=True, streaming=streaming, ends=ends)
        held = metric(llm, "vllm:kvguard_requests_held")
        ahead = metric(llm, "vllm:kvguard_requests_checked_ahead")
        checked = metric(llm, "vllm:kvguard_verifications", trigger="finish")
    finals, clean = r["finals"], r["clean"]
    assert set(finals) == set(PROMPTS)
    found = events(log, "kv_block_corrupted")
    assert found and found[0]["block_id"] in r["blocks"] and found[0]["trigger"] == "finish"
    assert checked >= 1
    if ends == "length":
        # Caught before the forward of the step that computes its last token: nothing held.
        assert held == 0 and ahead >= 1
    else:
        # Caught in the step after its last token, its final output held meanwhile.
        assert held >= 1
    outcomes = affected_once(log)
    expected = "failed" if suspect == "fail" else "suspect"
    assert outcomes["ending"] == expected
    ending = finals["ending"].outputs[0]
    named = re.match(r"KV-cache corruption: block (\d+) ", str(ending.stop_reason))
    assert named and int(named.group(1)) in r["blocks"], ending.stop_reason
    if suspect == "fail":
        assert ending.finish_reason == "error"
    else:
        # (On a stop string vLLM's front end would put the string in stop_reason: the guard's
        # message stays, patches.patch_stop_string_flags.)
        assert ending.finish_reason == FINISH[ends] and str(ending.stop_reason).endswith("(suspect)")
    # Every request: its clean text, failed, or flagged; the log names each affected one once.
    for name, out in finals.items():
        assert honest(out, clean[name]), name
        if out.outputs[0].text != clean[name]:
            assert name in outcomes, name
    (line,) = [e for e in events(log, "kv_request_affected") if e["request_id"].startswith("ending")]
    if streaming:
        # The tokens the client already had when the request ended with the error.
        assert line["tokens_streamed"] == _tokens(ends) - 1
        assert r["texts"]["ending"] != ""
    else:
        assert "tokens_streamed" not in line


def test_clean_requests_leave_unchanged_through_the_finish_check(tiny_model: str, tmp_path: Path) -> None:
    """Many requests of unequal length, a quarter ending at their length (checked in their last
    step), half on a stop token and a quarter on a stop string (held and released): the same
    text and stop reason as with the guard off, no finding, no request left behind."""
    prompts = [words(17 + 13 * i, 40 + 23 * i) for i in range(8)]
    params = [greedy(6 + 5 * i, ignore_eos=True) for i in range(8)]
    for i in range(1, 8):
        if i != 4:
            stopping_at(params[i], 3 + 2 * i, string=i in (2, 6))
    with _engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}) as llm:
        plain = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.finish_reason for o in plain] == ["length"] + ["stop"] * 3 + ["length"] + ["stop"] * 3
    assert [o.stop_reason for o in plain][2::4] == [STOP_WORD, STOP_WORD]
    log = tmp_path / "guard.jsonl"
    with _engine(tiny_model, guard_env("quarantine", log, **INPROC)) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        held = metric(llm, "vllm:kvguard_requests_held")
        ahead = metric(llm, "vllm:kvguard_requests_checked_ahead")
        scheduler = core_scheduler(llm)
        # (vLLM's finished_req_ids keeps the last finished ids until a next step: plain vLLM too.)
        assert not scheduler.requests and not scheduler.has_unfinished_requests()
    assert [o.outputs[0].text for o in outs] == [o.text for o in plain]
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.outputs[0].finish_reason for o in outs] == [o.finish_reason for o in plain]
    assert [o.outputs[0].stop_reason for o in outs] == [o.stop_reason for o in plain]
    assert held >= 1 and ahead >= 1
    assert events(log, "kv_block_corrupted") == [] and events(log, "kv_request_affected") == []
