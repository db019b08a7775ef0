"""The guard's KV connector as vLLM loads it: a thin facade over one role.

vLLM builds one connector in the engine core (role SCHEDULER) and one in each worker
(role WORKER). Like vLLM's own NIXL connector, :class:`KVGuardConnector` only
delegates: scheduler hooks to :class:`~.scheduler.KVGuardScheduler`, worker hooks to
:class:`~.worker.KVGuardWorker` (exactly one of ``scheduler`` / ``worker`` is set).
Every hook runs fail-open (:func:`fail_open`): a bug in the guard is logged and
counted, never takes serving down. docs/design.md lists where each hook lands.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from vllm_kvguard.config import BESIDE_KEY, KVGuardConfig, load_config
from vllm_kvguard.connector import patches
from vllm_kvguard.connector.metadata import KVGuardMetadata, KVGuardWorkerMetadata
from vllm_kvguard.connector.scheduler import KVGuardScheduler
from vllm_kvguard.connector.stats import KVGuardPromMetrics, KVGuardStats
from vllm_kvguard.connector.stop_strings import StopStrings
from vllm_kvguard.connector.weights import weights_identity
from vllm_kvguard.connector.worker import KVGuardWorker
from vllm_kvguard.logs import GuardLog

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

CONFIG_KEY = "kvguard"
T = TypeVar("T")


class _Side(Protocol):
    hook_seconds: float

    def internal_error(self, where: str, exc: Exception) -> None: ...


def _no_external_match(_connector: Any) -> tuple[int | None, bool]:
    return 0, False


def fail_open(
    default: Callable[[Any], T], hook_name: str | None = None
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a hook so that a bug in the guard never takes serving down.

    The role counts and logs the error (the 1st, 2nd, 4th, 8th... occurrence with its
    traceback); the hook returns a neutral value (``default(self)``), which leaves the
    step unguarded: pages not sealed this step are not verified later (the worker only
    verifies what it sealed). See docs/design.md, "Internal errors". The time spent in
    the hook is the guard's own cost (``vllm:kvguard_overhead_seconds``). ``hook_name``: the
    vLLM hook the error is logged under, where ``fn`` is named otherwise.
    """

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        where = hook_name or fn.__name__

        @functools.wraps(fn)
        def hook(self: KVGuardConnector, *args: Any, **kwargs: Any) -> T:
            side = self._side
            start = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                side.internal_error(where, exc)
                return default(self)
            finally:
                side.hook_seconds += time.perf_counter() - start

        return hook

    return wrap


def _nothing_to_send(_connector: Any) -> tuple[bool, dict[str, Any] | None]:
    # request_finished's neutral answer: free the blocks now, no KV handed off.
    return False, None


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def find_guard(connector: object) -> KVGuardConnector | None:
    """The guard inside ``connector`` (itself, or a child of a MultiConnector)."""
    if isinstance(connector, KVGuardConnector):
        return connector
    children = getattr(connector, "sub_connectors", None) or getattr(connector, "_connectors", None) or ()
    for child in children:
        if isinstance(child, KVGuardConnector):
            return child
    return None


