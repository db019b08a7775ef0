"""The guard under async scheduling, vLLM's default on GPUs (vLLM's CPU platform turns it off, so
these tests turn it back on; the CPU model runner is the GPU one and runs it).

With async scheduling, step N+1 is scheduled before step N's output comes back: a request that
hits a page in step N+1 already holds it, in the computed part of its block table, when a
finding about that page in step N is handled. Its hit is verified before the forward that reads
it, so it read nothing unverified: it is healed (quarantine) or flagged (log), never failed as if
it had emitted tokens from the bad page. Log mode is the control: the same fault changes both
requests' text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import affected_once, engine, events, greedy, guard_env, honest, run_to_end
from tests.engine.scenario import PREFIX, seal_prefix_and_corrupt

pytestmark = pytest.mark.engine


@pytest.fixture
def async_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keep ``async_scheduling=True`` where vLLM's CPU platform would switch it off."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_async(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        if wanted:
            vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(keep_async))
    yield


def _hit_one_step_apart(llm: Any) -> tuple[dict[str, Any], list[str]]:
    """Corrupt a cached prefix page; B hits it in one step, C in the next."""
    core = llm.llm_engine
    assert core.vllm_config.scheduler_config.async_scheduling
    assert core.engine_core.engine_core.batch_queue_size == 2  # the next step runs ahead
    corruption = seal_prefix_and_corrupt(llm)
    core.add_request("B", f"{PREFIX} w401 w402", greedy(16))
    core.step()
    core.add_request("C", f"{PREFIX} w403 w404 w405", greedy(16))
    return run_to_end(core), corruption.clean


def test_a_hit_in_the_step_scheduled_ahead_is_healed_not_failed(
    tiny_model: str, tmp_path: Path, async_on_cpu: None
) -> None:
    # Repair on (the default): the one-bit fault is mended in place before B's forward. (With
    # repair off, vLLM's own recompute of the invalid block crashes the CPU model runner under
    # async scheduling, with or without this fix: docs/design/outcomes.md, "Async scheduling".)
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, VLLM_KVGUARD_REPAIR="1")
    with engine(tiny_model, env, num_gpu_blocks_override=40, async_scheduling=True) as llm:
        outs, clean = _hit_one_step_apart(llm)
    (found,) = events(log, "kv_block_corrupted")
    assert found["action"] == "repaired"
    assert {r.rsplit("-", 1)[0] for r in found["request_ids"]} == {"B", "C"}
    # Both read the page only after it was verified: the clean text, no error, both healed.
    assert outs["B"].outputs[0].text == clean[0] and outs["C"].outputs[0].text == clean[1]
    assert all(o.outputs[0].finish_reason != "error" for o in outs.values())
    assert affected_once(log) == {"B": "healed", "C": "healed"}


def test_control_log_mode_the_fault_changes_both_texts(
    tiny_model: str, tmp_path: Path, async_on_cpu: None
) -> None:
    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("log", log), num_gpu_blocks_override=40, async_scheduling=True) as llm:
        outs, clean = _hit_one_step_apart(llm)
    assert outs["B"].outputs[0].text != clean[0] and outs["C"].outputs[0].text != clean[1]
    assert all(honest(outs[k], c) for k, c in zip("BC", clean, strict=True))
    assert affected_once(log) == {"B": "suspect", "C": "suspect"}
