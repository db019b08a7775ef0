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

import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_kvguard.childrun import Progress, engine_env, run_child
from vllm_kvguard.workload import Workload

CONFIGS: dict[str, dict[str, str]] = {
    "off": {"VLLM_KVGUARD": "0"},
    "default": {"VLLM_KVGUARD": "1"},
    "paranoid": {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_VERIFY": "paranoid"},
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


def _metric_totals(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0.0) + m.sum
            out[m.name + ":count"] = out.get(m.name + ":count", 0.0) + m.count
    # vLLM's metric reader rounds counters to integers: read the guard's seconds exactly.
    from prometheus_client import REGISTRY

    for family in REGISTRY.collect():
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in ("vllm:kvguard_overhead_seconds", "vllm:kvguard_worker_step_seconds"):
                out[name] = out.get(name, 0.0) + sample.value
    return out


def _child(args: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["model"], **ENGINE_ARGS)
    warm = [p for wave in WARMUP.waves() for p in wave]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=WARMUP.max_tokens), use_tqdm=False)
    prompts = [p for wave in WORKLOAD.waves() for p in wave]
    params = SamplingParams(temperature=0.0, max_tokens=WORKLOAD.max_tokens, ignore_eos=True)
    before = _metric_totals(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = _metric_totals(llm)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def mean(name: str) -> float:
        count = delta.get(name + ":count", 0.0)
        return delta.get(name + ":sum", 0.0) / count if count else float("nan")

    step = delta.get("vllm:kvguard_worker_step_seconds", 0.0)
    result = {
        "elapsed_s": elapsed,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outs),
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "ttft_s": mean("vllm:time_to_first_token_seconds"),
        "itl_s": mean("vllm:inter_token_latency_seconds"),
        "guard_share": delta.get("vllm:kvguard_overhead_seconds", 0.0) / step if step else None,
    }
    result["tokens_per_s"] = (result["output_tokens"] + result["prompt_tokens"]) / elapsed
    result["output_tokens_per_s"] = result["output_tokens"] / elapsed
    Path(args["out"]).write_text(json.dumps(result))


def _run_one(model: str, config: str, work: Path, index: int) -> dict[str, Any]:
    env = engine_env({**CONFIGS[config], "VLLM_KVGUARD_LOG_LEVEL": "WARNING"})
    args = {"model": model, "out": str(work / f"{config}-{index}.json")}
    return run_child("vllm_kvguard.bench", args, env, work / f"{config}-{index}.log")


def run_bench(
    *,
    model: str | None,
    repeats: int,
    configs: list[str],
    workdir: Path | None = None,
    progress: Any = sys.stderr,
) -> dict[str, Any]:
    work = Path(workdir or tempfile.mkdtemp(prefix="kvguard-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    show = Progress(progress)
    if model is None:
        from vllm_kvguard.tinymodel import build_tiny_model

        model = str(
            show.run(
                "building a random-weight Llama (4 layers, hidden 512, head size 64)",
                lambda: build_tiny_model(work / "bench-model", layers=4, hidden=512, heads=8, kv_heads=8),
            )
        )
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(repeats):
        for config in configs:
            runs[config].append(
                show.run(
                    f"[{rep + 1}/{repeats}] {config}", lambda c=config, r=rep: _run_one(model, c, work, r)
                )
            )
    return summarize(runs, model=model, repeats=repeats)


def _median(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None and v == v]
    return statistics.median(real) if real else None


def summarize(runs: dict[str, list[dict[str, Any]]], *, model: str, repeats: int) -> dict[str, Any]:
    """Medians per configuration and ratios to guard-off (pure: no engine here)."""
    keys = ("tokens_per_s", "output_tokens_per_s", "ttft_s", "itl_s", "guard_share")
    medians = {c: {k: _median([r[k] for r in rs]) for k in keys} for c, rs in runs.items()}
    base = medians.get("off", {})
    ratios = {
        c: {
            k: (m[k] / base[k]) if m.get(k) is not None and base.get(k) else None
            for k in ("tokens_per_s", "ttft_s", "itl_s")
        }
        for c, m in medians.items()
    }
    return {
        "model": model,
        "repeats": repeats,
        "workload": asdict(WORKLOAD),
        "engine_args": ENGINE_ARGS,
        "medians": medians,
        "ratio_to_off": ratios,
        "runs": runs,
    }


def render(report: dict[str, Any]) -> str:
    def fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}{unit}"

    lines = [
        "config     tokens/s  ratio   TTFT ms  ratio   ITL ms  ratio   guard share of step",
        "---------  --------  -----   -------  -----   ------  -----   -------------------",
    ]
    for config, m in report["medians"].items():
        r = report["ratio_to_off"][config]
        lines.append(
            f"{config:9s}  {fmt(m['tokens_per_s']):>8s}  {fmt(r['tokens_per_s'], digits=3):>5s}"
            f"   {fmt(m['ttft_s'], scale=1e3):>7s}  {fmt(r['ttft_s'], digits=3):>5s}"
            f"   {fmt(m['itl_s'], scale=1e3, digits=2):>6s}  {fmt(r['itl_s'], digits=3):>5s}"
            f"   {fmt(m['guard_share'], ' %', 100.0, 2):>19s}"
        )
    lines.append(f"(medians of {report['repeats']} interleaved runs; ratios are to guard off)")
    return "\n".join(lines)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
