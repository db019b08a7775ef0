from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny random-weight Llama the tests build themselves (cached in .cache/)."""
    from vllm_kvguard.tinymodel import build_tiny_model

    return str(build_tiny_model(ROOT / ".cache" / "tiny-model"))


@pytest.fixture(autouse=True)
def _no_guard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without VLLM_KVGUARD* variables."""
    for name in list(os.environ):
        if name.startswith("VLLM_KVGUARD"):
            monkeypatch.delenv(name)
