"""What runs inside an engine child process (``python -m vllm_kvguard.tools.child JOB_JSON``).

The only module of :mod:`vllm_kvguard.tools` that imports vLLM: the ``kvguard`` process
itself never does (:mod:`.childrun` starts these in a clean environment of their own).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm_kvguard.errors import KVCacheCorruptionError
from vllm_kvguard.tools import bench, drill
from vllm_kvguard.tools.workload import Workload


def drill_workload(args: dict[str, Any]) -> None:
    """Run the workload through one engine; write the outputs as JSON."""
    from vllm import LLM, SamplingParams

    workload = Workload(**args["workload"])
    llm = LLM(model=args["model"], **{**drill.ENGINE_ARGS, **args.get("engine_args", {})})
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens)
    # Per request: the text, None if it ended with an error, and whether the guard flagged it.
    texts: list[tuple[str | None, bool]] = []
    for wave in workload.waves():
        for out in llm.generate(wave, params, use_tqdm=False):
            completion = out.outputs[0]
            failed = completion.finish_reason == "error"
            flagged = str(completion.stop_reason or "").startswith(KVCacheCorruptionError.PREFIX)
            texts.append((None if failed else completion.text, flagged and not failed))
    Path(args["out"]).write_text(json.dumps(texts))


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


def bench_workload(args: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams

    concurrency = int(args.get("concurrency", bench.CONCURRENCY))
    llm = LLM(model=args["model"], **bench.engine_args(concurrency))
    warm = [p for wave in bench.WARMUP.waves() for p in wave]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=bench.WARMUP.max_tokens), use_tqdm=False)
    work = bench.workload(concurrency)
    prompts = [p for wave in work.waves() for p in wave]
    params = SamplingParams(temperature=0.0, max_tokens=work.max_tokens, ignore_eos=True)
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
    result: dict[str, Any] = {
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


def doctor_probe(args: dict[str, Any]) -> None:
    """What ``kvguard doctor`` can only learn inside a process that imports vLLM: the companion
    packages that must load beside torch, whether vLLM's own plugin loader finds the guard,
    the platform, and (with a model) the engine configuration vLLM would build from this
    environment. Each step is tried on its own so that one failure does not hide the others."""
    out: dict[str, Any] = {"companions": {}}
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        try:
            importlib.import_module(name)
            out["companions"][name] = {"version": installed, "error": None}
        except Exception as exc:
            out["companions"][name] = {"version": installed, "error": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = bool(torch.cuda.is_available())
    except Exception as exc:
        out["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        import vllm
        from vllm.plugins import load_general_plugins

        out["vllm"] = vllm.__version__
        load_general_plugins()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        out["plugin_loaded"] = "KVGuardConnector" in KVConnectorFactory._registry
        from vllm.platforms import current_platform

        out["platform"] = str(current_platform.device_type)
    except Exception as exc:
        out["vllm_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        # After vLLM's plugin loader: the guard's plugin has guarded vLLM's kernel scan against
        # numba (connector/patches.py, guard_kernel_scan).
        from vllm_kvguard.digest import rowhash

        out["row_hash"] = rowhash.backend()
    except Exception as exc:
        out["row_hash"] = f"numpy ({type(exc).__name__}: {exc})"[:300]
    if args.get("model") and "vllm_error" not in out:
        try:
            from vllm.engine.arg_utils import EngineArgs

            config = EngineArgs(model=args["model"], **args.get("engine_args", {})).create_engine_config()
            ktc = config.kv_transfer_config
            out["engine"] = {
                "block_size": config.cache_config.block_size,
                "kv_cache_dtype": str(config.cache_config.cache_dtype),
                "prefix_caching": bool(config.cache_config.enable_prefix_caching),
                "connector": None if ktc is None else ktc.kv_connector,
                "guard_in_connector": ktc is not None
                and "KVGuard" in f"{ktc.kv_connector} {ktc.kv_connector_extra_config}",
            }
        except Exception as exc:
            out["engine_error"] = f"{type(exc).__name__}: {exc}"[:500]
    Path(args["out"]).write_text(json.dumps(out))


JOBS = {"drill": drill_workload, "bench": bench_workload, "doctor": doctor_probe}

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    JOBS[job.pop("job")](job)
