"""The device path (KVG64 kernel, seals on the device, results read with the step's
output) on a real vLLM engine, with Triton's interpreter standing in for the GPU.

Run by tests/engine/test_device_path.py in its own process with TRITON_INTERPRET=1
(Triton reads it when a kernel is built; see tests/unit/digest/kernel_cases.py).
``VLLM_KVGUARD_HASH=kvg64`` makes the guard take the kernel path for the CPU KV
cache: the same code a GPU worker runs, minus CUDA events and pinned copies.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import INPROC, engine, events, greedy, guard_env, record_invalid_blocks
from tests.engine.scenario import prompts_b, run_clean, seal_prefix_and_corrupt
from vllm_kvguard import testing

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (tests/engine/test_device_path.py does)")

pytestmark = pytest.mark.engine
# The interpreter runs a kernel thousands of times slower than a GPU: keep to seals and
# reuse verification (read-time verification and scrubbing share the same launch code).
KVG64 = {"VLLM_KVGUARD_HASH": "kvg64", "VLLM_KVGUARD_VERIFY": "reuse", "VLLM_KVGUARD_SCRUB_INTERVAL": "off"}


def _guard_type(llm: Any) -> dict[str, Any]:
    def probe(_worker: Any) -> dict[str, Any]:
        guard = testing._guard()
        return {"table": type(guard.table).__name__, "deferred": guard.pages.deferred}

    return llm.collective_rpc(probe)[0]


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[str]:
    with engine(tiny_model, {"VLLM_KVGUARD": "0"}) as llm:
        return run_clean(llm)[0]


HOOKS = {
    "bind_connector_metadata",
    "wait_for_layer_load",
    "finish_forward",
    "wait_for_save",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
}


@pytest.fixture
def first_reads(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """For each device check, the functions on the stack when its results were first read."""
    import inspect

    from vllm_kvguard.digest import PendingCheck

    seen: list[set[str]] = []
    original = PendingCheck._settle

    def spy(self: PendingCheck) -> Any:
        if not self.settled:
            seen.append({frame.function for frame in inspect.stack()[1:]})
        return original(self)

    monkeypatch.setattr(PendingCheck, "_settle", spy)
    return seen


@pytest.mark.parametrize("process", ["engine_process", "in_process"])
def test_device_path_is_clean_then_catches_and_heals_a_flip(
    tiny_model: str, tmp_path: Path, reference: list[str], process: str, first_reads: list[set[str]]
) -> None:
    """Multiprocess: checks settle when the worker's output is pickled; in process: in the
    scheduler's update_from_output. Either way the bad block reaches vLLM in the same step."""
    log = tmp_path / "guard.jsonl"
    extra = {**KVG64, **(INPROC if process == "in_process" else {})}
    with engine(tiny_model, guard_env("quarantine", log, **extra)) as llm:
        assert _guard_type(llm) == {"table": "DeviceDigestTable", "deferred": True}
        texts, _ = run_clean(llm)
        assert texts == reference
        assert events(log, "kv_block_corrupted") == []
        bad = seal_prefix_and_corrupt(llm)
        handled = record_invalid_blocks(llm) if process == "in_process" else None
        outs = llm.generate(prompts_b(), greedy(16), use_tqdm=False)
    if handled is not None:
        # The device check's finding reached vLLM's bad-block handling (recompute).
        assert handled == [{bad.block_id}], handled
        # No hook waited for a device result: every check was first read back by the
        # update_from_output patch (before_output), after the step's output was complete.
        assert len(first_reads) > 20
        assert all("before_output" in stack and not stack & HOOKS for stack in first_reads)
    (started,) = [e for e in events(log, "kvguard_started") if e.get("role") == "worker"]
    assert started["details"]["digest"] == "kvg64" and started["details"]["deferred"] is True
    assert [o.outputs[0].text for o in outs] == bad.clean
    (line,) = events(log, "kv_block_corrupted")
    assert line["block_id"] == bad.block_id and line["layers"] == [bad.layers[0]]
    assert line["trigger"] == "reuse" and line["action"] == "quarantined_and_recomputed"
    assert line["expected_digest"] != line["actual_digest"]
    assert {a["outcome"] for a in events(log, "kv_request_affected")} == {"healed"}
    # Found after the forward, so diagnosed by the worker before the next one (never repaired:
    # the step read it, vLLM recomputes): the device-side syndrome locates the flipped bit.
    assert line["shape"] == "undiagnosed"
    (diagnosed,) = events(log, "kv_block_diagnosed")
    assert diagnosed["block_id"] == bad.block_id and diagnosed["shape"] == "single_bit"
    assert diagnosed["where"]["word"] == 0 and diagnosed["where"]["bits"] == [14]  # byte 1, bit 6


