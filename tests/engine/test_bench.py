"""`kvguard bench` runs real engines side by side and reports ratios (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def test_bench_reports_medians_and_ratios(tiny_model: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_kvguard.tools.cli", "bench", "--model", tiny_model, "--repeats", "1",
         "--configs", "off,paranoid", "--workdir", str(tmp_path), "--json"],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert set(report["medians"]) == {"off", "paranoid"}
    off, guarded = report["runs"]["off"][0], report["runs"]["paranoid"][0]
    # Same workload, same outputs length (ignore_eos), prefix reuse in both.
    assert off["output_tokens"] == guarded["output_tokens"] > 0
    assert off["cached_tokens"] > 0 and guarded["cached_tokens"] > 0
    assert off["guard_share"] is None  # no guard, no guard time
    assert guarded["guard_share"] is not None and 0 < guarded["guard_share"] < 1
    assert report["ratio_to_off"]["off"]["tokens_per_s"] == 1.0
    assert report["ratio_to_off"]["paranoid"]["tokens_per_s"] > 0
    assert report["medians"]["paranoid"]["ttft_s"] > 0 and report["medians"]["paranoid"]["itl_s"] > 0
