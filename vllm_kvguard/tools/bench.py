"""``kvguard bench``: what the guard costs, side by side with plain vLLM.

The same prefix-sharing workload runs through vLLM with the guard off, on with
the default policy, and on with ``paranoid`` read verification, each in its own
engine process, interleaved (off, default, paranoid, off, ...) so that a noisy
machine hurts all of them alike. Each run warms up, then times the workload and
reads vLLM's own metrics for time to first token and inter-token latency, and
the guard's own ``vllm:kvguard_overhead_seconds`` / ``worker_step_seconds`` for
its share of step time. The report gives medians over repetitions and ratios
to guard-off.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_kvguard.tools.childrun import Progress, WorkFolder, check_model, engine_env, prepare, run_child
from vllm_kvguard.tools.workload import Workload

CONFIGS: dict[str, dict[str, str]] = {
    "off": {"VLLM_KVGUARD": "0"},
    "default": {"VLLM_KVGUARD": "1"},
    "paranoid": {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_VERIFY": "paranoid"},
    # The cheapest verify mode (prefix-cache hits only; seals, rows and identity as in default).
    "reuse": {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_VERIFY": "reuse"},
    # The default without row digests (full pages only, as before issue 13): what rows cost.
    "rows-off": {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_ROWS": "0"},
    # The default without the finish check (final outputs not held): what the check costs.
    "finish-off": {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_FINISH_CHECK": "0"},
}
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "block_size": 32,
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "disable_log_stats": False,
}
WORKLOAD = Workload(prefixes=4, per_prefix=8, prefix_words=384, suffix_words=16, max_tokens=64, seed=7)
WARMUP = Workload(prefixes=2, per_prefix=2, prefix_words=64, suffix_words=8, max_tokens=8, seed=99)
CONCURRENCY = ENGINE_ARGS["max_num_seqs"]


def engine_args(concurrency: int = CONCURRENCY) -> dict[str, Any]:
    """The bench's engine settings with up to ``concurrency`` requests running at once."""
    return {**ENGINE_ARGS, "max_num_seqs": concurrency}


def workload(concurrency: int = CONCURRENCY) -> Workload:
    """Twice as many requests as can run at once (the default: :data:`WORKLOAD`), four prefixes."""
    if concurrency == CONCURRENCY:
        return WORKLOAD
    return Workload(
        prefixes=4,
        per_prefix=max(2, concurrency // 2),
        prefix_words=384,
        suffix_words=16,
        max_tokens=64,
        seed=7,
    )


def _run_one(model: str, config: str, work: Path, index: int, concurrency: int) -> dict[str, Any]:
    env = engine_env({**CONFIGS[config], "VLLM_KVGUARD_LOG_LEVEL": "WARNING"})
    args = {"model": model, "out": str(work / f"{config}-{index}.json"), "concurrency": concurrency}
    return run_child("bench", args, env, work / f"{config}-{index}.log")


def run_bench(
    *,
    model: str | None,
    repeats: int,
    configs: list[str],
    workdir: Path | None = None,
    keep: bool = False,
    progress: Any = sys.stderr,
    concurrency: int = CONCURRENCY,
) -> dict[str, Any]:
    show = Progress(progress)
    check_model(model)
    folder = WorkFolder(workdir, "kvguard-bench-", keep)
    ok = False
    try:
        model = prepare(
            folder,
            model,
            show,
            "building a random-weight Llama (4 layers, hidden 512, head size 64)",
            layers=4,
            hidden=512,
            heads=8,
            kv_heads=8,
        )
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for rep in range(repeats):
            for config in configs:
                runs[config].append(
                    show.run(
                        f"[{rep + 1}/{repeats}] {config}",
                        lambda c=config, r=rep: _run_one(model, c, folder.path, r, concurrency),
                    )
                )
        ok = True
    finally:
        folder.finish(progress, ok)
    return summarize(runs, model=model, repeats=repeats, concurrency=concurrency)


def _median(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None and v == v]
    return statistics.median(real) if real else None


def _spread(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None and v == v]
    if len(real) < 2 or not statistics.median(real):
        return None
    return (max(real) - min(real)) / statistics.median(real)


def summarize(
    runs: dict[str, list[dict[str, Any]]], *, model: str, repeats: int, concurrency: int = CONCURRENCY
) -> dict[str, Any]:
    """Medians per configuration and ratios to guard-off (pure: no engine here)."""
    keys = ("tokens_per_s", "output_tokens_per_s", "ttft_s", "itl_s", "guard_share")
    medians = {c: {k: _median([r[k] for r in rs]) for k in keys} for c, rs in runs.items()}
    base = medians.get("off", {})

    def ratio(value: float | None, off: float | None) -> float | None:
        return value / off if value is not None and off else None

    ratios = {
        c: {k: ratio(m.get(k), base.get(k)) for k in ("tokens_per_s", "ttft_s", "itl_s")}
        for c, m in medians.items()
    }
    # Run-to-run spread of throughput: (max - min) / median over the repeats. Guard-off's own
    # spread is the machine's noise: a ratio to guard-off closer to 1 than that says nothing.
    spread = {c: _spread([r["tokens_per_s"] for r in rs]) for c, rs in runs.items()}
    return {
        "model": model,
        "repeats": repeats,
        "concurrency": concurrency,
        "workload": asdict(workload(concurrency)),
        "engine_args": engine_args(concurrency),
        "medians": medians,
        "ratio_to_off": ratios,
        "tokens_per_s_spread": spread,
        "runs": runs,
    }


def render(report: dict[str, Any]) -> str:
    def fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}{unit}"

    lines = [
        "config     tokens/s  spread  ratio   TTFT ms  ratio   ITL ms  ratio   guard share of step",
        "---------  --------  ------  -----   -------  -----   ------  -----   -------------------",
    ]
    spread = report.get("tokens_per_s_spread", {})
    for config, m in report["medians"].items():
        r = report["ratio_to_off"][config]
        lines.append(
            f"{config:9s}  {fmt(m['tokens_per_s']):>8s}  {fmt(spread.get(config), ' %', 100.0, 0):>6s}"
            f"  {fmt(r['tokens_per_s'], digits=3):>5s}"
            f"   {fmt(m['ttft_s'], scale=1e3):>7s}  {fmt(r['ttft_s'], digits=3):>5s}"
            f"   {fmt(m['itl_s'], scale=1e3, digits=2):>6s}  {fmt(r['itl_s'], digits=3):>5s}"
            f"   {fmt(m['guard_share'], ' %', 100.0, 2):>19s}"
        )
    running = report.get("concurrency", CONCURRENCY)
    lines.append(
        f"(medians of {report['repeats']} interleaved runs, up to {running} requests at once; "
        "ratios are to guard off; spread: (max - min) / median of tokens/s over the runs, "
        "guard off's is the machine's own noise)"
    )
    return "\n".join(lines)