def test_nan_at_seal_is_flagged_by_the_kernel_and_recomputed(tiny_model: str, tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    prompt = " ".join(f"w{(17 + i * 7) % 400}" for i in range(128)) + " w300 w301"
    with engine(tiny_model, guard_env("quarantine", log, **KVG64, **INPROC)) as llm:
        reference = llm.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0].text
    spec = "nan:at=write,layer=1,seed=3"
    env = guard_env("quarantine", log, VLLM_KVGUARD_INJECT=spec, **KVG64, **INPROC)
    with engine(tiny_model, env) as llm:
        out = llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    (injected,) = events(log, "kv_fault_injected")
    (line,) = events(log, "kv_block_nonfinite")
    assert line["block_id"] == injected["block_id"] and line["layers"][0].startswith("model.layers.1.")
    assert line["action"] == "recomputed"
    assert events(log, "kv_block_corrupted") == []
    assert [o["outcome"] for o in events(log, "kv_fault_outcome")] == ["detected"]
    assert out.outputs[0].text == reference


def test_paranoid_read_verification_on_the_device_catches_a_mid_decode_flip(
    tiny_model: str, tmp_path: Path
) -> None:
    """Per-layer launches in the attention hook (a subset of the table's columns), settled with
    the same step's output: caught in the first step after the flip, text unchanged."""
    from tests.engine.test_read_verify import _run_with_mid_decode_flip

    log = tmp_path / "guard.jsonl"
    extra = {**KVG64, **INPROC, "VLLM_KVGUARD_VERIFY": "paranoid"}
    with engine(tiny_model, guard_env("quarantine", log, **extra), num_gpu_blocks_override=64) as llm:
        handled = record_invalid_blocks(llm)
        reference, text, detected_at, lines, block = _run_with_mid_decode_flip(llm, log)
    (line,) = lines
    assert handled == [{block}], handled  # vLLM recomputed the owner from the bad block
    assert line["block_id"] == block and line["trigger"] == "paranoid"
    assert line["layer"].startswith("model.layers.1.") and line["layers"] == [line["layer"]]
    assert detected_at == 1
    assert line["action"] == "quarantined_and_recomputed"
    assert text == reference


