"""Running vLLM engines in child processes, for the drill and the benchmark.

Each engine run gets its own process (a clean environment, its own engine) and
writes its result as JSON; its output goes to a log file so that the terminal
shows only progress.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO


def engine_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.update(extra)
    return env


class Progress:
    """One status line that ticks while a long step runs (plain lines when not a TTY)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def run(self, label: str, fn: Any) -> Any:
        start = time.monotonic()
        done = threading.Event()

        def tick() -> None:
            while not done.wait(1.0):
                if self.tty:
                    self.stream.write(f"\r{label} ... {time.monotonic() - start:.0f}s")
                    self.stream.flush()

        thread = threading.Thread(target=tick, daemon=True)
        if not self.tty:
            self.stream.write(f"{label} ...\n")
            self.stream.flush()
        thread.start()
        try:
            return fn()
        finally:
            done.set()
            thread.join()
            lead = "\r" if self.tty else ""
            self.stream.write(f"{lead}{label} ... done in {time.monotonic() - start:.0f}s\n")
            self.stream.flush()


def prepare(
    workdir: Path | None, prefix: str, model: str | None, show: Progress, label: str, **build: Any
) -> tuple[Path, str]:
    """The run's work folder (``workdir``, or a new temporary one) and the model to run:
    ``model``, or a random-weight Llama built offline into the work folder (``build``:
    its shape, see :func:`~vllm_kvguard.tools.tinymodel.build_tiny_model`)."""
    work = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    if model is None:
        from vllm_kvguard.tools.tinymodel import build_tiny_model

        model = str(show.run(label, lambda: build_tiny_model(work / "model", **build)))
    return work, model


def run_child(job: str, args: dict[str, Any], env: dict[str, str], log: Path) -> Any:
    """Run ``job`` of :mod:`.child` in its own process; return the JSON it wrote to ``args["out"]``."""
    with log.open("w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "vllm_kvguard.tools.child", json.dumps({**args, "job": job})],
            env=env,
            stdout=err,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"the engine run failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    return json.loads(Path(args["out"]).read_text())
