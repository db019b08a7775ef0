"""`kvguard drill` and `kvguard config`, run as a user runs them (the console script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.harness import read_log
from vllm_kvguard.tools.drill import row_key

pytestmark = pytest.mark.engine
KVGUARD = [sys.executable, "-m", "vllm_kvguard.tools.cli"]


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    full.update(env)
    return subprocess.run(
        [*KVGUARD, *args], env=full, capture_output=True, text=True, timeout=900, check=False
    )


def test_drill_detects_every_fault_kind_that_is_read(tiny_model: str, tmp_path: Path) -> None:
    spec = (
        "bitflip:count=2,seed=5;overwrite:count=1,seed=6;zero:count=1,seed=7;nan:count=1,seed=8;"
        "nan:at=write,count=1,seed=9"
    )
    proc = _run(["drill", "--model", tiny_model, "--json", "--workdir", str(tmp_path), "--inject", spec])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The progress line names the faults in a few words, not the spec (seeds and all).
    assert "bitflip x2, overwrite, zero, nan, nan@write" in proc.stderr and "seed=" not in proc.stderr
    report = json.loads(proc.stdout)
    log = read_log(tmp_path / "kvguard.jsonl")
    injected = [line for line in log if line["event"] == "kv_fault_injected"]
    # The table agrees with what the engine says it injected, kind by kind.
    expected = {"bitflip": 2, "overwrite": 1, "zero": 1, "nan": 1, "nan@write": 1}
    assert {k: row["injected"] for k, row in report["by_kind"].items()} == expected
    assert sorted(row_key(line["kind"], line["at"]) for line in injected) == sorted(
        k for k, n in expected.items() for _ in range(n)
    )
    # The write-time fault is read by the check at its seal, in the same step: always detected.
    assert report["by_kind"]["nan@write"]["detected"] == 1 and report["nonfinite_blocks"] == 1
    for kind, row in report["by_kind"].items():
        assert row["escaped"] == 0, kind
        assert row["read"] == row["detected"], kind
        assert row["read"] + row["not_read"] + row["no_change"] == row["injected"], kind
    total = report["total"]
    assert total["detected"] >= 3, report  # the workload reuses idle prefix pages
    # Each detected fault is a corrupted block in the log, quarantined; its readers are healed
    # (outputs identical to plain vLLM) or, if they had emitted tokens from it, failed.
    corrupted = {line["block_id"] for line in log if line["event"] == "kv_block_corrupted"}
    nonfinite = {line["block_id"] for line in log if line["event"] == "kv_block_nonfinite"}
    outcomes = {line["fault_id"]: line["outcome"] for line in log if line["event"] == "kv_fault_outcome"}
    for line in injected:
        if outcomes.get(line["fault_id"]) == "detected":
            assert line["block_id"] in (nonfinite if line["at"] == "write" else corrupted)
    # Quarantined, or (the bit flips: one word) mended in place.
    assert report["quarantined"] + report["repaired"] == len(corrupted) == report["corrupted_blocks"]
    # Each fault that was caught is diagnosed as the shape its kind makes (a bit flip is
    # single_bit, an overwrite copy_of_block, ...): the drill table's "diagnosed" column.
    for kind, row in report["by_kind"].items():
        assert row["diagnosed"] == row["detected"], (kind, report["faults"])
    for fault in report["faults"]:
        if fault["outcome"] == "detected":
            assert fault["shape"] == fault["expected_shape"], fault
    assert report["by_kind"]["bitflip"]["detected"] == 0 or report["repaired"] >= 1
    assert report["requests_healed"] >= 1 and report["requests_suspect"] == 0
    assert report["silently_wrong"] == 0
    assert report["outputs_identical"] == report["requests"] - report["requests_failed"]
    assert report["requests"] == 16
    assert report["detection_ms_median"] is not None and report["detection_ms_median"] > 0
    assert report["ok"] is True and report["internal_errors"] == 0
    assert any(
        line["event"] == "kvguard_fault_injection_armed" and line["level"] == "warning" for line in log
    )
    # `kvguard report` reads the same findings out of vLLM's own console log (the engine's
    # output, guard lines rendered as `event key=value`) as out of the guard's JSON lines, and
    # says the log is a drill's rather than diagnosing the machine.
    summaries = []
    for name in ("kvguard.jsonl", "guarded.log"):
        done = _run(["report", "--json", str(tmp_path / name)])
        assert done.returncode == 0, done.stderr
        summaries.append(json.loads(done.stdout))
    from_json, from_console = summaries
    assert from_console["guard_lines"] > 0 and from_console["bad_pages"] == from_json["bad_pages"] > 0
    assert from_json["bad_pages"] == report["corrupted_blocks"] + report["nonfinite_blocks"]
    for key in ("kind", "shape", "action", "rank", "device", "layer"):
        assert from_console["by"][key] == from_json["by"][key], key
    assert from_console["requests"] == from_json["requests"]
    assert from_console["diagnosis"]["verdict"] == "fire drill (faults injected)"
    # The plain run's log has no guard line: said so, exit 1, never "none affected".
    plain = _run(["report", str(tmp_path / "reference.log")])
    assert plain.returncode == 1 and "holds no vllm-kvguard line" in plain.stderr


def test_drill_covers_unfilled_pages_lost_writes_and_page_identity(tiny_model: str, tmp_path: Path) -> None:
    """The three kinds full-page checksums cannot see: bits flipped in the written slots of a
    page still being written, a forward's writes into a reused page made not to land, and two
    cached pages trading prefix-cache hashes. Every one that is read is detected."""
    spec = "partial:count=2,seed=21;lost_write:count=1,seed=22;identity:count=1,seed=23"
    proc = _run(["drill", "--model", tiny_model, "--json", "--workdir", str(tmp_path), "--inject", spec])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = report["by_kind"]
    assert {k: row["injected"] for k, row in rows.items()} == {"partial": 2, "lost_write": 1, "identity": 1}
    for kind, row in rows.items():
        assert row["escaped"] == 0 and row["read"] == row["detected"], (kind, row)
        assert row["read"] + row["not_read"] + row["no_change"] == row["injected"], kind
        assert row["diagnosed"] == row["detected"], (kind, report["faults"])
    # Read in the step they land (lost_write) or as soon as the page's rows are checked, at
    # the latest when it fills (partial); an identity swap when either page is hit.
    assert rows["lost_write"]["detected"] == 1 and report["writes_lost"] >= 1
    assert rows["partial"]["detected"] >= 1
    assert rows["identity"]["detected"] + rows["identity"]["not_read"] == 1
    assert report["identity_mismatches"] >= rows["identity"]["detected"]
    assert report["silently_wrong"] == 0 and report["ok"] is True and report["internal_errors"] == 0


def test_drill_corrupts_pages_another_connector_loads_and_they_are_caught(
    tiny_model: str, tmp_path: Path
) -> None:
    """``load``: the drill runs beside vLLM's ExampleConnector (prefix caching off: every repeated
    prefix is loaded from its store); a loaded page is reversed after it lands. Each is caught at
    load, before attention reads it, and its reader recomputes: every output equals the clean run."""
    proc = _run(
        [
            "drill",
            "--model",
            tiny_model,
            "--json",
            "--workdir",
            str(tmp_path),
            "--inject",
            "load:count=2,seed=3",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    row = report["by_kind"]["load"]
    assert row["injected"] == 2 and row["read"] == row["detected"] == row["diagnosed"] == 2, report["faults"]
    assert row["escaped"] == 0 and report["quarantined"] == 0
    assert report["actions"] == {"recomputed": 2} and report["requests_healed"] >= 1
    assert report["outputs_identical"] == report["requests"] and report["ok"] is True
    found = [line for line in read_log(tmp_path / "kvguard.jsonl") if line["event"] == "kv_block_corrupted"]
    assert {(line["trigger"], line["connector"]) for line in found} == {("external_load", "ExampleConnector")}


def test_fault_in_a_page_never_read_is_not_read_not_detected(tiny_model: str, tmp_path: Path) -> None:
    # 4 requests over 4 prefixes: no prefix is used twice, so no page is ever reused.
    proc = _run(
        [
            "drill",
            "--model",
            tiny_model,
            "--requests",
            "4",
            "--inject",
            "zero:count=2",
            "--workdir",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    assert "zero" in table and "PASS" in table
    row = next(line.split() for line in table.splitlines() if line.startswith("zero"))
    assert row[1:] == ["2", "0", "0", "0", "2", "0", "0"]  # injected .. no change, diagnosed
    assert "corrupted blocks detected     0" in table
    assert "outputs identical to clean    8 / 8" in table


def test_bad_spec_is_one_clear_error() -> None:
    proc = _run(["drill", "--inject", "meteor:count=1"])
    assert proc.returncode == 2
    assert "--inject='meteor:count=1' is not valid" in proc.stderr
    assert "unknown fault kind 'meteor'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_prints_effective_configuration() -> None:
    proc = _run(["config"], VLLM_KVGUARD="1", VLLM_KVGUARD_MODE="raise")
    assert proc.returncode == 0
    out = json.loads(proc.stdout)
    assert out["effective"]["enabled"] is True and out["effective"]["mode"] == "raise"
    assert "VLLM_KVGUARD_MODE" in out["variables"]


def test_config_rejects_bad_environment() -> None:
    proc = _run(["config"], VLLM_KVGUARD="1", VLLM_KVGUARD_HASH="md5")
    assert proc.returncode == 2
    assert "VLLM_KVGUARD_HASH='md5' is not valid: expected xxh3_64 | xxh64" in proc.stderr
