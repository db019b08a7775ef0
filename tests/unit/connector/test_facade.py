"""The facade's own logic: what it does before handing a vLLM hook to a role."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_kvguard.connector.facade import KVGuardConnector


class _Worker:
    """The worker as the facade sees it: reads and loads left to verify, the hook's time and
    errors."""

    def __init__(self) -> None:
        self.reads_left: set[int] = set()
        self.loads_left: set[int] = set()
        self.hook_seconds = 0.0
        self.calls: list[str] = []
        self.errors: list[str] = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(layer_name)
        raise RuntimeError("injected guard bug")

    def internal_error(self, where: str, exc: Exception) -> None:
        self.errors.append(where)


def test_wait_for_layer_load_returns_at_once_with_no_read_left_and_names_its_hook_on_error() -> None:
    """Most steps verify no read in the attention layers (reuse; sampled between the steps its
    reads are batched on): the hook returns without its timing. Where reads are left, the
    worker runs under fail-open, and its error is logged under vLLM's hook name."""
    worker = _Worker()
    facade = SimpleNamespace(worker=worker, _side=worker)
    facade._wait_for_layer_load = lambda name: KVGuardConnector._wait_for_layer_load(facade, name)
    KVGuardConnector.wait_for_layer_load(facade, "model.layers.0.self_attn.attn")
    assert worker.calls == [] and worker.hook_seconds == 0.0
    worker.reads_left = {0}
    KVGuardConnector.wait_for_layer_load(facade, "model.layers.0.self_attn.attn")
    assert worker.calls == ["model.layers.0.self_attn.attn"]
    assert worker.errors == ["wait_for_layer_load"] and worker.hook_seconds > 0.0
    # Loaded pages left to check (another connector's load) go through the hook too.
    worker.reads_left, worker.calls = set(), []
    worker.loads_left = {0}
    KVGuardConnector.wait_for_layer_load(facade, "model.layers.0.self_attn.attn")
    assert worker.calls == ["model.layers.0.self_attn.attn"]
