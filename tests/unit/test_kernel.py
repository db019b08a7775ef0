"""Runs tests/unit/kernel_cases.py (the KVG64 kernel vs its reference) under Triton's interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("kernel_cases.py")


def test_kernel_cases_pass_under_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=CASES.parent.parent.parent,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 19 and "skipped" not in proc.stdout, proc.stdout[-2000:]
