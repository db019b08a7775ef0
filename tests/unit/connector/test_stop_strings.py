"""The engine-side stop-string check ends a request at the very token vLLM's front end would.

The front end (vLLM's output processor) runs ``IncrementalDetokenizer`` over each step's tokens;
``StopStrings`` runs the same class in the engine. Here both see the same token streams (the tiny
model's real tokenizer, vLLM's real ``SamplingParams``), steps of one or several tokens, and the
step each one stops at must agree, with ``min_tokens``, ``include_stop_str_in_output`` and a
check that starts after a request's first tokens.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_kvguard.config import load_config
from vllm_kvguard.connector.stop_strings import StopStrings
from vllm_kvguard.logs import GuardLog


@pytest.fixture(scope="module")
def tokenizer(tiny_model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _request(tokenizer: Any, req_id: str, **params: Any) -> SimpleNamespace:
    from vllm import SamplingParams

    prompt = tokenizer.encode("w1 w2 w3", add_special_tokens=False)
    return SimpleNamespace(
        request_id=req_id,
        sampling_params=SamplingParams(max_tokens=64, **params),
        prompt_token_ids=prompt,
        prompt_embeds=None,
        output_token_ids=[],
    )


def _front_end_stop_step(tokenizer: Any, request: Any, steps: list[list[int]]) -> int | None:
    """The step at which vLLM's front end finds a stop string in these steps' tokens."""
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    for i, tokens in enumerate(steps):
        if detokenizer.update(list(tokens), False) is not None:
            return i
    return None


def _guard_stop_step(stops: StopStrings, request: Any, steps: list[list[int]], start: int = 0) -> int | None:
    """The step at which the engine-side check ends the request (it first sees step ``start``)."""
    for i, tokens in enumerate(steps):
        request.output_token_ids.extend(tokens)
        if i >= start and stops.ends(request, tokens):
            return i
    return None


def _log() -> GuardLog:
    return GuardLog(load_config({}))


@pytest.mark.parametrize("seed", range(40))
def test_the_engine_stops_at_the_step_the_front_end_does(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    words = [f"w{rng.randrange(0, 60)}" for _ in range(40)]
    tokens = tokenizer.convert_tokens_to_ids(words)
    sizes = [rng.choice([1, 1, 1, 2, 3]) for _ in range(40)]
    steps, at = [], 0
    for n in sizes:
        if at >= len(tokens):
            break
        steps.append(tokens[at : at + n])
        at += n
    stop = [rng.choice(words[5:]) + rng.choice(["", " w"])]
    params = {
        "stop": stop,
        "min_tokens": rng.choice([0, 0, 4, 12]),
        "include_stop_str_in_output": rng.random() < 0.3,
    }
    front = _front_end_stop_step(tokenizer, _request(tokenizer, "f", **params), steps)
    stops = StopStrings(None, _log(), tokenizer=tokenizer)
    start = rng.choice([0, 0, 2])  # the check may first see a request after its first steps
    guard = _guard_stop_step(stops, _request(tokenizer, "g", **params), steps, start)
    if front is not None and front < start:
        # Found in the tokens before the check first looked: it stops at its first look.
        assert guard == start
    else:
        assert guard == front, (stop, params)


def test_a_known_stream_stops_at_its_stop_string(tokenizer: Any) -> None:
    """Not only agreement: the step is the one that completes the string, here the third."""
    steps = [tokenizer.convert_tokens_to_ids(w) for w in (["w1"], ["w2", "w3"], ["w44", "w5"], ["w6"])]
    for stop, step in ((["w44"], 2), (["w3 w44"], 2), (["w5 w6"], 3), (["w7"], None)):
        stops = StopStrings(None, _log(), tokenizer=tokenizer)
        assert _guard_stop_step(stops, _request(tokenizer, "k", stop=stop), steps) == step, stop
        assert _front_end_stop_step(tokenizer, _request(tokenizer, "f", stop=stop), steps) == step


def test_requests_without_stop_strings_keep_nothing(tokenizer: Any) -> None:
    stops = StopStrings(None, _log(), tokenizer=tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["w5", "w6"])
    plain = _request(tokenizer, "plain")
    assert not stops.ends(plain, ids) and len(stops) == 0
    stopping = _request(tokenizer, "stopping", stop=["w9"])
    stopping.output_token_ids.extend(ids)
    assert not stops.ends(stopping, ids) and len(stops) == 1
    stops.forget("stopping")
    assert len(stops) == 0


def test_a_tokenizer_that_cannot_load_is_said_once_and_changes_nothing(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.tokenizers.registry as registry

    def broken(_config: Any) -> Any:
        raise OSError("no tokenizer files")

    monkeypatch.setattr(registry, "cached_tokenizer_from_config", broken)
    lines: list[tuple[str, dict[str, Any]]] = []
    log = _log()
    monkeypatch.setattr(log, "line", lambda name, level="info", **fields: lines.append((name, fields)))
    stops = StopStrings(SimpleNamespace(skip_tokenizer_init=False), log)
    ids = tokenizer.convert_tokens_to_ids(["w5", "w6"])
    for i in range(3):
        request = _request(tokenizer, f"r{i}", stop=["w6"])
        request.output_token_ids.extend(ids)
        assert not stops.ends(request, ids)
    assert [name for name, _ in lines] == ["kvguard_stop_strings_unchecked"]
    assert "no tokenizer files" in lines[0][1]["reason"]
    # skip_tokenizer_init: the front end finds no stop string either; nothing to say.
    quiet = StopStrings(SimpleNamespace(skip_tokenizer_init=True), log)
    request = _request(tokenizer, "q", stop=["w6"])
    request.output_token_ids.extend(ids)
    assert not quiet.ends(request, ids) and len(lines) == 1
