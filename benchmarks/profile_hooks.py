"""Where the guard's time goes, hook by hook, on the `kvguard bench` workload.

    python benchmarks/profile_hooks.py [reuse|sampled|paranoid] [--concurrency 16] [--pyinstrument out.txt]
                                       [--lines module:Class.method,...] [--floor empty|facade]
                                       [--json out.json]

Runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the
scheduler and worker halves of the guard can be timed directly, then prints
calls, total and per-call time of each hook and the guard's share of the
timed generate() call. With --pyinstrument, also writes a sampling profile; with --lines, prints
line_profiler's per-line times of the named functions over the timed call (``pip install
line_profiler``; it slows what it profiles several times, so read its shares, not its totals).

It also splits the guard's time by kind of step, in the engine (each hook call counted to the
step whose ``build_connector_meta`` came last; the engine runs one step at a time here):
``prefill`` (a new request, or a request given more than one token), ``decode, page events``
(a page filled, a block handed out, a prefix-cache hit), ``decode, reads due`` (sampled reads or
scrub pages planned) and ``quiet decode`` (none of these: the step issue 15 asks to cost the
scheduler side <= 30 us and the worker side <= 20 us). Per kind: steps, their share of the
guard's time, and the median us a step of each side (scheduler: build_connector_meta,
update_connector_output, get_kv_connector_stats, before_output, after_output; worker: the rest,
the write op's observer included).

With ``--floor`` the same run measures what is under the guard's own work, timed the same way:
``--floor empty`` makes the connector's hooks empty functions (no guard code, no write-op
observer, no ``update_from_output`` patch: what vLLM calling a KV connector's hooks costs in this
engine, and this script timing them); ``--floor facade`` keeps the guard's connector class, its
error handling and its per-step accounting (the worker's step time, the write op's wrapper) but
makes the scheduler and worker sides do nothing else. The guard's own quiet step cannot cost less
than the first; what it does beyond the second is its checking.

With ``--json`` it also writes the run's figures (shares, the hashing floor, each kind of step's
medians) to a file: ``benchmarks/floors.py`` runs it that way for every mode and floor.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("policy", nargs="?", default="sampled", choices=["reuse", "sampled", "paranoid"])
    ap.add_argument("--pyinstrument", type=Path, help="write a pyinstrument text profile here")
    ap.add_argument("--concurrency", type=int, default=16, help="requests running at once (kvguard bench's)")
    ap.add_argument(
        "--lines",
        default="",
        help="line-profile these functions, comma-separated module:qualname "
        "(e.g. vllm_kvguard.connector.worker:KVGuardWorker.wait_for_save)",
    )
    ap.add_argument(
        "--floor",
        choices=["empty", "facade"],
        help="measure the floor instead of the guard: empty hooks, or the guard's facade with idle sides",
    )
    ap.add_argument("--json", type=Path, help="also write the run's figures here (for benchmarks/floors.py)")
    a = ap.parse_args()
    os.environ.update(
        VLLM_KVGUARD="1",
        VLLM_KVGUARD_VERIFY=a.policy,
        VLLM_KVGUARD_LOG_LEVEL="WARNING",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
    )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    import vllm_kvguard.connector as connector
    from vllm_kvguard.tools.bench import WARMUP, engine_args, workload
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    if a.floor:
        _install_floor(a.floor)
    model = build_tiny_model(
        Path(tempfile.gettempdir()) / "kvguard-bench-model", layers=4, hidden=512, heads=8, kv_heads=8
    )
    llm = LLM(model=str(model), **engine_args(a.concurrency))
    work = workload(a.concurrency)
    totals: dict[str, list[float]] = {}
    # The same hooks' CPU time on the calling thread (steadier than wall time on a shared machine:
    # time the thread was not running does not count).
    cpu: dict[str, float] = {}
    hooks = [
        "build_connector_meta",
        "update_connector_output",
        "get_kv_connector_stats",
        "bind_connector_metadata",
        "wait_for_layer_load",
        "wait_for_save",
        "build_connector_worker_meta",
        "before_output",
        "after_output",
    ]
    # Per step (one entry per build_connector_meta): its kind, each side's seconds, each hook's.
    steps_seen: list[list[Any]] = []

    def note_step(so: Any, meta: Any) -> None:
        steps_seen.append([_step_kind(so, meta), 0.0, 0.0, {}])

    def charge(name: str, side: int, spent: float, cpu_spent: float) -> None:
        # One call's time: to the hook's totals and to the step it ran in (side 1: scheduler,
        # 2: worker).
        totals.setdefault(name, []).append(spent)
        cpu[name] = cpu.get(name, 0.0) + cpu_spent
        if steps_seen:
            step = steps_seen[-1]
            step[side] += spent
            step[3][name] = step[3].get(name, 0.0) + spent

    for name in hooks:
        original = getattr(connector.KVGuardConnector, name)
        side = 1 if name in SCHEDULER_SIDE else 2

        def timed(
            self: Any, *args: Any, _original: Any = original, _name: str = name, _side: int = side, **kw: Any
        ) -> Any:
            start, cpu_start = time.perf_counter(), time.thread_time()
            out = None
            try:
                out = _original(self, *args, **kw)
                return out
            finally:
                spent, cpu_spent = time.perf_counter() - start, time.thread_time() - cpu_start
                if _name == "build_connector_meta" and out is not None:
                    note_step(args[0], out)  # (first: this call counts to the step it plans)
                charge(_name, _side, spent, cpu_spent)

        setattr(connector.KVGuardConnector, name, timed)
    import vllm_kvguard.connector.patches as patches

    observer = getattr(patches, "_KV_WRITE_OBSERVER", None)
    if observer is not None:
        # The rows vLLM's CPU write op is handed, kept inside the forward (no hook of its own).
        def observed(*args: Any, _observer: Any = observer) -> None:
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                _observer(*args)
            finally:
                charge(
                    "kv write (in the forward)",
                    2,
                    time.perf_counter() - start,
                    time.thread_time() - cpu_start,
                )

        patches._KV_WRITE_OBSERVER = observed
        hooks.append("kv write (in the forward)")
    # Bytes the guard hashes in the timed call, by what for (seal, verify, ...): the floor under
    # its time is hashing them (below).
    from vllm_kvguard.core.counters import GuardCounters

    hashed: dict[str, float] = {}
    add = GuardCounters.add

    def counted(self: Any, key: str, n: float = 1, label: str | None = None) -> None:
        if key == "bytes_hashed" and counting:
            hashed[label or ""] = hashed.get(label or "", 0) + n
        add(self, key, n, label)

    GuardCounters.add = counted  # type: ignore[method-assign]
    counting = False
    llm.generate([p for w in WARMUP.waves() for p in w], SamplingParams(max_tokens=8), use_tqdm=False)
    counting = True
    totals.clear()
    cpu.clear()
    steps_seen.clear()
    prompts = [p for w in work.waves() for p in w]
    params = SamplingParams(temperature=0.0, max_tokens=work.max_tokens, ignore_eos=True)
    lines = _line_profiler(a.lines) if a.lines else None
    profiler = None
    if a.pyinstrument:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0002)
        profiler.start()
    if lines is not None:
        lines.enable_by_count()
    start, cpu_start = time.perf_counter(), time.thread_time()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu_elapsed = time.perf_counter() - start, time.thread_time() - cpu_start
    counting = False
    if lines is not None:
        lines.disable_by_count()
    if profiler is not None:
        profiler.stop()
        a.pyinstrument.write_text(
            profiler.output_text(unicode=False, color=False, show_all=True, short_mode=False)
        )
    spent = sum(sum(v) for v in totals.values())
    share = spent / elapsed
    if a.floor:
        print(f"floor {a.floor!r} (not the guard's work: see --floor)")
    print(
        f"policy {a.policy}: generate() {elapsed:.3f} s, inside the guard {spent * 1e3:.1f} ms ({share:.2%})"
    )
    cpu_spent = sum(cpu.values())
    print(
        f"  thread CPU time: generate() {cpu_elapsed:.3f} s, inside the guard {cpu_spent * 1e3:.1f} ms"
        f" ({cpu_spent / cpu_elapsed:.2%})"
    )
    for name in hooks:
        values = totals.get(name, [])
        if values:
            total = sum(values)
            per_call = total / len(values) * 1e6
            cpu_us = cpu.get(name, 0.0) / len(values) * 1e6
            print(
                f"  {name:28s} {len(values):5d} calls {total * 1e3:8.1f} ms {per_call:8.1f} us/call"
                f" {cpu_us:8.1f} us CPU/call"
            )
    steps = len(totals.get("build_connector_meta", [])) or 1
    cache = llm.llm_engine.vllm_config.cache_config
    page = 2 * int(cache.block_size) * 8 * 64 * 2  # a layer's K and V of one block: 8 KV heads of 64, bf16
    floor = _xxh3_seconds(page, int(sum(hashed.values())))
    per_step = ", ".join(f"{k} {v / steps / 2**20:.2f} MiB" for k, v in sorted(hashed.items()))
    print(
        f"  bytes hashed a step: {per_step};"
        f" XXH3 over as many {page >> 10} KiB pages, out of memory: {floor * 1e3:.1f} ms"
        f" ({floor / elapsed:.2%} of generate(): the floor under hashing them)"
    )
    kinds = _print_kinds(steps_seen, spent)
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "policy": a.policy,
                    "concurrency": a.concurrency,
                    "floor": a.floor,
                    "generate_s": elapsed,
                    "steps": steps,
                    "guard_s": spent,
                    "share": share,
                    "hashing_floor_s": floor,
                    "hashing_floor_share": floor / elapsed,
                    "bytes_hashed_per_step": {k: v / steps for k, v in hashed.items()},
                    "kinds": kinds,
                },
                indent=1,
            )
        )
    if lines is not None:
        lines.print_stats(output_unit=1e-6, stripzeros=True)


SCHEDULER_SIDE = {
    "build_connector_meta",
    "update_connector_output",
    "get_kv_connector_stats",
    "before_output",
    "after_output",
}
KINDS = ("prefill", "decode, page events", "decode, reads due", "quiet decode")


def _step_kind(so: Any, meta: Any) -> str:
    """One of KINDS for a step, from vLLM's scheduler output and the guard's metadata."""
    ntok = so.num_scheduled_tokens
    if so.scheduled_new_reqs or any(n != 1 for n in ntok.values()):
        return KINDS[0]
    plan = meta.plan
    if (
        plan.seal
        or plan.given
        or plan.verify
        or plan.given_decodes is not None
        or plan.sealed_decodes is not None
    ):
        return KINDS[1]
    if plan.read_verify or plan.read_partial or meta.scrub or meta.scrub_filling:
        return KINDS[2]
    return KINDS[3]


def _print_kinds(steps_seen: list[list[Any]], spent: float) -> dict[str, dict[str, float]]:
    """The guard's time by kind of step (see the module's docstring); returns what it printed,
    by kind: steps, share of the guard's time, scheduler and worker µs a step (medians)."""
    import statistics

    out: dict[str, dict[str, float]] = {}
    print("  by kind of step (us a step, medians; each hook counted to the step it followed):")
    for kind in KINDS:
        mine = [s for s in steps_seen if s[0] == kind]
        if not mine:
            continue
        sched = statistics.median(s[1] for s in mine) * 1e6
        work = statistics.median(s[2] for s in mine) * 1e6
        share = sum(s[1] + s[2] for s in mine) / spent if spent else 0.0
        out[kind] = {"steps": len(mine), "share": share, "scheduler_us": sched, "worker_us": work}
        print(
            f"    {kind:20s} {len(mine):4d} steps  {share:6.1%} of the guard's time"
            f"  scheduler {sched:7.1f}  worker {work:7.1f}"
        )
    quiet = [s[3] for s in steps_seen if s[0] == KINDS[-1]]
    if quiet:
        names = sorted({name for hooks in quiet for name in hooks})
        medians = {name: statistics.median(h.get(name, 0.0) for h in quiet) * 1e6 for name in names}
        parts = ", ".join(f"{name} {us:.1f}" for name, us in sorted(medians.items(), key=lambda kv: -kv[1]))
        print(f"    quiet decode, us a step by hook (medians): {parts}")
    return out


