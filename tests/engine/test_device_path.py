"""Runs tests/engine/device_path_cases.py (the guard's device path on a real engine) under
Triton's interpreter, in a child process so the variable stays out of this one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cases_under_interpreter

pytestmark = pytest.mark.engine
CASES = Path(__file__).with_name("device_path_cases.py")


def test_device_path_cases_pass_under_the_triton_interpreter() -> None:
    run_cases_under_interpreter(CASES, expected=18, timeout=1800, workers=2)
