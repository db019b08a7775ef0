"""How the plugin adds the guard to vLLM's KV transfer config (vLLM's own config class)."""

from typing import Any

import pytest
from vllm.config import KVTransferConfig

from vllm_kvguard.config import load_config
from vllm_kvguard.plugin import _needs_hybrid_manager, compose_kv_transfer_config


def _config(mode: str = "quarantine"):
    return load_config({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_MODE": mode})


@pytest.mark.parametrize(
    ("mode", "policy"), [("quarantine", "recompute"), ("raise", "fail"), ("log", "recompute")]
)
def test_no_user_connector(mode: str, policy: str) -> None:
    ktc = compose_kv_transfer_config(None, _config(mode))
    assert isinstance(ktc, KVTransferConfig)
    assert ktc.kv_connector == "KVGuardConnector"
    assert ktc.kv_connector_module_path == "vllm_kvguard.connector"
    assert ktc.kv_role == "kv_both" and ktc.kv_load_failure_policy == policy
    assert ktc.kv_connector_extra_config["kvguard"]["mode"] == mode


def test_composes_with_a_user_connector_through_multiconnector() -> None:
    user = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30},
    )
    ktc = compose_kv_transfer_config(user, _config())
    assert ktc.kv_connector == "MultiConnector"
    first, ours = ktc.kv_connector_extra_config["connectors"]
    assert first["kv_connector"] == "OffloadingConnector"
    assert first["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 30}
    assert ours["kv_connector"] == "KVGuardConnector"
    assert ktc.kv_load_failure_policy == "recompute"


@pytest.mark.parametrize("mode", ["quarantine", "raise", "log"])
def test_the_guards_child_entry_carries_the_policy_vllm_applies(mode: str) -> None:
    """vLLM builds a MultiConnector child's config from its entry alone (field default "fail"),
    and the guard's start-up line reads its own: the entry carries the top level's policy."""
    for user in (
        KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"),
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [{"kv_connector": "X", "kv_role": "kv_both"}]},
        },
    ):
        ktc = compose_kv_transfer_config(user, _config(mode))
        ours = ktc.kv_connector_extra_config["connectors"][-1]
        assert ours["kv_connector"] == "KVGuardConnector"
        # What the guard's child sees, built as vLLM's MultiConnector builds it.
        child = KVTransferConfig(**ours, engine_id=ktc.engine_id)
        assert child.kv_load_failure_policy == ktc.kv_load_failure_policy
        if mode != "log":  # log keeps the user's policy (a KVTransferConfig's default is "fail")
            assert ktc.kv_load_failure_policy == ("fail" if mode == "raise" else "recompute")


def test_appends_to_an_existing_multiconnector_once() -> None:
    user = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}]
        },
    }
    once = compose_kv_transfer_config(user, _config())
    twice = compose_kv_transfer_config(once, _config())
    names = [c["kv_connector"] for c in twice.kv_connector_extra_config["connectors"]]
    assert names == ["OffloadingConnector", "KVGuardConnector"]


def test_log_mode_keeps_the_users_policy() -> None:
    user = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_load_failure_policy="fail"
    )
    assert compose_kv_transfer_config(user, _config("log")).kv_load_failure_policy == "fail"


def test_hybrid_manager_engines_get_the_hma_form_of_the_guard() -> None:
    ktc = compose_kv_transfer_config(None, _config(), hma=True)
    assert ktc.kv_connector == "KVGuardHMAConnector"
    again = compose_kv_transfer_config(ktc, _config())
    assert again.kv_connector == "KVGuardConnector"  # not nested in a MultiConnector


class _Args:
    def __init__(self, disable: bool | None, hybrid: bool | None) -> None:
        self.disable_hybrid_kv_cache_manager = disable
        self.hybrid = hybrid

    def create_model_config(self):
        if self.hybrid is None:
            raise OSError("no such model")
        return type("ModelConfig", (), {"is_hybrid": self.hybrid})()


@pytest.mark.parametrize(
    ("disable", "hybrid", "needed"),
    [(False, False, True), (None, True, True), (None, False, False), (True, True, True), (None, None, False)],
)
def test_when_the_hybrid_manager_is_needed(disable: bool | None, hybrid: bool | None, needed: bool) -> None:
    assert _needs_hybrid_manager(_Args(disable, hybrid)) is needed


def _executor_cores(ktc: KVTransferConfig | None, *, patched: bool = True) -> Any:
    """vLLM's own CPU executor core manager, built for a one-worker engine with ``ktc``."""
    from types import SimpleNamespace

    from vllm.utils.ompmultiprocessing import OMPProcessManager

    from vllm_kvguard.connector import patches
    from vllm_kvguard.plugin import guard_alone

    assert patches.keep_cores_for_the_forward(guard_alone)
    init = OMPProcessManager.__init__
    assert getattr(init, "_kvguard", False)
    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None, _api_process_count=1)
    config = SimpleNamespace(parallel_config=parallel, kv_transfer_config=ktc)
    manager = OMPProcessManager.__new__(OMPProcessManager)
    (init if patched else init.__wrapped__)(manager, config)
    return manager


def test_the_guard_alone_keeps_the_cores_plain_vllm_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU executor keeps a core per worker from the forward's threads for the scheduler,
    and one more for any KV connector (a NIXL transfer's); the guard moves no KV, so alone it is
    kept out of that count, and beside a transfer connector it is not."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # vLLM's default (tests bind per worker)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    guard = compose_kv_transfer_config(None, _config())
    beside = compose_kv_transfer_config(
        KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"), _config()
    )
    assert _executor_cores(None).reserve_cpu_num == 1
    assert _executor_cores(guard).reserve_cpu_num == 1
    assert _executor_cores(beside).reserve_cpu_num == 2
    # The control: vLLM's own count, without the patch, keeps the second core for the guard.
    assert _executor_cores(guard, patched=False).reserve_cpu_num == 2
    # An operator's explicit setting still decides.
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert _executor_cores(guard).reserve_cpu_num == 0
