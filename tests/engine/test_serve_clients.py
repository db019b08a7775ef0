"""What an HTTP client sees when the guard ends or flags its request: the official `openai`
client against the real OpenAI server, streaming and not.

Raise mode: a request that reads a corrupted page fails with HTTP 503 (a streaming request: an
error event) whose message names KV-cache corruption, the block, and the engine request id
that the guard's ``kv_request_affected`` line carries (the client's own ``cmpl-...`` id is its
prefix). Log mode: the request finishes and its choice's ``stop_reason`` flags it.

Each prompt shares exactly one full page (32 one-token words) with an earlier one and fills no
second page, so the one fault of each drill lands on exactly one idle page: the earlier
prompt's (see ``_seal_and_corrupt``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.engine.harness import events, words
from tests.engine.servers import serve

pytestmark = pytest.mark.engine
ONE_PAGE = (words(11, 32), words(13, 32))  # two prefixes of exactly one page each


def _client(base: str) -> openai.OpenAI:
    # No retries: the test looks at the first answer (a real client would retry the 503,
    # and the retry recomputes the page: see docs/runbook.md).
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _seal_and_corrupt(client: openai.OpenAI) -> None:
    """Seal each prefix's page; the drill's faults (count=2) land one on each: the first on
    prefix 0's page while prefix 1 runs (the only idle sealed page then), the second on
    prefix 1's page once it is idle (prefix 0's page is held by its reader by then)."""
    for prefix in ONE_PAGE:
        client.completions.create(model="tiny", prompt=prefix + " w1 w2", max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def raise_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    guard = {
        "VLLM_KVGUARD": "1",
        "VLLM_KVGUARD_MODE": "raise",
        "VLLM_KVGUARD_INJECT": "bitflip:count=2,seed=5",
    }
    with serve(tiny_model, tmp_path_factory.mktemp("raise"), guard) as running:
        yield running


def _affected(log: Any) -> dict[str, dict[str, Any]]:
    return {line["request_id"]: line for line in events(log, "kv_request_affected")}


def test_raise_mode_clients_get_503_naming_the_block_and_request(raise_server: dict[str, Any]) -> None:
    client = _client(raise_server["base"])
    _seal_and_corrupt(client)
    injected = [line["block_id"] for line in events(raise_server["log"], "kv_fault_injected")]
    assert len(injected) >= 1, injected

    # Not streaming: the whole answer is the error.
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt=ONE_PAGE[0] + " w3 w4", max_tokens=4, temperature=0)
    error = info.value
    # What the README tells Python users to catch: the openai client's class for a 5xx.
    assert isinstance(error, openai.InternalServerError)
    assert error.status_code == 503
    body = error.body if isinstance(error.body, dict) else {}
    assert body.get("type") == "ServiceUnavailableError", error.body
    message = str(body.get("message"))
    found = re.search(r"KV-cache corruption: block (\d+) \(layer [^)]+\).*\[request (cmpl-[\w-]+)\]", message)
    assert found, message
    block, request_id = int(found.group(1)), found.group(2)
    assert block == injected[0]
    line = _affected(raise_server["log"])[request_id]  # the id in the error is the log line's
    assert line["outcome"] == "failed" and line["block_id"] == block
    # The second fault lands on prefix 1's page once it is idle: in the step after its request
    # is done (its blocks freed), or, where the finish check held that request's final output
    # for a step, on the first step of the next request.
    injected = [line["block_id"] for line in events(raise_server["log"], "kv_fault_injected")]
    assert len(injected) == 2 and len(set(injected)) == 2, injected

    # Streaming: the stream started (HTTP 200), so the error arrives as an error event, which the
    # client raises.
    stream = client.completions.create(
        model="tiny", prompt=ONE_PAGE[1] + " w3 w4", max_tokens=4, temperature=0, stream=True
    )
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    message = str(info.value)
    found = re.search(r"KV-cache corruption: block (\d+) .*\[request (cmpl-[\w-]+)\]", message)
    assert found, message
    assert int(found.group(1)) == injected[1]
    assert _affected(raise_server["log"])[found.group(2)]["outcome"] == "failed"

    # The bad pages left the prefix cache: the same prompt again is recomputed and served.
    again = client.completions.create(
        model="tiny", prompt=ONE_PAGE[0] + " w3 w4", max_tokens=4, temperature=0
    )
    assert again.choices[0].finish_reason == "length"


def test_other_server_errors_are_left_as_vllm_reports_them(raise_server: dict[str, Any]) -> None:
    client = _client(raise_server["base"])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="w1", max_tokens=100000, temperature=0)
    assert "KV-cache" not in str(info.value)


@pytest.fixture(scope="module")
def log_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    guard = {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_MODE": "log", "VLLM_KVGUARD_INJECT": "bitflip:count=2,seed=5"}
    with serve(tiny_model, tmp_path_factory.mktemp("log"), guard) as running:
        yield running


def test_log_mode_clients_see_suspect_in_stop_reason(log_server: dict[str, Any]) -> None:
    client = _client(log_server["base"])
    _seal_and_corrupt(client)
    plain = client.completions.create(
        model="tiny", prompt=ONE_PAGE[0] + " w3 w4", max_tokens=4, temperature=0
    )
    choice = plain.choices[0]
    assert choice.finish_reason == "length"
    stop = str(getattr(choice, "stop_reason", None))
    assert stop.startswith("KV-cache corruption: block ") and "(suspect)" in stop, stop

    chunks = list(
        client.completions.create(
            model="tiny", prompt=ONE_PAGE[1] + " w3 w4", max_tokens=4, temperature=0, stream=True
        )
    )
    last = chunks[-1].choices[0] if chunks[-1].choices else chunks[-2].choices[0]
    stop = str(getattr(last, "stop_reason", None))
    assert stop.startswith("KV-cache corruption: block ") and "(suspect)" in stop, stop
    outcomes = [line["outcome"] for line in events(log_server["log"], "kv_request_affected")]
    assert outcomes == ["suspect", "suspect"]
