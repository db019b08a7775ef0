from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _a_core_per_worker() -> None:
    """Under pytest-xdist, each worker's engines compute on a core of their own.

    A vLLM CPU engine in its own process binds its OpenMP threads when it starts; with
    ``VLLM_CPU_OMP_THREADS_BIND=auto`` (vLLM's default) on a 2-core machine every engine takes
    core 0 and leaves core 1 to the rest, so two workers' engines would share one core while the
    other idled. Each worker binds its engines to its own core, and torch in the worker (in-process
    engines) runs one thread. An operator's own VLLM_CPU_OMP_THREADS_BIND or OMP_NUM_THREADS stands.
    The worker's children (drills, servers, the interpreter runs' own workers) inherit this;
    ``KVGUARD_TESTS_CORE`` marks the value as this function's, so a nested run re-assigns it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or len(cores) < 2:
        return
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if bind is not None and bind != os.environ.get("KVGUARD_TESTS_CORE"):
        return
    core = str(cores[int(worker.removeprefix("gw")) % len(cores)])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["KVGUARD_TESTS_CORE"] = core
    os.environ.setdefault("OMP_NUM_THREADS", "1")


_a_core_per_worker()


# Seconds a module's tests take on one core (`pytest --durations`, 2 vCPUs, 2026-12-07), for the
# modules that take longest. `make test` runs the tests in parallel, a module per worker at a
# time (`--dist loadfile`: module fixtures, servers included, start once); the longest modules
# go first so that the workers finish together. Any order passes: this only saves time.
SLOW_MODULES = {
    "tests/engine/test_drill.py": 330,
    "tests/engine/test_load.py": 290,
    "tests/engine/test_docs_commands.py": 240,
    "tests/engine/test_device_path.py": 170,
    "tests/engine/test_parallel.py": 120,
    "tests/engine/test_features.py": 90,
    "tests/engine/test_lmcache.py": 160,
    "tests/engine/test_connectors.py": 150,
    "tests/engine/test_core.py": 80,
    "tests/engine/test_serve_clients.py": 60,
    "tests/engine/test_bench.py": 56,
    "tests/compat/test_vllm034.py": 54,
    "tests/engine/test_startup.py": 50,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest modules first (see SLOW_MODULES), each module's tests in their own order."""
    items.sort(key=lambda item: -SLOW_MODULES.get(item.nodeid.split("::", 1)[0], 0))


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


def run_cases_under_interpreter(cases: Path, expected: int, timeout: int, workers: int = 1) -> None:
    """Run a pytest file in a child process with TRITON_INTERPRET=1; all ``expected`` cases pass.
    ``workers`` > 1: the cases spread over that many processes (pytest-xdist).

    Triton reads the variable when it builds a kernel, so it must not reach this process
    (it would switch vLLM's own Triton kernels in the in-process engine tests too).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env["TRITON_INTERPRET"] = "1"
    parallel = ["-n", str(workers)] if workers > 1 else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases), *parallel],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == expected and "skipped" not in proc.stdout, proc.stdout[-2000:]