def test_scrub_pages_share_the_hits_launch_and_keep_their_trigger(tiny_model: str, tmp_path: Path) -> None:
    from tests.engine.test_coverage import PROMPT, _greedy, _sealed_by, _text

    log = tmp_path / "guard.jsonl"
    extra = {**KVG64, **INPROC, "VLLM_KVGUARD_SCRUB_INTERVAL": "0.5s", "VLLM_KVGUARD_SCRUB_BUDGET": "32KiB"}
    with engine(tiny_model, guard_env("quarantine", log, **extra), num_gpu_blocks_override=64) as llm:
        blocks = _sealed_by(llm, PROMPT)
        reference = _text(llm, PROMPT, 16)
        llm.collective_rpc(testing.flip_bit, args=(blocks[1], 0, 5, 3))
        core = llm.llm_engine
        # Traffic for the scrubber to work in, until the page is caught (bounded in time). The
        # scrubber earns its pages from wall-clock time (pages x elapsed / interval), so how many
        # steps that takes depends on how fast steps run: one request was not always enough (it
        # ends at its EOS after ~190 fast steps), so another starts whenever none is left.
        other = " ".join(f"w{i}" for i in range(3, 43))  # shares no page with PROMPT
        deadline = time.monotonic() + 300
        started: list[str] = []
        while not events(log, "kv_block_corrupted") and time.monotonic() < deadline:
            if not core.has_unfinished_requests():
                started.append(f"other-{len(started)}")
                core.add_request(started[-1], other, _greedy(400))
            core.step()
        (line,) = events(log, "kv_block_corrupted")
        assert line["trigger"] == "scrub" and line["block_id"] == blocks[1] and line["request_ids"] == []
        core.abort_request(started)
        while core.has_unfinished_requests():
            core.step()
        assert _text(llm, PROMPT, 16) == reference
        assert len(events(log, "kv_block_corrupted")) == 1


@pytest.fixture
def rows_on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU worker's row digests (DeviceRowDigests: kept, compared and read back like the
    device seals) on this CPU engine: the same rows, gathered through the CPU layout's element
    map, with the host's compiled path and the written-rows shortcut off. In-process engines only."""
    from vllm_kvguard.connector import patches
    from vllm_kvguard.connector.worker import KVGuardWorker
    from vllm_kvguard.digest.device_rows import DeviceRowDigests

    original = KVGuardWorker._row_digests

    def forced(self: KVGuardWorker, kv_caches: dict[str, Any], first: Any) -> str:
        how = original(self, kv_caches, first)
        assert self.rows is not None and self.pages is not None and self.pages.deferred, how
        self.rows = DeviceRowDigests(
            self.pages.tensors, self.rows.gathers, self.pages.num_blocks, self.block_size
        )
        self.written = None
        patches.observe_cpu_kv_writes(None)
        return f"{how}; kept on the device (test)"

    monkeypatch.setattr(KVGuardWorker, "_row_digests", forced)


@pytest.mark.parametrize("mode", ["quarantine", "log"])
def test_rows_on_the_device_catch_an_unfilled_page_changed_before_its_seal(
    tiny_model: str, tmp_path: Path, mode: str, rows_on_device: None, first_reads: list[set[str]]
) -> None:
    """tests/engine/test_unfilled.py's laundering workload (control there: the fault changes
    V's and W's text) with the row digests on the device. The seal-time check is read with the
    step's output, not before the seal: the page is sealed, its seal voided on the device, and
    the finding reaches vLLM in the same step as on the host path."""
    from tests.engine.harness import affected_once, honest
    from tests.engine.test_unfilled import WRITTEN, _laundering
    from vllm_kvguard import KVCacheCorruptionError

    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env(mode, log, **KVG64, **INPROC)) as llm:
        r = _laundering(llm)
    (started,) = [e for e in events(log, "kvguard_started") if e.get("role") == "worker"]
    assert started["details"]["row_digests"].endswith("kept on the device (test)")
    found = [e for e in events(log, "kv_block_corrupted") if e["block_id"] == r["block"]]
    assert found, "the corrupted unfilled page is reported"
    first = found[0]
    assert first["shape"] == "unfilled_rows" and first["where"]["slots"] == list(range(WRITTEN))
    assert first["trigger"] == "seal" and first["layer"] == "all"
    assert honest(r["v"], r["clean_v"]) and honest(r["w"], r["clean_w"])
    outcomes = affected_once(log)
    # No hook waited for a device result (row checks included).
    assert first_reads and all("before_output" in stack and not stack & HOOKS for stack in first_reads)
    if mode == "quarantine":
        assert outcomes["v"] == "failed" and first["action"] in ("recomputed", "requests_failed")
        assert r["w"].outputs[0].text == r["clean_w"] and set(outcomes) == {"v"}
    else:
        # Kept in the prefix cache (log mode changes nothing): W's hit on it is flagged.
        assert outcomes["v"] == "suspect" and r["w_hits"] >= 4 * 32
        assert [o for rid, o in outcomes.items() if rid != "v"] == ["suspect"]
        assert str(r["w"].outputs[0].stop_reason).startswith(KVCacheCorruptionError.PREFIX)


