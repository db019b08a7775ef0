"""What crosses between the connector's roles each step (pickled by vLLM).

Scheduler -> workers: :class:`KVGuardMetadata`, the ledger's :class:`StepPlan` plus
what the scheduler side adds (scrub pages, blocks to report unreadable, drill faults).
Workers -> scheduler: :class:`KVGuardWorkerMetadata`, detections, counters and errors,
merged over ranks; device checks ride in it as :class:`DeviceCheck` until they settle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.core.events import Detection
from vllm_kvguard.core.faults import Injection
from vllm_kvguard.core.ledger import StepPlan
from vllm_kvguard.digest import PendingCheck
from vllm_kvguard.digest.kernel import MISMATCH, NONFINITE


@dataclass
class KVGuardMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    plan: StepPlan
    read_trigger: str = ""
    scrub: list[int] = field(default_factory=list)
    # The scrub pages still being written: verified by their rows (digest/rows.py).
    scrub_filling: list[int] = field(default_factory=list)
    # Blocks the workers report as unreadable this step, so that vLLM recomputes (or,
    # under the fail policy, fails) the requests holding them: non-finite pages found
    # at an earlier seal, blocks a lifecycle violation made unreadable.
    invalidate: list[int] = field(default_factory=list)
    inject: list[Injection] = field(default_factory=list)
    # Pages to zero before the forward: written by requests that were failed after reading
    # a bad page, now free (their NaN/Inf must not reach the next owner's attention).
    zero: list[int] = field(default_factory=list)
    # Per row of plan.written_blocks: its block's previous owner wrote a different computation at
    # that page position, so the row reading back as that owner's is a lost write (digest/rows.py).
    lost_write_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def step(self) -> int:
        return self.plan.step


@dataclass
class DeviceCheck:
    """A kernel launch's results (a :class:`PendingCheck`) and what its detections must say.

    :meth:`settle` is the one place a device check turns into detections; the result
    (or the error that kept it from being read) is kept, so every later reader (the
    worker forgetting bad seals, the scheduler handling the step's output) sees the
    same answer without reading the device again.
    """

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
    error: str | None = None
    _detections: list[Detection] | None = field(default=None, repr=False)

    @property
    def settled(self) -> bool:
        return self._detections is not None

    def ready(self) -> bool:
        """Whether :meth:`settle` would not wait for the device."""
        return self.settled or self.check.ready()

    def settle(self) -> list[Detection]:
        """The flagged pages as detections (waits for the launch if it is still running).

        A check that cannot be read back fails open: no detections, ``error`` says why
        (counted and logged by the scheduler; those pages count as not verified).
        """
        if self._detections is None:
            try:
                bit = NONFINITE if self.kind == "nonfinite" else MISMATCH
                self._detections = [
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
            except Exception as exc:
                self.error = f"settle device check ({self.trigger}): {exc!r}"
                self._detections = []
        return self._detections

    def invalid(self) -> set[int]:
        """Blocks to report unreadable to vLLM (bad seals found by a verify launch)."""
        if not self.report_invalid or self.kind == "nonfinite":
            return set()
        return {d.block_id for d in self.settle()}


@dataclass
class KVGuardWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step that has something to say; merged over ranks."""

    verified_steps: set[int] = field(default_factory=set)
    detections: list[Detection] = field(default_factory=list)
    # Device-path findings of an earlier step, diagnosed since (their shape and where).
    diagnosed: list[Detection] = field(default_factory=list)
    unchanged_faults: list[int] = field(default_factory=list)
    internal_errors: list[str] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)  # GuardCounters.to_dict()
    # Blocks to report unreadable that were found after get_block_ids_with_load_errors
    # ran (device checks, settled with the step's output); see KVGuardScheduler.before_output().
    invalid: set[int] = field(default_factory=set)
    # Device checks of this step, still on the device (never pickled: settled first).
    pending: list[DeviceCheck] = field(default_factory=list)
    # Set by the scheduler side once it has acted on this output (it is offered twice:
    # before vLLM handles the step, and in update_connector_output).
    handled: bool = False

    def settle(self) -> KVGuardWorkerMetadata:
        """Fold the device checks' results in (see :meth:`DeviceCheck.settle`)."""
        for check in self.pending:
            self.detections.extend(check.settle())
            self.invalid |= check.invalid()
            if check.error is not None:
                self.internal_errors.append(check.error)
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
            diagnosed=self.diagnosed + other.diagnosed,
            unchanged_faults=sorted(set(self.unchanged_faults) | set(other.unchanged_faults)),
            internal_errors=self.internal_errors + other.internal_errors,
            counters=counters.to_dict(),
            invalid=self.invalid | other.invalid,
        )


def guard_worker_meta(meta: object) -> KVGuardWorkerMetadata | None:
    """The guard's worker metadata in a step's output (itself, or a MultiConnector child's)."""
    if isinstance(meta, KVGuardWorkerMetadata):
        return meta
    for child in getattr(meta, "metadata", None) or ():
        if isinstance(child, KVGuardWorkerMetadata):
            return child
    return None
