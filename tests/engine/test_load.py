"""Load and soak against the real OpenAI server, with the official ``openai`` client (asyncio):
the short versions of ``benchmarks/load.py`` and ``benchmarks/soak.py`` (docs/reliability.md has
the long runs). Loopback only; every loop bounded in time and count; the scripts exit by
themselves.

No timing assertions: latency and throughput figures are reported, not tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
# Faults land in sealed pages no request holds (cached prefixes): they change a response only
# where a later request hits such a page. At zero:rate=0.05 one run in a few had none that did,
# and the log-mode control (faults change text) found no response changed; twice that rate.
FAULTS = "bitflip:rate=0.05,seed=1;zero:rate=0.1,seed=2"


def _script(name: str, *args: str, timeout: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args, "--json"],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout))


def test_load_with_faults_serves_no_silent_wrong_text(tiny_model: str, tmp_path: Path) -> None:
    report = _script(
        "load.py", "--model", tiny_model, "--concurrency", "32", "--phase-seconds", "12",
        "--round-seconds", "6", "--faults", FAULTS,
        "--modes", "quarantine,log", "--workdir", str(tmp_path), "--timing", "--before", str(ROOT),
        timeout=1200,
    )  # fmt: skip
    # The clean reference was taken twice and agreed (the script stops otherwise); each guard
    # server (this checkout, and --before: here the same one) served every prompt exactly as the
    # guard-off one.
    for guarded in ("on", "before"):
        first = report[f"{guarded}_reference"]
        assert first["same"] == report["prompts"] == first["requests"], first
    quiet = report["no_faults"]
    for side in ("off", "on", "before"):
        assert quiet[side]["requests"] > 0 and quiet[side]["same"] == quiet[side]["requests"], quiet[side]
        assert quiet[side]["streams"] > 0 and quiet[side]["ttft_p99_ms"] > 0
        # Its steps in the rounds, from its /metrics, and the guard's own time a step by side.
        assert quiet[side]["steps"] > 0 and quiet[side]["tokens_per_step"] > 0, quiet[side]
        guard_ms = quiet[side]["guard_ms_per_step"]
        if side == "off":
            assert guard_ms == {}, guard_ms
        else:
            assert set(guard_ms) == {"scheduler", "worker"} and min(guard_ms.values()) > 0, guard_ms
            assert (
                quiet[side]["guard"]["corruptions_detected"] == 0
                and quiet[side]["guard"]["internal_errors"] == 0
            )
    for ratio in ("ratio_on_to_off", "ratio_before_to_off", "ratio_on_to_before"):
        assert set(quiet[ratio]) >= {"ttft_p50_ms", "itl_p99_ms", "requests_per_s"}, quiet
    # --timing: vLLM's step calls timed in every server's processes, CPU within wall.
    for side in ("off", "on", "before"):
        timing = quiet["timing"][side]
        assert set(timing) == {"schedule", "update_from_output", "execute_model"}, timing
        for call in timing.values():
            assert call["calls"] >= 100 and 0 < call["cpu_ms"] <= call["wall_ms"] * 1.05, timing

    healed, control = report["faults"]["quarantine"], report["faults"]["log"]
    for run in (healed, control):
        assert run["silent_wrong"] == 0, run  # the contract
        assert run["guard"]["faults_injected"] > 0 and run["guard"]["corruptions_detected"] > 0, run
        assert run["guard"]["internal_errors"] == 0
        assert run["disconnected"] == 0
    # Quarantine: every reader of a bad page recomputed it; nobody got an error or a flag.
    assert healed["same"] == healed["requests"] and healed["errored"] == 0, healed
    assert healed["guard"]["requests_healed"] > 0
    # The control: log mode heals nothing, and the same faults changed the text of some
    # responses, every one of them flagged.
    assert control["flagged_different"] > 0, control


def test_load_names_a_before_checkout_that_is_not_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--before", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--before {tmp_path}: no vllm_kvguard package there" in proc.stderr


def test_soak_leaves_nothing_behind_and_memory_flat(tiny_model: str, tmp_path: Path) -> None:
    report = _script(
        "soak.py", "--model", tiny_model, "--minutes", "1", "--sample-seconds", "6",
        "--concurrency", "24", "--faults", "bitflip:rate=0.02,seed=4", "--workdir", str(tmp_path),
        timeout=900,
    )  # fmt: skip
    assert report["requests"] > 100 and report["completed"] > 0
    # Clients hung up mid-stream; the server aborted those requests and served the rest.
    assert report["disconnected_mid_stream"] > 0
    # The contract: an errored response is one the guard failed, with its log line saying why
    # (no error of any other cause). With one-bit faults at rest and repair on, the guard heals
    # its readers; a failure here means a request read a page the guard could not vouch for,
    # and guard_failures names it and the findings behind it (docs/reliability.md).
    errors = dict(report["errors_by_cause"])
    failed = [f for f in report["guard_failures"] if f["outcome"] == "failed"]
    assert set(errors) <= {"kv_corruption"}, (errors, report["guard_failures"])
    # (A failed request whose client had already hung up errs as "disconnected".)
    assert errors.get("kv_corruption", 0) <= len(failed), (errors, report["guard_failures"])
    assert all(f["findings"] for f in failed), report["guard_failures"]
    assert report["guard"].get("fault_escaped", 0) == 0, report["guard"]
    assert report["probe_ok"]
    # Finished and aborted requests (and ended drill faults) left no entry in any guard table.
    assert report["idle_entries"] == dict.fromkeys(report["idle_entries"], 0.0), report["idle_entries"]
    assert set(report["idle_entries"]) >= {"requests", "blocks_given", "tables", "affected"}
    # Drill faults still waiting for a reader of their page are exactly the log's unended ones.
    assert report["idle_faults_awaiting_reader"] == report["guard"]["faults_pending"]
    # Fixed tables stay their size; the metrics' label sets do not grow with traffic.
    assert report["state_bytes"]["scheduler"] > 0 and report["state_bytes"]["worker"] > 0
    assert report["drift"]["bytes_scheduler"] == 0 and report["drift"]["bytes_worker"] == 0
    first, last = report["series_first_last"]
    assert first == last and last > 0
    assert report["guard"]["faults_injected"] > 0 and report["guard"]["internal_errors"] == 0
    rows = (tmp_path / "soak_samples.csv").read_text().splitlines()
    assert len(rows) == report["samples"] + 2  # header, samples, the final one
