"""No false alarm across vLLM's features: each run with the guard on gives the guard-off text,
request by request, and the guard reports nothing.

Sliding window: a Mistral-style model whose every layer attends to the last 64 tokens. vLLM
frees the pages behind the window while the request runs (its block table gets the null block
there) and hands them to other requests; the lifecycle audit took that for a block allocated
while held (206 violations in the default mode, 940 in paranoid, clean requests failed).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.engine.harness import FINDINGS, INPROC, engine, greedy, guard_env, read_log

pytestmark = pytest.mark.engine


def _findings(lines: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """What the guard reported finding, from its log lines (empty on a clean run)."""
    return [(line["event"], line.get("what")) for line in lines if line["event"] in FINDINGS]


@pytest.fixture(scope="module")
def sliding_model() -> str:
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    return str(build_tiny_model(ROOT / ".cache" / "tiny-mistral", family="mistral"))


# 8 prompts of 150 tokens (5 pages, 2 of them behind the window by the end of the prompt),
# 64 tokens each, in a pool of 48 blocks: freed pages change hands while their requests run.
# The first 4 again in the same batch: prefix-cache hits (null blocks behind the window).
SLIDING_PROMPTS = [" ".join(f"w{(i * 7 + j * 31) % 400 + 17}" for i in range(150)) for j in range(8)]


def _sliding(model: str, env: dict[str, str]) -> list[str]:
    with engine(model, env, num_gpu_blocks_override=48, max_num_batched_tokens=512) as llm:
        config = llm.llm_engine.vllm_config.model_config.hf_config
        assert getattr(config, "sliding_window", None) == 64
        outs = llm.generate(
            SLIDING_PROMPTS + SLIDING_PROMPTS[:4], greedy(64, ignore_eos=True), use_tqdm=False
        )
    assert all(o.outputs[0].finish_reason == "length" for o in outs), [o.outputs[0].stop_reason for o in outs]
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def sliding_plain(sliding_model: str) -> list[str]:
    return _sliding(sliding_model, {"VLLM_KVGUARD": "0", **INPROC})


@pytest.mark.parametrize("verify", ["sampled", "paranoid"])
def test_sliding_window_pages_freed_while_running_raise_no_false_alarm(
    sliding_model: str, sliding_plain: list[str], tmp_path: Path, verify: str
) -> None:
    log = tmp_path / "guard.jsonl"
    texts = _sliding(sliding_model, guard_env("quarantine", log, **INPROC, VLLM_KVGUARD_VERIFY=verify))
    lines: list[dict[str, Any]] = read_log(log)
    assert _findings(lines) == []
    assert texts == sliding_plain
    assert any(line["event"] == "kvguard_started" for line in lines)


# ------------------------------------------------------------- request-level features
# Run one after another in one engine per mode, on the harness's small pool (chunked prefill,
# 20 blocks of 32): n > 1 sampling, beam search, a request aborted mid-decode whose
# prefix is then reused, and cache_salt (the same prompt under two salts and again).


def _request_features(llm: Any) -> list[str]:
    from vllm import SamplingParams
    from vllm.sampling_params import BeamSearchParams

    from tests.engine.harness import words

    texts: list[str] = []
    shared = words(31, 70)
    # top_k=1: a random sampler with one candidate, the same text each run (seeded sampling
    # does not run on the CPU build: "CPU Generator does not use offset"; n > 1 is refused
    # with greedy). n=3 forks three children that share the prompt's pages.
    sampled = SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=24)
    for out in llm.generate([shared + " w5", shared + " w6"], sampled, use_tqdm=False):
        assert len(out.outputs) == 3
        texts += [c.text for c in out.outputs]
    beams = llm.beam_search([{"prompt": shared + " w7"}], BeamSearchParams(beam_width=3, max_tokens=12))
    texts += [seq.text or "" for seq in beams[0].sequences]
    # Aborted mid-decode: its pages go back; a later request shares its prefix.
    core = llm.llm_engine
    core.add_request("gone", words(90, 75), greedy(40))
    core.add_request("stays", words(140, 50), greedy(20))
    for _ in range(6):
        core.step()
    core.abort_request(["gone"])
    done: dict[str, str] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    assert set(done) == {"stays"}
    texts.append(done["stays"])
    texts += [o.outputs[0].text for o in llm.generate([words(90, 75)], greedy(16), use_tqdm=False)]
    salted = [{"prompt": shared + " w8", "cache_salt": salt} for salt in ("a", "b", "a")]
    texts += [o.outputs[0].text for o in llm.generate(salted, greedy(16), use_tqdm=False)]
    return texts


def _run_requests(model: str, env: dict[str, str]) -> list[str]:
    with engine(model, env) as llm:
        return _request_features(llm)


@pytest.fixture(scope="module")
def requests_plain(tiny_model: str) -> list[str]:
    return _run_requests(tiny_model, {"VLLM_KVGUARD": "0", **INPROC})


@pytest.mark.parametrize("verify", ["sampled", "paranoid"])
def test_n_sampling_beam_search_aborts_and_cache_salt_raise_no_false_alarm(
    tiny_model: str, requests_plain: list[str], tmp_path: Path, verify: str
) -> None:
    log = tmp_path / "guard.jsonl"
    texts = _run_requests(tiny_model, guard_env("quarantine", log, **INPROC, VLLM_KVGUARD_VERIFY=verify))
    lines = read_log(log)
    assert _findings(lines) == []
    assert texts == requests_plain
    assert len(texts) == 6 + 3 + 2 + 3


# ------------------------------------------------------------- engine-level features
# Each configuration runs its workload with the guard off, then in the default and paranoid
# modes: the same text, request by request, and no finding.


def _lora_adapter(path: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter on q_proj and v_proj of the tiny Llama (random, large enough to
    change its text), in PEFT's format."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    hidden, rank, kv_out = 256, 8, 128  # tinymodel: 4 heads of 64, 2 KV heads
    tensors = {}
    for layer in range(2):
        for proj, out in (("q_proj", hidden), ("v_proj", kv_out)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": ["q_proj", "v_proj"],
                "base_model_name_or_path": "tiny",
            }
        )
    )
    return path


def _prefix_prompts() -> list[str]:
    from tests.engine.harness import words

    shared = words(45, 64)  # two full pages every prompt shares
    return [f"{shared} {words(100 + 9 * i, 12 + i)}" for i in range(6)]


def _preemption(llm: Any, _work: Path) -> list[str]:
    from tests.engine.harness import preemptions, words

    prompts = [words(20 + 13 * i, 100) for i in range(8)]
    outs = llm.generate(prompts, greedy(48, ignore_eos=True), use_tqdm=False)
    assert preemptions(llm) > 0  # 8 requests of 5 pages in a pool of 20
    return [o.outputs[0].text for o in outs]


def _ngram(llm: Any, _work: Path) -> list[str]:
    from tests.engine.harness import metric

    # Repeating patterns: the n-gram proposer finds drafts in the prompt.
    prompts = [" ".join(f"w{(i % (5 + j)) + 10 * j}" for i in range(90)) for j in range(4)]
    outs = llm.generate(prompts + prompts[:2], greedy(32, ignore_eos=True), use_tqdm=False)
    assert metric(llm, "vllm:spec_decode_num_draft_tokens") > 0
    return [o.outputs[0].text for o in outs]


def _fp8(llm: Any, _work: Path) -> list[str]:
    assert llm.llm_engine.vllm_config.cache_config.cache_dtype.startswith("fp8")
    prompts = _prefix_prompts()
    outs = llm.generate(prompts + prompts, greedy(24), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _lora(llm: Any, work: Path) -> list[str]:
    from vllm.lora.request import LoRARequest

    a = LoRARequest("a", 1, str(_lora_adapter(work / "lora-a", 1)))
    b = LoRARequest("b", 2, str(_lora_adapter(work / "lora-b", 2)))
    prompts = _prefix_prompts()[:3]
    texts = []
    for adapter in (a, b, None, a):  # the same prompts under each adapter, then again
        outs = llm.generate(prompts, greedy(16), lora_request=adapter, use_tqdm=False)
        texts += [o.outputs[0].text for o in outs]
    # The adapters change the text: the pages of one must never serve another.
    assert texts[0:3] != texts[3:6] and texts[0:3] != texts[6:9] and texts[0:3] == texts[9:12]
    return texts


FEATURES: dict[str, tuple[dict[str, Any], Any]] = {
    "prefix caching off, preemption": ({"enable_prefix_caching": False}, _preemption),
    "n-gram speculative decoding": (
        {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 3,
                "prompt_lookup_min": 2,
            },
            "num_gpu_blocks_override": 64,
            "max_num_batched_tokens": 512,
        },
        _ngram,
    ),
    "fp8 KV cache": ({"kv_cache_dtype": "fp8", "num_gpu_blocks_override": 64}, _fp8),
    "LoRA adapters": (
        {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "num_gpu_blocks_override": 64},
        _lora,
    ),
}


def _run_feature(model: str, env: dict[str, str], feature: str, work: Path) -> list[str]:
    overrides, workload = FEATURES[feature]
    with engine(model, env, **overrides) as llm:
        return workload(llm, work)


def _fp8_kv_on_this_host() -> bool:
    """vLLM's CPU attention has an fp8 KV path only with AVX-512 or AMX (cpu_attn.py)."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("feature", list(FEATURES))
def test_engine_features_raise_no_false_alarm(tiny_model: str, tmp_path: Path, feature: str) -> None:
    if feature == "fp8 KV cache" and not _fp8_kv_on_this_host():
        # An AVX2-only host (no AVX-512, no AMX): vLLM refuses an fp8 KV cache at start, with the
        # guard off as with it on; the guard neither hides nor changes that refusal.
        for env in ({"VLLM_KVGUARD": "0", **INPROC}, guard_env("quarantine", tmp_path / "g.jsonl", **INPROC)):
            with pytest.raises(
                NotImplementedError, match="FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
            ):
                _run_feature(tiny_model, env, feature, tmp_path)
        return
    plain = _run_feature(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, feature, tmp_path)
    for verify in ("sampled", "paranoid"):
        log = tmp_path / f"guard-{verify}.jsonl"
        env = guard_env("quarantine", log, **INPROC, VLLM_KVGUARD_VERIFY=verify)
        texts = _run_feature(tiny_model, env, feature, tmp_path)
        lines = read_log(log)
        assert _findings(lines) == [], verify
        assert texts == plain, verify
        assert any(line["event"] == "kvguard_started" for line in lines)
