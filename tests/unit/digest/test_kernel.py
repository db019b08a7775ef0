"""Runs tests/unit/digest/kernel_cases.py (the KVG64 kernel vs its reference) under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cases_under_interpreter

CASES = Path(__file__).with_name("kernel_cases.py")


def test_kernel_cases_pass_under_the_triton_interpreter() -> None:
    run_cases_under_interpreter(CASES, expected=88, timeout=600)


BENCH = CASES.parents[3] / "benchmarks" / "device_bench.py"


def test_device_bench_runs_its_checks_under_the_interpreter() -> None:
    """The GPU benchmark's own code path (seal, verify, settle, digest check, one step's row
    digests) on tiny sizes."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = ["--device", "cpu", "--blocks", "6", "--layers", "2", "--kv-heads", "2", "--head-size", "16"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args, "--repeats", "1", "--step-rows", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "2 layers x 6 pages" in proc.stdout and "seal / copy = " in proc.stdout
    lines = [line.split() for line in proc.stdout.splitlines()]
    ways = [w[0] for w in lines if len(w) > 3 and w[1:4] == ["2", "rows", "x"]]
    assert ways == ["read_back", "torch", "kernel"], proc.stdout  # one step's row digests


def test_device_bench_says_so_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():  # pragma: no cover - a GPU machine measures instead
        pytest.skip("a GPU is here: benchmarks/gpu_check.sh measures the device path instead")
    proc = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no GPU here" in proc.stderr