def test_rows_on_the_device_find_a_write_that_never_landed(
    tiny_model: str, tmp_path: Path, rows_on_device: None
) -> None:
    """tests/engine/test_unfilled.py's lost-write workload (control there) with the row digests
    on the device: the lost-write compare is read with the step's output; recomputed, clean."""
    from tests.engine.harness import affected_once
    from tests.engine.test_unfilled import LOST, _lost_write

    log = tmp_path / "guard.jsonl"
    with engine(tiny_model, guard_env("quarantine", log, **KVG64, **INPROC), **LOST) as llm:
        r = _lost_write(llm)
    assert r["dropped"] > 0
    found = events(log, "kv_block_write_lost")
    assert found and all(line["request_ids"][0].startswith("second") and line["slots"] for line in found)
    assert found[0]["action"] == "recomputed"
    assert r["out"].outputs[0].text == r["clean"] and affected_once(log) == {"second": "healed"}


def test_rows_on_the_device_verified_by_paranoid_reads_heal_the_writer(
    tiny_model: str, tmp_path: Path, rows_on_device: None, first_reads: list[set[str]]
) -> None:
    """Paranoid read verification covers a running request's unfilled page by its rows (at the
    first attention layer, on the device, read with the step's output): caught in the first step
    after the change, before the page is sealed, V recomputed: its clean text, healed."""
    from tests.engine.harness import affected_once
    from tests.engine.test_unfilled import WRITTEN, _laundering

    log = tmp_path / "guard.jsonl"
    extra = {**KVG64, **INPROC, "VLLM_KVGUARD_VERIFY": "paranoid"}
    with engine(tiny_model, guard_env("quarantine", log, **extra)) as llm:
        r = _laundering(llm)
    found = [e for e in events(log, "kv_block_corrupted") if e["block_id"] == r["block"]]
    assert found, "the corrupted unfilled page is reported"
    first = found[0]
    assert first["shape"] == "unfilled_rows" and first["where"]["slots"] == list(range(WRITTEN))
    assert first["trigger"] == "paranoid" and first["step"] == r["corrupted_after"] + 1
    assert first_reads and all("before_output" in stack and not stack & HOOKS for stack in first_reads)
    assert r["v"].outputs[0].text == r["clean_v"] and affected_once(log)["v"] == "healed"
    assert r["w"].outputs[0].text == r["clean_w"]


# ------------------------------------------------------------- pages another connector loads
# tests/engine/test_connectors.py's workloads (vLLM's ExampleConnector beside the guard) with the
# seals on the device: the digests sealed there reach the load store through one copy per
# sealing step, and a step's loaded pages are hashed in one launch after the forward and read
# back with its output (connector/loaded.py).


def test_loads_beside_a_connector_are_checked_on_the_device_without_a_false_alarm(
    tiny_model: str, tmp_path: Path
) -> None:
    from tests.engine.harness import FINDINGS, metric, read_log
    from tests.engine.test_connectors import _connector_engine, _workload

    with _connector_engine(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path / "plain") as llm:
        plain = _workload(llm)
    log = tmp_path / "guard.jsonl"
    with _connector_engine(
        tiny_model, guard_env("quarantine", log, **KVG64, **INPROC), tmp_path / "s"
    ) as llm:
        assert _guard_type(llm)["table"] == "DeviceDigestTable"
        texts = _workload(llm)
        checked = metric(llm, "vllm:kvguard_pages_loaded", verified="exact")
        unchecked = metric(llm, "vllm:kvguard_pages_loaded", verified="no")
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert texts == plain
    # Every page of the second pass's prompts (4 full pages each, prefix caching off) was
    # loaded by the example connector and checked against the digests sealed on the device.
    assert checked >= 12 and unchecked == 0, (checked, unchecked)


