"""Fault specs for fire drills (``VLLM_KVGUARD_INJECT``) and the injector that applies them.

A spec is one or more faults separated by ``;``, each ``KIND[:key=value,...]``::

    bitflip:count=3,seed=7          three single-bit flips in sealed pages at rest
    overwrite:count=1               a page overwritten with another page's bytes
    zero:rate=0.05,after=10         each step from step 10 on, 5 % chance to zero a page
    nan:count=2,layer=0             NaN written into pages of layer 0
    partial:count=2                 bits flipped in the written slots of pages still being written
    lost_write:count=1              a forward's writes into a reused page made not to land
    identity:count=1                two cached pages swap their prefix-cache hashes
    load:count=2                    a page another KV connector loaded, restored reversed

Kinds mirror what corrupts KV caches in the field (shared field notes): memory
bit flips (``bitflip``), block theft or a misdirected write (``overwrite``), a
page wiped (``zero``) and garbage from a bad kernel (``nan``) land in pages that
are sealed, after their seal, i.e. "at rest" (``nan`` also at write). Three more
reach what full-page checksums cannot see, each at its own site: a page still being
written (``partial``), a write that never landed, leaving the previous owner's rows
(``lost_write``), a page another KV connector loaded wrongly (``load``: its bytes reversed
in their last axis after they landed, as KV restored permuted), and a valid page served for
another prompt's tokens, as a block-hash
bug or collision does (``identity``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum

from vllm_kvguard.errors import KVGuardConfigError

VARIABLE = "VLLM_KVGUARD_INJECT"


class FaultKind(StrEnum):
    BITFLIP = "bitflip"
    OVERWRITE = "overwrite"
    ZERO = "zero"
    NAN = "nan"
    PARTIAL = "partial"
    LOST_WRITE = "lost_write"
    IDENTITY = "identity"
    LOAD = "load"


_KEYS = {"count", "rate", "seed", "after", "layer", "at", "rank"}
_GRAMMAR = (
    "KIND[:key=value,...] joined by ';', KIND one of bitflip | overwrite | zero | nan | partial | "
    "lost_write | identity | load, keys count=N (>=1) or rate=P (0<P<=1), seed=N, after=STEP (>=0), "
    "layer=INDEX (>=0), at=rest|write (write: nan only; partial, lost_write, identity and load have "
    "their own site), rank=WORKER (>=0; default: every worker)"
)


class FaultSite(StrEnum):
    REST = "rest"  # a sealed page no request holds, after its seal (checksum territory)
    WRITE = "write"  # a page being sealed this step, before its seal (the non-finite check)
    FILLING = "filling"  # a page still being written, after this step wrote it (partial)
    FORWARD = "forward"  # this step's writes into a page handed to a new owner (lost_write)
    CACHE = "cache"  # the prefix cache's hashes of two idle pages (identity)
    LOAD = "load"  # a page another KV connector loaded, after it landed, before its check (load)


# The kinds with a site of their own.
SITE_OF = {
    FaultKind.PARTIAL: FaultSite.FILLING,
    FaultKind.LOST_WRITE: FaultSite.FORWARD,
    FaultKind.IDENTITY: FaultSite.CACHE,
    FaultKind.LOAD: FaultSite.LOAD,
}


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    count: int | None = None
    rate: float | None = None
    seed: int = 0
    after: int = 0
    layer: int | None = None
    at: FaultSite = FaultSite.REST
    rank: int | None = None  # only this worker corrupts its copy (tensor/pipeline parallel)


def _bad(spec: str, variable: str, why: str) -> KVGuardConfigError:
    return KVGuardConfigError(variable, spec, f"{_GRAMMAR} ({why})")


def _int(spec: str, variable: str, key: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _bad(spec, variable, f"{key}={text!r} is not an integer") from None
    if value < minimum:
        raise _bad(spec, variable, f"{key} must be >= {minimum}")
    return value


def parse_fault_spec(spec: str, *, variable: str = VARIABLE) -> list[FaultSpec]:
    """Parse a fault spec; raise :class:`KVGuardConfigError` naming what is wrong."""
    faults: list[FaultSpec] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind_text, _, args = part.partition(":")
        try:
            kind = FaultKind(kind_text.strip().lower())
        except ValueError:
            raise _bad(spec, variable, f"unknown fault kind {kind_text.strip()!r}") from None
        kw: dict[str, str] = {}
        for item in (a.strip() for a in args.split(",")):
            if not item:
                continue
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq or key not in _KEYS:
                raise _bad(spec, variable, f"{item!r} is not key=value with a known key")
            if key in kw:
                raise _bad(spec, variable, f"{key} given twice")
            kw[key] = value.strip()
        count = _int(spec, variable, "count", kw["count"], 1) if "count" in kw else None
        rate = None
        if "rate" in kw:
            try:
                rate = float(kw["rate"])
            except ValueError:
                raise _bad(spec, variable, f"rate={kw['rate']!r} is not a number") from None
            if not 0.0 < rate <= 1.0:
                raise _bad(spec, variable, "rate must be in (0, 1]")
        if count is not None and rate is not None:
            raise _bad(spec, variable, "give count or rate, not both")
        if count is None and rate is None:
            count = 1
        if kind in SITE_OF:
            if "at" in kw:
                raise _bad(spec, variable, f"{kind} has its own site; leave at= out")
            at = SITE_OF[kind]
        else:
            try:
                at = FaultSite(kw.get("at", "rest").lower())
            except ValueError:
                raise _bad(spec, variable, f"at={kw['at']!r} is not rest or write") from None
            if at not in (FaultSite.REST, FaultSite.WRITE):
                raise _bad(spec, variable, f"at={kw['at']!r} is not rest or write")
        if at == FaultSite.WRITE and kind != FaultKind.NAN:
            # A checksum seals whatever was written; only non-finite values are visible then.
            raise _bad(spec, variable, f"at=write needs kind nan, not {kind}")
        faults.append(
            FaultSpec(
                kind=kind,
                count=count,
                rate=rate,
                seed=_int(spec, variable, "seed", kw["seed"], 0) if "seed" in kw else 0,
                after=_int(spec, variable, "after", kw["after"], 0) if "after" in kw else 0,
                layer=_int(spec, variable, "layer", kw["layer"], 0) if "layer" in kw else None,
                at=at,
                rank=_int(spec, variable, "rank", kw["rank"], 0) if "rank" in kw else None,
            )
        )
    if not faults:
        raise _bad(spec, variable, "no fault given")
    return faults


@dataclass
class InjectedFault:
    """One fault that landed: where, when, and what became of it."""

    kind: FaultKind
    block_id: int
    layer: int
    step: int
    read: bool = False
    detected: bool = False
    discarded: bool = False
    partner: int | None = None  # identity: the other page


@dataclass
class FaultPlan:
    """Decides, step by step, which faults to inject. Pure: the worker applies them."""

    specs: list[FaultSpec]
    _rngs: list[random.Random] = field(default_factory=list)
    _left: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rngs = [random.Random(s.seed * 1000003 + i) for i, s in enumerate(self.specs)]
        self._left = [s.count for s in self.specs]

    def due(
        self, step: int, candidates: list[int], num_layers: int, at: FaultSite = FaultSite.REST
    ) -> list[tuple[FaultSpec, int, int, random.Random]]:
        """Faults at site ``at`` to apply at ``step``: (spec, block id, layer index, rng) for each."""
        out: list[tuple[FaultSpec, int, int, random.Random]] = []
        if not candidates:
            return out
        # At most one fault per step, so that faults spread over pages and time.
        for i, spec in enumerate(self.specs):
            if out or step < spec.after or spec.at != at:
                continue
            rng = self._rngs[i]
            if spec.count is not None:
                if not self._left[i]:
                    continue
                self._left[i] = self._left[i] - 1  # type: ignore[operator]
            elif rng.random() >= (spec.rate or 0.0):
                continue
            block = rng.choice(candidates)
            layer = spec.layer if spec.layer is not None else rng.randrange(num_layers)
            out.append((spec, block, min(layer, num_layers - 1), rng))
        return out


@dataclass(frozen=True)
class Injection:
    """An order to a worker: corrupt this page now (after this step's seals)."""

    fault_id: int
    kind: FaultKind
    block_id: int
    layer: int
    seed: int
    at: FaultSite = FaultSite.REST
    rank: int | None = None  # None: every worker
    partner: int | None = None  # identity: the other page whose hash was swapped


# Sites whose fault is read in the step it is injected (by the check after that forward).
_READ_AT_ONCE = (FaultSite.WRITE, FaultSite.FORWARD, FaultSite.LOAD)


class FaultTracker:
    """Scheduler-side bookkeeping of a fire drill: what was injected and what became of it.

    A fault is *read* when its page is verified (a request reuses it, or the scrubber
    walks it; for a fault at write, by the check at its seal), *detected* when that
    verification reports the block, and
    *escaped* when it was read and the worker verified it clean. A page handed to a
    new writer before anyone read it ends the fault as *not_read*.
    """

    def __init__(self, specs: list[FaultSpec]) -> None:
        self._plan = FaultPlan(specs)
        self.faults: dict[int, InjectedFault] = {}  # not yet ended: dropped once reported
        self._pending: dict[int, list[int]] = {}  # block -> fault ids not yet read
        self._reading: dict[int, list[int]] = {}  # step -> fault ids read at that step
        self._next_id = 1

    def inject(
        self, step: int, candidates: list[int], num_layers: int, at: FaultSite = FaultSite.REST
    ) -> list[Injection]:
        """Faults to inject this step. A fault at rest waits for a reader; one at write
        is read by the check at its seal in this same step."""
        out = []
        fresh = [b for b in candidates if b not in self._pending]
        for spec, block, layer, rng in self._plan.due(step, fresh, num_layers, at):
            fid = self._next_id
            self._next_id += 1
            self.faults[fid] = InjectedFault(spec.kind, block, layer, step)
            if at in _READ_AT_ONCE:
                self.faults[fid].read = True
                self._reading.setdefault(step, []).append(fid)
            else:
                self._pending.setdefault(block, []).append(fid)
            out.append(Injection(fid, spec.kind, block, layer, rng.randrange(2**31), at, spec.rank))
        return out

    def pending(self, block: int) -> bool:
        """Whether a fault waits for a reader of this page (another fault must not land on it)."""
        return any(fid in self.faults for fid in self._pending.get(block, ()))

    def pair(self, fault_id: int, partner: int) -> None:
        """An identity fault is read through either of its two pages."""
        self._pending.setdefault(partner, []).append(fault_id)
        self.faults[fault_id].partner = partner

    def allocated(self, blocks: list[int]) -> list[int]:
        """Blocks handed to a new writer: their unread faults end as not read."""
        ended = []
        for block in blocks:
            for fid in self._pending.pop(block, ()):
                fault = self.faults.get(fid)
                if fault is not None and not fault.read:
                    del self.faults[fid]
                    fault.discarded = True
                    ended.append(fid)
        return ended

    def verifying(self, step: int, blocks: list[int]) -> None:
        read = []
        for block in blocks:
            for fid in self._pending.pop(block, ()):
                fault = self.faults.get(fid)
                if fault is not None and not fault.read:
                    fault.read = True
                    read.append(fid)
        if read:
            self._reading.setdefault(step, []).extend(read)

    def no_change(self, fault_id: int) -> None:
        fault = self.faults.pop(fault_id, None)
        if fault is None:
            return
        fault.discarded = True
        for pending in self._pending.values():
            if fault_id in pending:
                pending.remove(fault_id)
        for reading in self._reading.values():
            if fault_id in reading:
                reading.remove(fault_id)

    def footprint(self) -> int:
        """Faults not yet ended (injected, waiting for a reader or a verdict)."""
        return len(self.faults) + len(self._reading)

    def verified(self, step: int, bad_blocks: set[int]) -> list[tuple[int, bool]]:
        """The worker reported step ``step``: (fault id, detected) for faults read then."""
        out = []
        for fid in self._reading.pop(step, ()):
            fault = self.faults.pop(fid, None)
            if fault is None:
                continue
            fault.detected = fault.block_id in bad_blocks or fault.partner in bad_blocks
            out.append((fid, fault.detected))
        return out
