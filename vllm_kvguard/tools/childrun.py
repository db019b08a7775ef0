"""Running vLLM engines in child processes, for the drill and the benchmark.

Each engine run gets its own process (a clean environment, its own engine) and
writes its result as JSON; its output goes to a log file so that the terminal
shows only progress.
"""

from __future__ import annotations

import json
import os
import shutil
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
        ok = False
        try:
            value = fn()
            ok = True
            return value
        finally:
            done.set()
            thread.join()
            lead = "\r" if self.tty else ""
            outcome = "done" if ok else "FAILED"
            self.stream.write(f"{lead}{label} ... {outcome} after {time.monotonic() - start:.0f}s\n")
            self.stream.flush()


def check_model(model: str | None) -> None:
    """A model given on the command line is a local directory with a ``config.json`` (the tools
    run offline): checked before any phase starts, so a typo costs no engine start."""
    if model is None:
        return
    path = Path(model)
    if not path.is_dir():
        raise RuntimeError(
            f"--model={model!r} is not valid: expected a local model directory (with config.json); "
            "these tools run offline (`kvguard model PATH` builds a tiny one)"
        )
    if not (path / "config.json").is_file():
        raise RuntimeError(f"--model={model!r} is not valid: {path} has no config.json")


class WorkFolder:
    """The run's work folder: ``workdir`` (kept), or a new temporary one, removed when the run
    succeeds unless ``keep``; a failed run keeps it for its logs and says where."""

    def __init__(self, workdir: Path | None, prefix: str, keep: bool) -> None:
        self.temporary = workdir is None
        self.path = Path(workdir or tempfile.mkdtemp(prefix=prefix))
        self.path.mkdir(parents=True, exist_ok=True)
        self.keep = keep or not self.temporary

    def finish(self, stream: TextIO, ok: bool) -> None:
        if self.keep or not ok:
            stream.write(f"engine logs and the guard's log are in {self.path}\n")
        else:
            shutil.rmtree(self.path, ignore_errors=True)
            stream.write(f"removed the work folder {self.path} (--keep keeps it)\n")


def prepare(work: WorkFolder, model: str | None, show: Progress, label: str, **build: Any) -> str:
    """The model to run: ``model`` (checked), or a random-weight Llama built offline into the
    work folder (``build``: its shape, see :func:`~vllm_kvguard.tools.tinymodel.build_tiny_model`)."""
    check_model(model)
    if model is None:
        from vllm_kvguard.tools.tinymodel import build_tiny_model

        model = str(show.run(label, lambda: build_tiny_model(work.path / "model", **build)))
    return model


# Known ways an engine child dies, and what to do (matched on its log).
HINTS = (
    (
        ("torchvision", "torchaudio", "torchcodec"),
        "a torchvision/torchaudio/torchcodec from PyPI does not load beside vLLM's +cpu torch; "
        "fix: pip uninstall -y torchvision torchaudio torchcodec (`kvguard doctor` checks this)",
    ),
    (
        ("Cannot allocate memory", "out of memory", "VLLM_CPU_KVCACHE_SPACE"),
        "not enough memory for the KV cache: set VLLM_CPU_KVCACHE_SPACE (GiB) lower",
    ),
)


def hint(log_tail: str) -> str | None:
    """What to do about a child that failed, from the last lines of its log (None: unknown)."""
    errors = [line for line in log_tail.splitlines() if "Error" in line or "error" in line]
    text = "\n".join(errors)
    for needles, advice in HINTS:
        if any(n in text for n in needles):
            return advice
    return None


def run_child(job: str, args: dict[str, Any], env: dict[str, str], log: Path) -> Any:
    """Run ``job`` of :mod:`.child` in its own process; return the JSON it wrote to ``args["out"]``.

    The child runs in the log's folder (the work folder), not here: ``python -m`` puts its
    current directory first on ``sys.path``, so a child started inside a checkout would import
    that checkout's package whatever ``PYTHONPATH`` says (comparing two trees with ``kvguard
    bench`` would run one of them twice). Paths in ``args`` are made absolute for it."""
    args = dict(args)
    for key in ("model", "out"):
        value = args.get(key)
        if isinstance(value, str) and (key == "out" or Path(value).exists()):
            args[key] = str(Path(value).resolve())
    with log.open("w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "vllm_kvguard.tools.child", json.dumps({**args, "job": job})],
            env=env,
            stdout=err,
            stderr=subprocess.STDOUT,
            check=False,
            cwd=log.resolve().parent,
        )
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        advice = hint(tail)
        if advice:
            raise RuntimeError(f"the engine run failed (exit {proc.returncode}): {advice}; its log: {log}")
        raise RuntimeError(f"the engine run failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    return json.loads(Path(args["out"]).read_text())
