"""The guard beside another KV connector: no false alarm on the pages that connector loads.

vLLM's own ``ExampleConnector`` saves each prompt's KV to disk and loads it back when the
prompt comes again; the plugin puts the guard beside it in a ``MultiConnector``. vLLM tells
the guard ``num_external_tokens=0`` (the tokens were another child's), so pages the other
connector filled once looked like prefix-cache hits on whatever the guard had sealed in those
blocks before: identity mismatches and checksum failures on clean pages, and a clean request
ended with an error. Every run here compares the guard's texts with the same workload with
the guard off, request by request, and requires that the guard reported nothing at all.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import engine, greedy, guard_env, metric, read_log, words

pytestmark = pytest.mark.engine
INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
BLOCK = 32
# Three prompts of 4 full pages and 2 tokens (the connector stores whole pages), then three
# others that take the pool's free blocks (with prefix caching on, the first three's cached
# pages are evicted, so their second pass loads them from the connector instead).
PROMPTS = [words(17 + 40 * i, 4 * BLOCK + 2) for i in range(3)]
FILLER = [words(211 + 40 * i, 4 * BLOCK + 2, step=11) for i in range(3)]
# What the guard reports when it finds something (its own start and drill lines aside).
FINDINGS = {
    "kv_block_corrupted",
    "kv_block_nonfinite",
    "kv_block_identity_mismatch",
    "kv_block_write_lost",
    "kv_block_lifecycle_violation",
    "kv_block_quarantined",
    "kv_request_affected",
    "kvguard_internal_error",
    "kvguard_worker_internal_error",
}


def _connector(store: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }


def _workload(llm: Any) -> list[str]:
    """The prompts, the filler, the prompts again (their KV loaded by the connector)."""
    texts = []
    for batch in (PROMPTS, FILLER, PROMPTS):
        outs = llm.generate(batch, greedy(16), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        texts += [o.outputs[0].text for o in outs]
    return texts


def _run(model: str, env: dict[str, str], store: Path, prefix_caching: bool) -> tuple[list[str], float]:
    with engine(
        model,
        env,
        kv_transfer_config=_connector(store),
        enable_prefix_caching=prefix_caching,
        # Whole prompts in one step: the example connector saves a prompt's pages as it is computed.
        max_num_batched_tokens=1024,
        num_gpu_blocks_override=24,
    ) as llm:
        texts = _workload(llm)
        loaded = metric(llm, "vllm:kvguard_pages_loaded", verified="no")
    return texts, loaded


@pytest.fixture(scope="module")
def plain(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, list[str]]:
    """The workload with the guard off, beside the same connector: per prefix-caching setting."""
    out = {}
    for prefix_caching in (True, False):
        store = tmp_path_factory.mktemp("plain-store")
        out[prefix_caching], _ = _run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, store, prefix_caching)
    return out


@pytest.mark.parametrize(
    ("verify", "prefix_caching"),
    [("sampled", True), ("sampled", False), ("reuse", True), ("paranoid", True), ("paranoid", False)],
)
def test_pages_another_connector_loads_raise_no_false_alarm(
    tiny_model: str, tmp_path: Path, plain: dict[bool, list[str]], verify: str, prefix_caching: bool
) -> None:
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, **INPROC, VLLM_KVGUARD_VERIFY=verify, VLLM_KVGUARD_REPAIR="1")
    texts, loaded = _run(tiny_model, env, tmp_path / "store", prefix_caching)
    lines = read_log(log)
    assert [line["event"] for line in lines if line["event"] in FINDINGS] == []
    # Request by request, the same text as with the guard off.
    assert texts == plain[prefix_caching]
    # The second pass really loaded pages through the other connector: 4 full pages a prompt,
    # less those still in the local prefix cache.
    assert loaded >= (4 if prefix_caching else 12), loaded
    started = [line for line in lines if line["event"] == "kvguard_started" and line["role"] == "scheduler"]
    assert started and started[0]["config"]["verify"] == verify
