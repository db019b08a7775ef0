"""Runs tests/engine/device_path_cases.py (the guard's device path on a real engine) under
Triton's interpreter, in a child process so the variable stays out of this one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
CASES = Path(__file__).with_name("device_path_cases.py")


def test_device_path_cases_pass_under_the_triton_interpreter() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=CASES.parent.parent.parent,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == 5 and "skipped" not in proc.stdout, proc.stdout[-2000:]