def test_a_load_of_an_earlier_computation_is_no_false_alarm_on_the_device(
    tiny_model: str, tmp_path: Path
) -> None:
    """tests/engine/test_connectors.py's batch-variant workload (A's pages computed alone, again
    inside B with other bytes, then A's first copy loaded) with the seals and the load check on
    the device: every digest set reaches the store, and the load matches the first one."""
    from tests.engine.harness import FINDINGS, read_log
    from tests.engine.test_connectors import _variant_run

    plain, _, _ = _variant_run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path / "plain")
    log = tmp_path / "guard.jsonl"
    outs, loaded, sets = _variant_run(tiny_model, guard_env("raise", log, **KVG64, **INPROC), tmp_path / "s")
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert [o.text for o in outs] == [o.text for o in plain]
    assert loaded == {"exact": 4, "approx": 0, "bad": 0, "no": 0} and sorted(sets.values()).count(2) >= 4, (
        loaded,
        sets,
    )


@pytest.mark.parametrize("mode", ["quarantine", "raise"])
def test_a_load_restored_reversed_is_caught_on_the_device_in_the_same_step(
    tiny_model: str, tmp_path: Path, mode: str, first_reads: list[set[str]]
) -> None:
    from types import SimpleNamespace

    from tests.engine.harness import affected_once, honest
    from tests.engine.test_connectors import PROMPTS, _bad_load_run

    # Control: with the guard off the reversed restore changes the text.
    first_off, second_off, _, _ = _bad_load_run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path / "off")
    assert [c.text for c in second_off] != first_off
    log = tmp_path / "guard.jsonl"
    env = guard_env(mode, log, **KVG64, **INPROC)
    first, second, checked, _ = _bad_load_run(tiny_model, env, tmp_path / "store")
    assert first == first_off and checked >= 4 * len(PROMPTS)
    found = events(log, "kv_block_corrupted")
    assert found and {line["trigger"] for line in found} == {"external_load"}
    assert {line["connector"] for line in found} == {"ExampleConnector"}
    assert {line["device"] for line in found} == {"cpu"}
    assert not events(log, "kv_block_quarantined")
    # Each bad load's shape follows at the worker's next step, as for the device path's other
    # findings (in raise mode the failed requests leave no next step): a reversed page is none
    # of the shapes a load can be told by (no syndrome is kept for it).
    diagnosed = events(log, "kv_block_diagnosed")
    if mode == "quarantine":
        assert {line["block_id"] for line in diagnosed} == {line["block_id"] for line in found}
    assert all(line["shape"] == "undiagnosed" and "no syndrome" in line["where"]["why"] for line in diagnosed)
    # The load checks were read back with the step's output, never by a hook of their step.
    assert first_reads and all("before_output" in stack for stack in first_reads)
    outcomes = affected_once(log)
    assert set(outcomes.values()) == {"healed" if mode == "quarantine" else "failed"}
    assert len(outcomes) == len(PROMPTS)
    for out, clean in zip(second, first, strict=True):
        assert honest(SimpleNamespace(outputs=[out]), clean)
        if mode == "quarantine":
            assert out.text == clean and out.finish_reason == "length"
        else:
            assert out.finish_reason == "error"


# ------------------------------------------------------------- the finish check
# tests/engine/test_finish.py's workload (a shared prefix page scrambled three tokens before one
# reader's end; the guard-off control there changes its text) with the seals on the device: the
# pages of the request ending at its length are verified in the launch before its last step's
# forward; those of the one ending on a stop token or a stop string, held, in the next step's;
# each read back with that step's output.


