"""What crosses between the connector's roles each step (pickled by vLLM).

Scheduler -> workers: :class:`KVGuardMetadata`, the ledger's :class:`StepPlan` plus
what the scheduler side adds (scrub pages, blocks to report unreadable, drill faults).
Workers -> scheduler: :class:`KVGuardWorkerMetadata`, detections, counters and errors,
merged over ranks; device checks ride in it as :class:`DeviceCheck` until they settle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.core.events import Detection
from vllm_kvguard.core.faults import Injection
from vllm_kvguard.core.plan import StepPlan
from vllm_kvguard.core.shapes import Shape
from vllm_kvguard.digest.checks import PendingCheck
from vllm_kvguard.digest.kernel import MISMATCH, NONFINITE

# Shared by every step's metadata that has no lost-write rows (read-only; one would be made per
# step otherwise, and numpy calls are dear after a forward: benchmarks/cold_calls.py).
_NO_ROWS = np.zeros(0, dtype=bool)
_NO_ROWS.flags.writeable = False


def _no_rows() -> np.ndarray:
    return _NO_ROWS


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
    # Empty where no row of the step could tell one (the usual step: the worker then tests its
    # length, not every row).
    lost_write_rows: np.ndarray = field(default_factory=_no_rows)
    # Only beside another KV connector (digest/loads.py): the pages sealed this step and their
    # identity fingerprints (the worker keeps their digests under them), and the full pages
    # another connector loaded for this step with the fingerprints their readers expect.
    sealed_identity: tuple[np.ndarray, np.ndarray] | None = None
    loaded: tuple[np.ndarray, np.ndarray] | None = None
    load_readers: dict[int, list[str]] = field(default_factory=dict)
    # The finish check (connector/finish.py): pages finished requests read that were not verified
    # since, their unfilled pages (by rows), verified before this step's forward; and those
    # requests, reported done (get_finished) so that vLLM frees their blocks.
    finish: list[int] = field(default_factory=list)
    finish_filling: list[int] = field(default_factory=list)
    release: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.plan.step


class _Settles:
    """What a device check and a device row check share: settled once, ready without a wait."""

    check: PendingCheck
    _detections: list[Detection] | None

    @property
    def settled(self) -> bool:
        return self._detections is not None

    def ready(self) -> bool:
        """Whether settling would not wait for the device."""
        return self.settled or self.check.ready()


@dataclass
class DeviceCheck(_Settles):
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
    where: dict[str, object] | None = None
    error: str | None = None
    # A load check's verdicts (connector/loaded.py): which pages matched a digest set, which only
    # their sketch, on the device; counted by label when the check is settled.
    verdicts: Any = field(default=None, repr=False)
    _detections: list[Detection] | None = field(default=None, repr=False)

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
                        where=dict(self.where or {}),
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


def row_detections(
    rank: int,
    blocks: np.ndarray,
    slots: np.ndarray,
    bad: np.ndarray,
    expected: np.ndarray,
    actual: np.ndarray,
    readers: dict[int, list[str]],
    trigger: str,
    step: int,
) -> list[Detection]:
    """One ``partial_mismatch`` detection per block among the rows ``bad`` (indices into
    blocks/slots, ascending) whose digest changed since it was recorded; ``expected``/``actual``
    line up with ``bad``. ``blocks``/``slots`` are every written row of the blocks checked."""
    found: dict[int, list[tuple[int, int]]] = {}
    for k, i in enumerate(bad.tolist()):
        found.setdefault(int(blocks[i]), []).append((int(slots[i]), k))
    out = []
    for block, entries in found.items():
        k = entries[0][1]
        where: dict[str, object] = {
            "slots": [s_ for s_, _ in entries],
            "rows_written": int(np.count_nonzero(blocks == block)),
        }
        out.append(
            Detection(
                rank,
                block,
                "all",
                int(expected[k]),
                int(actual[k]),
                tuple(readers.get(block, ())),
                trigger,
                step,
                "partial_mismatch",
                shape=str(Shape.UNFILLED_ROWS),
                where=where,
            )
        )
    return out


def lost_write_detections(
    rank: int, blocks: np.ndarray, slots: np.ndarray, digests: np.ndarray, step: int
) -> list[Detection]:
    """One ``write_lost`` detection per block among these rows (each read back, after the
    forward that wrote it, as the block's previous owner's; ``digests`` line up with them)."""
    found: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for i, (b, s_) in enumerate(zip(blocks.tolist(), slots.tolist(), strict=True)):
        found.setdefault(b, []).append(s_)
        first.setdefault(b, i)
    return [
        Detection(
            rank,
            block,
            "all",
            int(digests[first[block]]),
            int(digests[first[block]]),
            (),
            "write",
            step,
            "write_lost",
            shape=str(Shape.STALE),
            where={"slots": lost},
        )
        for block, lost in found.items()
    ]


@dataclass
class DeviceRowCheck(_Settles):
    """Row digests compared on the device (:class:`DeviceRowDigests`): what :class:`DeviceCheck`
    is to pages, for the rows of pages still being written. ``kind`` "partial_mismatch" (rows
    that changed since recorded: checked at seal, by sampled/paranoid reads, by scrub) or
    "write_lost" (rows just written that read as the previous owner's, kept where ``lost`` says
    the previous owner computed something else there)."""

    check: PendingCheck
    rank: int
    blocks: np.ndarray
    slots: np.ndarray
    trigger: str
    step: int
    readers: dict[int, list[str]]
    kind: str
    report_invalid: bool
    lost: np.ndarray | None = None
    error: str | None = None
    _detections: list[Detection] | None = field(default=None, repr=False)

    def settle(self) -> list[Detection]:
        """The flagged rows as detections, one per block (waits for the device if it must);
        fails open as :meth:`DeviceCheck.settle` does."""
        if self._detections is None:
            try:
                flagged = self.check.settle()
                rows = np.asarray([r for r, *_ in flagged], dtype=np.int64)
                actual = np.asarray([a for *_, a, _ in flagged], dtype=np.uint64)
                if self.kind == "write_lost":
                    keep = self.lost[rows] if self.lost is not None else np.ones(len(rows), dtype=bool)
                    rows, actual = rows[keep], actual[keep]
                    self._detections = lost_write_detections(
                        self.rank, self.blocks[rows], self.slots[rows], actual, self.step
                    )
                else:
                    expected = np.asarray([e for *_, e in flagged], dtype=np.uint64)
                    self._detections = row_detections(
                        self.rank,
                        self.blocks,
                        self.slots,
                        rows,
                        expected,
                        actual,
                        self.readers,
                        self.trigger,
                        self.step,
                    )
            except Exception as exc:
                self.error = f"settle device row check ({self.trigger}): {exc!r}"
                self._detections = []
        return self._detections

    def invalid(self) -> set[int]:
        """Blocks to report unreadable to vLLM (pages whose written rows changed)."""
        if not self.report_invalid or self.kind != "partial_mismatch":
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
    # Loaded pages refused this step for an audit (connector/loaded.py): reported unreadable so
    # that vLLM recomputes them, whatever the load-failure policy (an audit fails no request).
    audits: set[int] = field(default_factory=set)
    # Audits whose recomputation differed from what was loaded: (block, its readers, distance).
    audits_failed: list[tuple[int, tuple[str, ...], float]] = field(default_factory=list)
    # Device checks of this step, still on the device (never pickled: settled first).
    pending: list[DeviceCheck | DeviceRowCheck] = field(default_factory=list)
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
            verdicts = getattr(check, "verdicts", None)
            if verdicts is not None:
                self._count_loads(verdicts, len(check.check.block_ids))
        self.pending = []
        return self

    def _count_loads(self, verdicts: Any, pages: int) -> None:
        """A device load check's pages by how they were verified (exact, approx, bad), counted
        in this step's output, as the host path counts them when it checks."""
        exact, approx = (int(v.sum().item()) for v in verdicts)
        counters = GuardCounters.from_dict(self.counters)
        for label, n in (("exact", exact), ("approx", approx), ("bad", pages - exact - approx)):
            if n:
                counters.add("pages_loaded", n, label=label)
        self.counters = counters.to_dict()

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
            audits=self.audits | other.audits,
            audits_failed=self.audits_failed + other.audits_failed,
        )


_M = TypeVar("_M", KVGuardMetadata, KVGuardWorkerMetadata)


def _guard_child(meta: object, kind: type[_M]) -> _M | None:
    """The guard's part of ``meta``: itself, or a MultiConnector child's."""
    if isinstance(meta, kind):
        return meta
    for child in getattr(meta, "metadata", None) or ():
        if isinstance(child, kind):
            return child
    return None


def guard_meta(meta: object) -> KVGuardMetadata | None:
    """The guard's step metadata in a scheduler output."""
    return _guard_child(meta, KVGuardMetadata)


def guard_worker_meta(meta: object) -> KVGuardWorkerMetadata | None:
    """The guard's worker metadata in a step's output."""
    return _guard_child(meta, KVGuardWorkerMetadata)
