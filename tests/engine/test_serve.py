"""The guard under the OpenAI API server, scraped by a real Prometheus server.

The server runs with the guard switched on by environment only (plus a fire-drill
fault, the operator's way to corrupt a page in a live server); Prometheus is
Debian's ``prometheus`` binary on loopback, loading the shipped alert rules.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.harness import events, words
from tests.engine.servers import free_port, get, serve, wait

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
PREFIX = words(5, 128)  # exactly 4 blocks of 32 one-token words


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    guard = {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_INJECT": "bitflip:count=1,seed=3"}
    # vLLM's default core binding, as an operator runs it (the tests otherwise bind per worker).
    guard["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    with serve(tiny_model, tmp_path_factory.mktemp("serve"), guard) as running:
        yield running


@pytest.fixture(scope="module")
def prometheus(server: dict[str, Any]) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is required (Debian package 'prometheus'; .ci/run installs it)"
    work = server["work"]
    port = free_port()
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{ROOT / 'examples' / 'prometheus' / 'kvguard-alerts.yml'}]\n"
        "scrape_configs:\n"
        f"  - job_name: vllm\n    static_configs: [{{targets: ['127.0.0.1:{server['port']}']}}]\n"
    )
    proc = subprocess.Popen(
        [
            binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=(work / "prometheus.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _complete(base: str, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
    return _post(
        base + "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )


def _samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(get(base + "/metrics")):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    want = {"model_name": "tiny", "engine": "0", **labels}
    hits = [
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == x for k, x in want.items())
    ]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def _query(prom: str, expr: str) -> list[dict[str, Any]]:
    data = json.loads(get(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    return data["data"]["result"]


def test_corruption_moves_metrics_and_fires_the_alert(server: dict[str, Any], prometheus: str) -> None:
    base = server["base"]
    before = _samples(base)
    assert _value(before, "vllm:kvguard_corruptions_detected_total", kind="checksum_mismatch") == 0
    # Prometheus sees the zero before the corruption, so increase() can fire.
    wait(
        lambda: _query(prometheus, "vllm:kvguard_corruptions_detected_total"),
        60,
        "Prometheus to scrape the guard's series",
    )

    # A writes and seals the 4 prefix blocks (and fills no other block).
    _complete(base, PREFIX + " w401 w402", max_tokens=4)
    # The drill corrupts one idle sealed page on the next step: one of A's prefix blocks.
    _complete(base, "w1 w2 w3", max_tokens=4)
    # B reuses the prefix: the page is verified, fails, the flipped bit is located by the page's
    # syndrome and mended in place (repair is on by default in quarantine mode), B reads it.
    b = _complete(base, PREFIX + " w403 w404", max_tokens=8)
    assert b["choices"][0]["finish_reason"] == "length"
    clean_again = _complete(base, PREFIX + " w403 w404", max_tokens=8)
    assert clean_again["choices"][0]["text"] == b["choices"][0]["text"]

    (injected,) = events(server["log"], "kv_fault_injected")
    (corrupted,) = events(server["log"], "kv_block_corrupted")
    assert corrupted["block_id"] == injected["block_id"]
    assert corrupted["action"] == "repaired" and corrupted["model_name"] == "tiny"
    assert corrupted["shape"] == "single_bit" and len(corrupted["where"]["bits"]) == 1

    after = wait(
        lambda: (
            (s := _samples(base))
            and _value(s, "vllm:kvguard_corruptions_detected_total", kind="checksum_mismatch") >= 1
            and s
        ),
        30,
        "the corruption counter on /metrics",
    )
    assert _value(after, "vllm:kvguard_corruptions_detected_total", kind="checksum_mismatch") == 1
    assert _value(after, "vllm:kvguard_faults_injected_total", kind="bitflip") == 1
    assert _value(after, "vllm:kvguard_blocks_quarantined") == 0
    assert _value(after, "vllm:kvguard_blocks_repaired_total") == 1
    assert _value(after, "vllm:kvguard_corruption_shapes_total", shape="single_bit") == 1
    assert _value(after, "vllm:kvguard_requests_affected_total", outcome="healed") == 1
    assert _value(after, "vllm:kvguard_requests_affected_total", outcome="failed") == 0
    assert _value(after, "vllm:kvguard_tokens_recomputed_total") == 0
    assert _value(after, "vllm:kvguard_blocks_sealed_total") >= 4
    assert _value(after, "vllm:kvguard_verifications_total", trigger="reuse") >= 4
    assert _value(after, "vllm:kvguard_bytes_hashed_total", op="seal") > 0
    assert _value(after, "vllm:kvguard_verification_latency_seconds_count") >= 1
    assert _value(after, "vllm:kvguard_internal_errors_total") == 0
    # The *_created series metrics.md describes: prometheus_client's, on vLLM's counters as on ours.
    raw = get(base + "/metrics")
    assert "\nvllm:prompt_tokens_created{" in raw and "\nvllm:kvguard_blocks_sealed_created{" in raw

    def firing() -> list[dict[str, Any]]:
        alerts = json.loads(get(prometheus + "/api/v1/alerts"))["data"]["alerts"]
        return [
            a
            for a in alerts
            if a["labels"]["alertname"] == "KVCacheCorruptionDetected" and a["state"] == "firing"
        ]

    (alert,) = wait(firing, 90, "KVCacheCorruptionDetected to fire in Prometheus")
    assert alert["labels"]["severity"] == "page"
    assert alert["labels"]["model_name"] == "tiny" and alert["labels"]["engine"] == "0"


def test_the_guard_keeps_the_cores_plain_vllm_keeps(server: dict[str, Any]) -> None:
    """vLLM's CPU executor keeps one core per worker from the forward for the scheduler and one
    more for a KV transfer connector; the guard is no transfer, so the server keeps one
    (tests/unit/test_plugin.py has vLLM's own count, two, as the control)."""
    text = (server["work"] / "server.log").read_text()
    assert "local_world_size=1, reserve_cpu_num=1" in text
    assert "should be greater than reserved CPU core number" not in text


def test_server_log_has_none_of_the_misleading_start_up_lines(server: dict[str, Any]) -> None:
    """vLLM's own warnings that read as "your guard setting is ignored" or name a flag the
    operator never gave are gone; the guard's own start-up lines carry no Python dicts."""
    text = (server["work"] / "server.log").read_text()
    assert "kvguard_started" in text  # the log is the server's, with the guard's lines in it
    assert "Unknown vLLM environment variable detected: VLLM_KVGUARD" not in text
    assert "Turning off hybrid kv cache manager" not in text
    started = [line for line in text.splitlines() if "kvguard_started" in line]
    assert len(started) == 2 and not any("{" in line for line in started), started
    (scheduler_line,) = [line for line in started if "role=scheduler" in line]
    assert "mode=quarantine" in scheduler_line and "block_size=32" in scheduler_line
    (line,) = events(server["log"], "kvguard_started")[:1]
    assert line["logger"] == "vllm.kvguard"


def test_a_stop_string_ends_the_request_as_vllm_always_did(server: dict[str, Any]) -> None:
    """Stop strings now end requests in the engine (so the finish check holds them,
    connector/stop_strings.py); over HTTP the answer is what vLLM's front end always made of
    them: the text up to the stop string, ``finish_reason`` "stop", the string in ``stop_reason``."""
    base = server["base"]
    prompt = words(300, 40)
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    body["ignore_eos"] = True
    # Twice: the second run, like the one with a stop string, finds the prompt's first page cached.
    _post(base + "/v1/completions", body)
    free = _post(base + "/v1/completions", body)["choices"][0]
    said = free["text"].split()
    assert free["finish_reason"] == "length" and len(said) >= 6  # (EOS tokens, ignored, show no text)
    stop = next(
        w for w in said[3:] if said.count(w) == 1 and not any(o != w and o.startswith(w) for o in said)
    )
    cut = free["text"][: free["text"].index(stop)]
    held = _value(_samples(base), "vllm:kvguard_requests_held_total")
    stopped = _post(base + "/v1/completions", {**body, "stop": [stop]})["choices"][0]
    # It ended in the engine, where the finish check held its final output for its pages' check.
    wait(
        lambda: _value(_samples(base), "vllm:kvguard_requests_held_total") == held + 1,
        30,
        "the stop-string request to be counted as held",
    )
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stopped["text"] == cut
    assert "kvguard_internal_error" not in (server["work"] / "server.log").read_text()