@pytest.mark.parametrize("ends", ["length", "stop", "string"])
def test_the_finish_check_on_the_device_fails_the_request_that_ended(
    tiny_model: str, tmp_path: Path, ends: str
) -> None:
    from tests.engine.harness import affected_once, honest, metric
    from tests.engine.test_finish import PROMPTS, SAMPLED, _run, stop_at_processor

    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log, **{**KVG64, **SAMPLED, "VLLM_KVGUARD_VERIFY": "sampled"}, **INPROC)
    with engine(tiny_model, env, num_gpu_blocks_override=64, logits_processors=[stop_at_processor()]) as llm:
        assert _guard_type(llm)["table"] == "DeviceDigestTable"
        r = _run(llm, guarded=True, ends=ends)
        held = metric(llm, "vllm:kvguard_requests_held")
    assert (held >= 1) == (ends != "length")
    found = events(log, "kv_block_corrupted")
    assert found and found[0]["block_id"] in r["blocks"] and found[0]["trigger"] == "finish"
    assert affected_once(log)["ending"] == "failed"
    assert r["finals"]["ending"].outputs[0].finish_reason == "error"
    for name in PROMPTS:
        assert honest(r["finals"][name], r["clean"][name]), name


def test_loads_without_an_exact_digest_are_verified_and_caught_by_their_sketch_on_the_device(
    tiny_model: str, tmp_path: Path
) -> None:
    """tests/engine/test_connectors.py's shared store (another engine computed A alone and the
    connector kept that copy; this one computed A's pages only inside B) with the seals, the
    sketches and the load check on the device: the clean copy verified by its sketch, the same
    copy restored reversed caught by it, with the guard-off control."""
    from tests.engine.harness import FINDINGS, affected_once, read_log
    from tests.engine.test_connectors import _shared_store_run

    plain, _ = _shared_store_run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path / "plain")
    log = tmp_path / "clean.jsonl"
    outs, loaded = _shared_store_run(tiny_model, guard_env("raise", log, **KVG64, **INPROC), tmp_path / "s")
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert [o.text for o in outs] == [o.text for o in plain]
    assert loaded == {"exact": 0, "approx": 4, "bad": 0, "no": 0}, loaded
    control, _ = _shared_store_run(
        tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, tmp_path / "control", reverse=True
    )
    assert control[2].text != plain[2].text
    log = tmp_path / "bad.jsonl"
    outs, loaded = _shared_store_run(
        tiny_model, guard_env("quarantine", log, **KVG64, **INPROC), tmp_path / "b", reverse=True
    )
    assert loaded == {"exact": 0, "approx": 0, "bad": 4, "no": 0}, loaded
    assert len(events(log, "kv_block_corrupted")) == 4
    assert set(affected_once(log).values()) == {"healed"}
    assert outs[2].text == plain[0].text  # recomputed alone, as the other engine computed A


def test_loads_nobody_here_can_check_are_audited_on_the_device_without_a_false_alarm(
    tiny_model: str, tmp_path: Path
) -> None:
    """tests/engine/test_connectors.py's audit case (a consumer without the producer's digests,
    every load audited) with seals and sketches on the device, in raise mode: each audited page
    refused, computed again, compared: all match, no request fails."""
    from tests.engine.harness import FINDINGS, read_log
    from tests.engine.test_connectors import PROMPTS, _audit_run, _role_run

    store = tmp_path / "store"
    _role_run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, store, "kv_producer")
    plain, _ = _audit_run(tiny_model, {"VLLM_KVGUARD": "0", **INPROC}, store)
    log = tmp_path / "guard.jsonl"
    outs, counts = _audit_run(
        tiny_model, guard_env("raise", log, **KVG64, **INPROC, VLLM_KVGUARD_LOAD_AUDIT="1"), store
    )
    assert [line["event"] for line in read_log(log) if line["event"] in FINDINGS] == []
    assert [o.text for o in outs] == [o.text for o in plain]
    assert counts["audit_match"] == 4 * len(PROMPTS) and counts["audit_mismatch"] == 0