def _xxh3_seconds(page: int, total: int) -> float:
    """Seconds XXH3 takes over ``total`` bytes in pages of ``page`` bytes read out of memory
    (a 512 MiB buffer walked page by page, median of 3 walks), scaled to ``total``."""
    import statistics

    import numpy as np
    import xxhash

    if not total:
        return 0.0
    buf = np.ones(512 << 20, dtype=np.uint8)
    view = memoryview(buf)
    h = xxhash.xxh3_64_intdigest
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for at in range(0, len(buf) - page + 1, page):
            h(view[at : at + page])
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * total / len(buf)


def _install_floor(kind: str) -> None:
    """Before the engine is built: the connector's hooks empty (``empty``), or the guard's two
    sides idle behind its facade (``facade``). Every step's metadata is one empty plan."""
    import vllm_kvguard.connector as connector
    from vllm_kvguard.connector import patches
    from vllm_kvguard.connector.metadata import KVGuardMetadata
    from vllm_kvguard.connector.scheduler import KVGuardScheduler
    from vllm_kvguard.connector.worker import KVGuardWorker
    from vllm_kvguard.core.plan import StepPlan

    empty_meta = KVGuardMetadata(StepPlan(0))

    def nothing(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    if kind == "empty":
        cls: Any = connector.KVGuardConnector
        patches.patch_scheduler = lambda find: True  # no update_from_output wrapper, no before/after calls
        cls.register_kv_caches = nothing  # no write-op observer
        # vLLM's base class keeps the step's metadata (its per-layer calls need it bound).
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as base

        cls.bind_connector_metadata = base.bind_connector_metadata
        cls.clear_connector_metadata = base.clear_connector_metadata
        for name in (
            "wait_for_layer_load",
            "wait_for_save",
            "finish_forward",
            "update_state_after_alloc",
            "update_connector_output",
        ):
            setattr(cls, name, nothing)
        cls.build_connector_meta = lambda self, so: empty_meta
        cls.build_connector_worker_meta = nothing
        cls.get_kv_connector_stats = nothing
        cls.get_block_ids_with_load_errors = lambda self: set()
        cls.request_finished = lambda self, request, block_ids: (False, None)
        return
    sched: Any = KVGuardScheduler
    work: Any = KVGuardWorker
    sched.build_connector_meta = lambda self, so: empty_meta
    for name in (
        "before_output",
        "after_output",
        "update_connector_output",
        "note_request",
        "request_finished",
        "stats",
    ):
        setattr(sched, name, nothing)
    sched.take_pending_failures = lambda self: {}

    def bind(self: Any, meta: Any) -> None:
        self._step_start, self._meta = time.perf_counter(), meta

    work.bind_connector_metadata = bind
    work.wait_for_save = nothing
    work.finish_forward = nothing
    register = work.register_kv_caches

    def register_idle(self: Any, kv_caches: Any) -> None:
        register(self, kv_caches)
        self.written = None  # the write op's wrapper stays, its observer returns at once
        self.reads_left = 0

    work.register_kv_caches = register_idle


def _line_profiler(spec: str) -> Any:
    import importlib

    try:
        from line_profiler import LineProfiler
    except ImportError as exc:
        raise SystemExit("--lines needs line_profiler: pip install line_profiler") from exc
    profiler = LineProfiler()
    for item in spec.split(","):
        module, sep, qualname = item.strip().partition(":")
        if not sep or not qualname:
            raise SystemExit(
                f"--lines: {item!r} is not module:qualname (e.g. vllm_kvguard.core.ledger:BlockLedger.plan)"
            )
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        profiler.add_function(target)
    return profiler


if __name__ == "__main__":
    main()
