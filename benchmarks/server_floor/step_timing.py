"""Per-step timing inside a server's processes (``load.py --timing``): wall and CPU time of
vLLM's ``Scheduler.schedule`` and ``update_from_output`` (the guard's hooks inside them
included) on the engine core's thread, and of ``Worker.execute_model`` (the forward, with the
guard's worker hooks) in the worker. Each process writes its sums to
``<KVGUARD_BENCH_TIMING>.<pid>.json`` every 100 calls and at exit.

vLLM's CPU engine steps synchronously, so these are the step's critical path; CPU time is the
thread's own (``time.thread_time``), and wall minus CPU is time the thread was not running:
another thread holding the GIL, or another process on its core.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_sums: dict[str, list[float]] = {}


def _dump(prefix: str) -> None:
    with open(f"{prefix}.{os.getpid()}.json", "w") as f:
        json.dump({name: {"calls": n, "wall_s": w, "cpu_s": c} for name, (n, w, c) in _sums.items()}, f)


def _timed(prefix: str, owner: type, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            entry = _sums.setdefault(label, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - wall
            entry[2] += time.thread_time() - cpu
            if entry[0] % 100 == 0:
                _dump(prefix)

    setattr(owner, name, timed)


def install(prefix: str) -> None:
    """Wrap the three calls as their modules are imported (update_from_output at the engine's
    first step, after the guard's own wrapper, so that its hooks count)."""

    def engine_core(m: Any) -> None:
        step = m.EngineCore.step
        late: list[bool] = []

        def first_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not late:
                late.append(True)
                from vllm.v1.core.sched.scheduler import Scheduler

                _timed(prefix, Scheduler, "update_from_output", "update_from_output")
            return step(self, *args, **kwargs)

        m.EngineCore.step = first_step

    todo: dict[str, Callable[[Any], None]] = {
        "vllm.v1.worker.gpu_worker": lambda m: _timed(prefix, m.Worker, "execute_model", "execute_model"),
        "vllm.v1.core.sched.scheduler": lambda m: _timed(prefix, m.Scheduler, "schedule", "schedule"),
        "vllm.v1.engine.core": engine_core,
    }
    real_import = builtins.__import__

    def importing(name: str, *args: Any, **kwargs: Any) -> Any:
        module = real_import(name, *args, **kwargs)
        for done in [k for k in todo if k in sys.modules]:
            try:
                todo[done](sys.modules[done])
            except AttributeError:
                continue  # the module is still being imported
            del todo[done]
        if not todo:
            builtins.__import__ = real_import
        return module

    builtins.__import__ = importing
    atexit.register(_dump, prefix)


def read(prefix: str) -> dict[str, dict[str, float]]:
    """Per-call means in ms over every process of one server: {call: {calls, wall_ms, cpu_ms}}."""
    out: dict[str, dict[str, float]] = {}
    base = Path(prefix)
    for path in base.parent.glob(base.name + ".*.json"):
        for name, s in json.loads(path.read_text()).items():
            if s["calls"]:
                out[name] = {
                    "calls": s["calls"],
                    "wall_ms": round(s["wall_s"] * 1e3 / s["calls"], 3),
                    "cpu_ms": round(s["cpu_s"] * 1e3 / s["calls"], 3),
                }
    return out