class KVGuardConnector(KVConnectorBase_V1):
    """Checksums every full KV page; verifies it before a request reads it."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        # The front end validated the environment and shipped the result; a
        # connector configured by hand (no plugin) reads the environment itself.
        self.config: KVGuardConfig = (
            KVGuardConfig.from_dict(extra[CONFIG_KEY]) if CONFIG_KEY in extra else load_config()
        )
        model = getattr(vllm_config.model_config, "served_model_name", None) or getattr(
            vllm_config.model_config, "model", "?"
        )
        if isinstance(model, list):
            model = model[0]
        is_scheduler = role == KVConnectorRole.SCHEDULER
        rank = 0 if is_scheduler else _rank()
        log = GuardLog(
            self.config,
            role="scheduler" if is_scheduler else "worker",
            rank=rank,
            # vLLM's metrics label engines by index; the id ties lines to vLLM's own logs.
            engine=str(vllm_config.parallel_config.data_parallel_rank or 0),
            engine_id=str(self._kv_transfer_config.engine_id),
            model_name=str(model),
        )
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        # vLLM maps reported bad blocks back to requests only with one KV cache group.
        self.active = groups == 1
        num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        # What computes the KV: page fingerprints and the digest folder's namespace carry it.
        weights, weights_found = weights_identity(vllm_config)
        self.scheduler: KVGuardScheduler | None = None
        self.worker: KVGuardWorker | None = None
        if is_scheduler:
            bytes_per_block = (
                sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(1, num_blocks)
                if kv_cache_config is not None
                else 0
            )
            self.scheduler = KVGuardScheduler(
                self.config,
                log,
                num_blocks=num_blocks,
                block_size=vllm_config.cache_config.block_size,
                bytes_per_block=bytes_per_block,
                num_layers=max(1, vllm_config.model_config.get_num_layers(vllm_config.parallel_config)),
                model_name=str(model),
                details={
                    "kv_load_failure_policy": self._kv_transfer_config.kv_load_failure_policy,
                    "active": self.active,
                    "kv_cache_groups": groups,
                    "weights": f"{weights:016x} ({weights_found})",
                },
                beside=[str(name) for name in extra.get(BESIDE_KEY, ())],
                weights=weights,
            )
            if not patches.patch_scheduler(find_guard):
                self.scheduler.finish = None  # nothing could hold or put back a final output
            if self.scheduler.finish is not None and patches.stop_strings_checkable():
                # Requests that end on a stop string end in the engine, held like EOS ends.
                self.scheduler.stop_strings = StopStrings(vllm_config.model_config, log)
            if self.scheduler.finish is not None:
                # Requests that end at their length are checked in their last step (no hold).
                self.scheduler.finish.max_model_len = int(vllm_config.model_config.max_model_len or 0)
                spec = getattr(vllm_config, "speculative_config", None)
                self.scheduler.finish.spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0)
            if not self.active:
                log.line(
                    "kvguard_inactive",
                    level="warning",
                    reason=(
                        f"the model has {groups} KV cache groups (hybrid model); vLLM can only "
                        "recompute single blocks with one group, so the guard does not run"
                    ),
                )
            self._side: _Side = self.scheduler
        else:
            self.worker = KVGuardWorker(
                self.config,
                num_blocks,
                rank,
                log,
                block_size=vllm_config.cache_config.block_size,
                weights=weights,
            )
            self._side = self.worker

    # ------------------------------------------------------------------ worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        if self.active and kv_caches:
            self.worker.register_kv_caches(kv_caches)

    @fail_open(lambda self: None)
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self.worker is not None
        meta = connector_metadata if isinstance(connector_metadata, KVGuardMetadata) else None
        self.worker.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        assert self.worker is not None
        self.worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Called before every attention layer; most steps have no read to verify there
        # (reuse, and sampled between the steps its reads are batched on): return at once,
        # without the hook's timing and error handling (one attribute test).
        worker = self.worker
        if worker is not None and (worker.reads_left or worker.loads_left):
            self._wait_for_layer_load(layer_name)

    @fail_open(lambda self: None, "wait_for_layer_load")
    def _wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    @property
    def requires_kv_delivery(self) -> bool:
        # The guard hands no KV off: vLLM must not drop a preempted request's in-flight
        # output on its account (kv_role kv_both would otherwise make it a producer).
        return False

    @fail_open(lambda self: None)
    def finish_forward(self) -> None:
        # The model no longer reads this step's KV (called by the GPU model runner right
        # after the forward, before the step's connector output is collected).
        assert self.worker is not None
        self.worker.finish_forward()

    @fail_open(lambda self: None)
    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose blocks the finish check kept: done once this step verified
        their pages (connector/finish.py); vLLM then frees their blocks."""
        assert self.worker is not None
        return self.worker.take_released() or None, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker is not None
        return self.worker.build_connector_worker_meta()

    def unregister_kv_caches(self) -> None:
        assert self.worker is not None
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After wake-up the same tensors hold the KV cache again; pages are sealed anew as written."""
        return

    # --------------------------------------------------------------- scheduler

    @fail_open(_no_external_match)
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The guard loads nothing. vLLM asks every connector of a MultiConnector with the
        request's local prefix-cache hits (``num_computed_tokens``), the guard last: what the
        request is later scheduled with beyond them, another connector loaded (the guard is
        told ``num_external_tokens=0`` when it did)."""
        if self.scheduler is not None and self.active:
            self.scheduler.note_local_hits(request.request_id, num_computed_tokens)
        return 0, False

    @fail_open(lambda self: None)
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.scheduler is not None:
            self.scheduler.note_request(request)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        assert self.scheduler is not None
        self.scheduler.block_pool = gpu_block_pool

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.scheduler is not None
        self.scheduler.kv_cache_manager = kv_cache_manager

    @fail_open(lambda self: self.scheduler.empty_metadata())
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        if not self.active:
            return self.scheduler.empty_metadata()
        return self.scheduler.build_connector_meta(scheduler_output)

    @fail_open(lambda self: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVGuardWorkerMetadata):
            self.scheduler.update_connector_output(meta)

    @fail_open(lambda self: None)
    def before_output(self, vllm_scheduler: Any, scheduler_output: Any, connector_output: Any) -> None:
        """Called by the ``Scheduler.update_from_output`` patch before vLLM handles the step."""
        assert self.scheduler is not None
        stop_strings = self.scheduler.stop_strings
        if self.active and stop_strings is not None:
            # vLLM appends this step's tokens next: checked for stop strings while any may end so.
            patches.check_stop_strings(vllm_scheduler, find_guard, stop_strings.watching)
        if self.active and connector_output is not None:
            self.scheduler.before_output(vllm_scheduler, scheduler_output, connector_output)

    @fail_open(lambda self: False)
    def ends_on_stop_string(self, request: Any, new_token_ids: list[int]) -> bool:
        """Called by the ``Scheduler._update_request_with_output`` wrapper: whether the request's
        new tokens complete one of its stop strings (connector/stop_strings.py)."""
        stop_strings = self.scheduler.stop_strings if self.scheduler is not None else None
        return self.active and stop_strings is not None and stop_strings.ends(request, new_token_ids)

    @fail_open(lambda self: None)
    def after_output(self, vllm_scheduler: Any, outputs: dict[int, Any]) -> None:
        """Called by the patch after vLLM handled the step: end the requests the guard must
        end, put its messages into failed and flagged requests' final outputs."""
        assert self.scheduler is not None
        failures = self.scheduler.take_pending_failures()
        if failures:
            # Their tokens in this step's outputs never leave (fail_requests drops them).
            self.scheduler.unsent = patches.tokens_in_outputs(outputs, failures)
            try:
                patches.fail_requests(vllm_scheduler, failures, outputs)
            finally:
                self.scheduler.unsent = {}
        self.scheduler.after_output(outputs, vllm_scheduler.requests)

    @fail_open(_nothing_to_send)
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        if not self.active:
            return False, None
        status = getattr(getattr(request, "status", None), "name", "")
        params = getattr(request, "sampling_params", None)
        kind = getattr(getattr(params, "output_kind", None), "name", "")
        hold = self.scheduler.request_finished(
            request.request_id,
            natural=status in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"),
            client_index=int(getattr(request, "client_index", 0) or 0),
            streaming=kind == "DELTA",
            output_tokens=int(getattr(request, "num_output_tokens", 0) or 0),
        )
        # Held: vLLM keeps its blocks until the workers report it done (get_finished).
        return hold, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is None:
            return None
        delta = self.scheduler.stats()
        return None if delta is None else KVGuardStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVGuardStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVGuardPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()


class KVGuardHMAConnector(KVGuardConnector, SupportsHMA):
    """The guard for engines that keep vLLM's hybrid KV cache manager.

    With one KV cache group it guards as usual. With several (a hybrid model) vLLM
    cannot map a bad block back to requests (``_handle_invalid_blocks`` refuses
    several groups), so the guard stands aside: ``kvguard_inactive`` at start-up,
    nothing sealed, serving unchanged (docs/design/parallel.md, "Hybrid models").
    """

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.active and block_ids:
            return self.request_finished(request, block_ids[0])
        return False, None
