from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny random-weight Llama the tests build themselves (cached in .cache/)."""
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    return str(build_tiny_model(ROOT / ".cache" / "tiny-model"))


@pytest.fixture(autouse=True)
def _no_guard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without VLLM_KVGUARD* variables."""
    for name in list(os.environ):
        if name.startswith("VLLM_KVGUARD"):
            monkeypatch.delenv(name)


def run_cases_under_interpreter(cases: Path, expected: int, timeout: int) -> None:
    """Run a pytest file in a child process with TRITON_INTERPRET=1; all ``expected`` cases pass.

    Triton reads the variable when it builds a kernel, so it must not reach this process
    (it would switch vLLM's own Triton kernels in the in-process engine tests too).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == expected and "skipped" not in proc.stdout, proc.stdout[-2000:]
