"""Pages another KV connector loads into this engine (beside the guard under a MultiConnector).

For every page sealed here, the worker keeps each layer's digest under the page's identity
fingerprint (digest/loads.py, and the shared folder of digest/store.py). A page another
connector loads is compared with the digests of its own identity:

- **Host path** (digests computed on the host): layer by layer as vLLM calls
  ``wait_for_layer_load`` (the other connectors' hooks for that layer ran first, so the layer
  has landed and attention has not read it). A mismatch is known in the step and reported
  unreadable at once; the page is not sealed.
- **Device path** (KVG64 seals on the GPU): one launch over every loaded page and layer after the
  forward (attention only reads the loaded pages, so their bytes are those it read), compared on
  the device and read back with the step's output like the device path's other checks, so the
  bad block still reaches vLLM's recompute in the same step. The digests sealed on the device
  reach the host store through one non-blocking copy per sealing step, read at a later bind
  (a step with loads waits for the previous steps' copies: the only wait loads add).

A page that matches none of the digest sets kept for its identity is compared with the
identity's sketch (digest/sketch.py: the first computation's, kept beside the digests) within
the sketch's tolerance: vLLM is not batch-invariant, and the connector's copy may be a
computation whose exact digests are no longer kept. Counted ``verified="approx"``; only a page
outside the tolerance (or with no sketch) is bad.

Pages whose identity has no digest here are counted as loaded unverified, sealed as loaded,
and never kept or published as a reference (nothing says their bytes are what their inputs
compute); nor are pages verified by their sketch alone. Some of them are audited
(core/audit.py): reported unreadable so that vLLM computes them again, their loaded sketch kept
until the recomputed page is sealed, then compared with its sketch. A mismatch (the connector
served wrong KV: another model's, another layout) is reported (``kv_load_audit_failed``), its
readers were recomputed (healed), and the connector is distrusted: every page it loads that
nothing here can check is refused from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_kvguard.config import KVGuardConfig, Mode
from vllm_kvguard.connector.metadata import KVGuardMetadata, KVGuardWorkerMetadata
from vllm_kvguard.core.audit import LoadAudit
from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.core.events import Detection
from vllm_kvguard.core.faults import FaultSite
from vllm_kvguard.core.shapes import Shape
from vllm_kvguard.digest.checks import PendingCheck
from vllm_kvguard.digest.kernel import MISMATCH
from vllm_kvguard.digest.loads import LoadDigests, candidates
from vllm_kvguard.digest.pages import KVPages
from vllm_kvguard.digest.sketch import WIDTH, PageSketches, distance, matches
from vllm_kvguard.digest.store import DigestFolder, DigestStore
from vllm_kvguard.digest.table import DeviceDigestTable, DigestTable


@dataclass
class _SealedOnDevice:
    """A step's sealed pages' digests on their way from the device table to the host."""

    step: int
    blocks: np.ndarray
    fingerprints: np.ndarray
    digests: torch.Tensor  # int64 (pages, layers): pinned host memory on a GPU
    sketches: torch.Tensor  # float32 (pages, layers, WIDTH): likewise
    event: Any  # the copy's CUDA event (None off CUDA)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


# Audited loads awaiting their recomputation's seal, at most (a request that ends first never
# seals it).
AUDITS_KEPT = 4096


class LoadedPages:
    """The worker's view of loaded pages: reference digests kept, this step's loads checked."""

    def __init__(
        self,
        config: KVGuardConfig,
        rank: int,
        pages: KVPages,
        table: DigestTable,
        counters: GuardCounters,
        out: Callable[[], KVGuardWorkerMetadata],
        weights: int = 0,
    ) -> None:
        self.config = config
        self.rank = rank
        self.pages = pages
        self.table = table
        self.counters = counters
        self._out = out
        self.on_device = isinstance(table, DeviceDigestTable)
        self.digests = LoadDigests(pages.num_layers, config.load_digests_bytes, config.load_digest_sets)
        self.sketcher = PageSketches(pages.tensors)
        # VLLM_KVGUARD_DIGEST_DIR: the digests this engine seals, published for other engines (a
        # decode engine loading a prefill engine's pages), and theirs, fetched on a miss. Only the
        # same shard of the same layout, computed by the same weights, is comparable.
        self.store: DigestStore | None = None
        if config.digest_dir:
            layout = f"L{pages.num_layers}-B{pages.bytes_per_block}-{config.hash}-S{WIDTH}"
            layout += f"-W{weights:016x}-rank{rank}"
            self.store = DigestFolder(config.digest_dir, layout, pages.num_layers, config.digest_dir_bytes)
        # This step: layers still to check (host path), the loaded pages with a digest and
        # those digests (pages x sets x layers: every computation of the page's inputs kept,
        # newest first, digest/loads.py), which of those sets each page still matches, the
        # mismatches with the newest found so far, the pages found bad (never sealed), and
        # the pages never to keep as a reference (bad, or loaded without a digest).
        # (The worker's loads_left is this set: cleared and filled in place, never replaced.)
        self.left: set[int] = set()
        self.blocks: list[int] = []
        self.expected: np.ndarray = np.zeros((0, 0, 0), dtype=np.uint64)
        self.alive: np.ndarray = np.zeros((0, 0), dtype=bool)
        # The same pages' kept sketches (pages x sketched layers x WIDTH; NaN: none).
        self.kept: np.ndarray = np.zeros((0, 0, WIDTH), dtype=np.float32)
        self._bad: list[tuple[int, int, int, int]] = []
        self.failed: set[int] = set()
        self.not_reference: set[int] = set()
        # Device path: the sealing steps' digests not yet in the host store, and by step, the
        # loaded pages checked on the device by the digest they should have, per layer (to tell a
        # bad one that holds another's KV when its check is read).
        self._sealed: list[_SealedOnDevice] = []
        self.checked_on_device: dict[int, list[dict[int, int]]] = {}
        # Device path, by step: which checked pages matched a digest set, which their sketch.
        self._verdicts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Audits (core/audit.py; never in log mode, which changes nothing vLLM does): this step's
        # refused pages (block -> fingerprint, readers), and the loaded sketches awaiting the
        # seal of their recomputation (fingerprint -> sketch, block, readers), oldest first out.
        self.audit = LoadAudit(config.load_audit if config.mode != Mode.LOG else 0.0)
        self.refused: dict[int, tuple[int, tuple[str, ...]]] = {}
        self._audited: dict[int, tuple[np.ndarray, int, tuple[str, ...]]] = {}

    def nbytes(self) -> int:
        return self.digests.nbytes()

    @property
    def copying(self) -> bool:
        """Device path: sealed digests still on their way to the store."""
        return bool(self._sealed)

    def new_step(self) -> None:
        self.left.clear()
        self.blocks = []
        self._bad = []
        self.failed = set()
        self.not_reference = set()
        self.refused = {}

    # ------------------------------------------------------------- before the forward

    def begin(self, meta: KVGuardMetadata) -> None:
        """Look up the digests of this step's loaded pages (``meta.loaded``): on the host path
        each layer is then checked as it is about to be read (:meth:`check`); on the device path
        all at once after the forward (:meth:`check_on_device`)."""
        assert meta.loaded is not None
        blocks, fingerprints = meta.loaded
        expected = self.digests.expected(fingerprints)
        if self.store is not None and any(row is None for row in expected):
            # Pages another engine computed: what it published since the last look.
            self.digests.remember(*self.store.fetch())
            expected = self.digests.expected(fingerprints)
        known = [i for i, row in enumerate(expected) if row is not None]
        if len(known) < len(blocks):
            self.counters.add("pages_loaded", len(blocks) - len(known), label="no")
            self.not_reference |= {int(b) for i, b in enumerate(blocks.tolist()) if expected[i] is None}
            self._choose_audits(
                blocks, fingerprints, [i for i, row in enumerate(expected) if row is None], meta
            )
        if not known:
            self._faults_unchecked(meta)
            return
        self.blocks = [int(blocks[i]) for i in known]
        self.expected = candidates([expected[i] for i in known])  # type: ignore[misc]
        self.alive = np.ones(self.expected.shape[:2], dtype=bool)
        kept = self.digests.sketches([int(fingerprints[i]) for i in known])
        self.kept = np.full((len(known), len(self.sketcher.layers), WIDTH), np.nan, dtype=np.float32)
        for i, sketch in enumerate(kept):
            if sketch is not None:
                self.kept[i] = sketch
        if not self.on_device:
            self.left.update(range(self.pages.num_layers))

    # ------------------------------------------------------------- host path

    def check(self, layers: list[int], meta: KVGuardMetadata) -> set[int] | None:
        """Hash the loaded pages of ``layers`` and compare them with their digests. When the
        last layer is done: the pages found bad, those that match no computation of their
        inputs kept here in every layer (reported once each, see :meth:`_finish`)."""
        blocks = self.blocks
        for layer in layers:
            self.left.discard(layer)
            self._inject(layer, meta)
            actual = np.asarray(self.pages.digest_layer(layer, blocks), dtype=np.uint64)
            expected = self.expected[:, :, layer]
            self.alive &= expected == actual[:, None]
            for i in np.flatnonzero(actual != expected[:, 0]).tolist():
                self._bad.append((blocks[i], layer, int(expected[i, 0]), int(actual[i])))
        if self.left:
            return None
        return self._finish(meta)

    def _finish(self, meta: KVGuardMetadata) -> set[int]:
        """Every layer checked: one detection per bad page (its first layer that differs from the
        newest computation). A page that matches an older one in every layer is not bad."""
        exact = self.alive.any(axis=1)
        # Pages no kept computation matches in every layer: by their sketch, where one is kept.
        approx = np.zeros_like(exact)
        far: dict[int, float] = {}
        need = np.flatnonzero(~exact & ~np.isnan(self.kept[:, 0, 0]))
        if len(need):
            loaded = self.sketcher.compute([self.blocks[i] for i in need.tolist()]).cpu()
            kept = torch.from_numpy(self.kept[need])
            approx[need] = matches(loaded, kept).all(dim=-1).numpy()
            d = np.nan_to_num(distance(loaded, kept).amax(dim=-1).numpy(), nan=np.inf)
            far = {self.blocks[i]: float(x) for i, x in zip(need.tolist(), d.tolist(), strict=True)}
        dead = {self.blocks[i] for i in np.flatnonzero(~exact & ~approx).tolist()}
        self._count(meta, int(np.count_nonzero(exact)), int(np.count_nonzero(approx)), len(dead))
        out = self._out()
        seen: set[int] = set()
        for block, layer, want, got in self._bad:
            if block in seen or block not in dead:
                continue
            seen.add(block)
            bad_layers = sum(1 for b, *_ in self._bad if b == block)  # against the newest
            shape, where = self.shape(block, layer, got, self._expected_of(layer))
            if block in far:
                where["sketch_distance"] = round(far[block], 4) if np.isfinite(far[block]) else "nan"
            out.detections.append(
                Detection(
                    self.rank,
                    block,
                    self.pages.names[layer],
                    want,
                    got,
                    tuple(meta.load_readers.get(block, ())),
                    "external_load",
                    meta.step,
                    shape=shape,
                    where=where | {"layers_bad": bad_layers},
                )
            )
        # Bad, or verified by its sketch alone: never kept as a reference.
        self.not_reference |= seen | {self.blocks[i] for i in np.flatnonzero(approx).tolist()}
        self.failed |= seen
        if seen:
            self.audit.error()
        self.blocks, self._bad = [], []
        return seen

    def _expected_of(self, layer: int) -> dict[int, int]:
        """This step's loaded pages by each digest they may have in ``layer`` (every computation)."""
        rows = self.expected[:, :, layer].tolist()
        return {int(d): b for b, row in zip(self.blocks, rows, strict=True) for d in row}

    def shape(
        self, block: int, layer: int, actual: int, loaded: dict[int, int]
    ) -> tuple[str, dict[str, object]]:
        """The shape of a bad load (core/shapes.py) from the page as loaded: zeroed, NaN/Inf, or
        a copy of another page (what another page loaded this step should hold, as a transfer
        one page off gives, or another sealed page here). Nothing of the page as computed is
        kept but its digests (no syndrome), so a load that is none of these stays
        ``undiagnosed`` (``where.why`` says so). The rare path: one page copied to the host."""
        page = self.pages.host_page(block, layer)
        where: dict[str, object] = {"device": str(self.pages.tensors[layer].device)}
        source = loaded.get(actual)
        if source is None or source == block:
            source = self.table.sealed_matching(layer, actual, block)
        if source is not None:
            where["source_block"] = source
        raw = page.view(torch.uint8).reshape(-1)
        if not bool(raw.any()):
            return str(Shape.ZEROED), where
        if source is not None:
            return str(Shape.COPY_OF_BLOCK), where
        if page.is_floating_point() and not bool(torch.isfinite(page).all()):
            return str(Shape.NONFINITE), where
        where["why"] = "a loaded page: only its digests are kept, no syndrome"
        return str(Shape.UNDIAGNOSED), where

    def _count(self, meta: KVGuardMetadata, exact: int | None, approx: int = 0, bad: int = 0) -> None:
        """A step's checked loads (by how they were verified: ``exact`` None on the device
        path, counted when its check is settled, KVGuardWorkerMetadata.settle)."""
        n = len(self.blocks)
        if exact is not None:
            self._count_verdicts(exact, approx, bad)
        self.counters.add("verified", n, label="external_load")
        self.counters.add("bytes_hashed", n * self.pages.bytes_per_block, label="verify")
        self._out().verified_steps.add(meta.step)

    def _count_verdicts(self, exact: int, approx: int, bad: int) -> None:
        for label, n in (("exact", exact), ("approx", approx), ("bad", bad)):
            if n:
                self.counters.add("pages_loaded", n, label=label)

    # ------------------------------------------------------------- device path

    def check_on_device(self, meta: KVGuardMetadata) -> PendingCheck | None:
        """After the forward: every loaded page and layer in one launch, compared on the device
        with the digests kept for it; nothing waits (the worker defers the result)."""
        if not self.blocks:
            return None
        assert isinstance(self.table, DeviceDigestTable) and self.pages.geometry is not None
        for layer in range(self.pages.num_layers):
            self._inject(layer, meta)
        self._count(meta, None)
        device = self.pages.geometry.device
        ids = torch.from_numpy(np.asarray(self.blocks, dtype=np.int64))
        want = torch.from_numpy(np.ascontiguousarray(self.expected).view(np.int64))
        if device.type == "cuda":
            ids = ids.pin_memory().to(device, non_blocking=True)
            want = want.pin_memory().to(device, non_blocking=True)
        actual, _ = self.pages.geometry.launch(ids, table=None)
        got = actual.view(torch.int64)
        # A page matching any computation of its inputs in every layer is good, or one within
        # its sketch's tolerance in every layer; a bad one is flagged in the layers that differ
        # from the newest.
        exact = (got[:, None, :] == want).all(dim=-1).any(dim=-1)
        kept = torch.from_numpy(self.kept).to(device)
        near = matches(self.sketcher.compute(self.blocks), kept).all(dim=-1)
        approx = near & ~exact
        good = exact | approx
        self._verdicts[meta.step] = (exact, approx)
        newest = want[:, 0, :].contiguous()
        flags = ((got != newest) & ~good[:, None]).to(torch.int8) * MISMATCH
        self.checked_on_device[meta.step] = [
            self._expected_of(layer) for layer in range(self.pages.num_layers)
        ]
        blocks, self.blocks = self.blocks, []
        return PendingCheck(blocks, flags, actual, newest.view(torch.uint64))

    def verdicts(self, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Device path: a step's load check's verdicts (exact, approx), on the device: counted
        with the step's output when the check is settled (KVGuardWorkerMetadata.settle)."""
        return self._verdicts.get(step)

    def check_read(self, step: int, bad: set[int], blocks: list[int]) -> None:
        """Device path: a step's load check was read (in the worker): a bad load owes the next
        loads an audit; the pages verified by their sketch alone are never kept as a reference."""
        if bad:
            self.audit.error()
        verdicts = self._verdicts.pop(step, None)
        if verdicts is None:
            return
        approx = verdicts[1].cpu().tolist()
        near = {b for b, a in zip(blocks, approx, strict=True) if a}
        if near:
            self.drop(near)

    # ------------------------------------------------------------- after the seal

    def remember(self, meta: KVGuardMetadata) -> None:
        """Keep the digests of the pages sealed this step under what they hold (on the device
        path: a copy started now, taken into the store by :meth:`settle`)."""
        assert meta.sealed_identity is not None
        blocks, fingerprints = meta.sealed_identity
        sealed = self.table.sealed[blocks]
        if self.not_reference:
            sealed &= ~np.isin(blocks, list(self.not_reference))
        blocks, fingerprints = blocks[sealed], fingerprints[sealed]
        if not len(blocks):
            return
        sketches = self.sketcher.compute(blocks)
        if not isinstance(self.table, DeviceDigestTable):
            digests = self.table.digests[blocks]
            self._keep(fingerprints, digests, sketches.cpu().numpy())
            return
        table = self.table.device_digests.view(torch.int64)
        ids = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64))
        event = None
        if table.device.type == "cuda":
            ids = ids.pin_memory().to(table.device, non_blocking=True)
            gathered = table.index_select(0, ids)
            host = torch.empty(gathered.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            host_sketches = torch.empty(sketches.shape, dtype=torch.float32, pin_memory=True)
            host_sketches.copy_(sketches, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, host_sketches = table.index_select(0, ids), sketches
        self._sealed.append(_SealedOnDevice(meta.step, blocks, fingerprints, host, host_sketches, event))

    def _keep(self, fingerprints: np.ndarray, digests: np.ndarray, sketches: np.ndarray) -> None:
        for d in self.digests.remember(fingerprints, digests, sketches).max(axis=1, initial=0.0).tolist():
            self.counters.observe("recompute_distance", d)
        if self.store is not None:
            self.store.publish(fingerprints, digests, sketches)
        if self._audited:
            self._compare_audits(fingerprints, sketches)

    # ------------------------------------------------------------- audits

    def _choose_audits(
        self, blocks: np.ndarray, fingerprints: np.ndarray, unknown: list[int], meta: KVGuardMetadata
    ) -> None:
        """Which of this step's unverifiable loads are audited (core/audit.py): a load is one
        request's run of them (by its first reader), refused whole: vLLM computes the request
        again from its first refused page, so no token of it comes from a page nobody checked
        (the audit costs the run's tokens), and every page of it is compared."""
        if self.audit.rate <= 0:
            return
        runs: list[list[int]] = []
        last_reader = None
        for i in unknown:
            block = int(blocks[i])
            reader = (meta.load_readers.get(block) or [""])[0]
            if not runs or reader != last_reader or i != runs[-1][-1] + 1:
                runs.append([])
            runs[-1].append(i)
            last_reader = reader
        for run in runs:
            if not (self.audit.distrusted or self.audit.choose()):
                continue
            for i in run:
                block = int(blocks[i])
                self.refused[block] = (int(fingerprints[i]), tuple(meta.load_readers.get(block, ())))
        self.failed |= set(self.refused)

    def take_audits(self) -> set[int]:
        """After the forward (every layer landed): the sketches of this step's refused pages, kept
        until their recomputation is sealed; returns them (reported unreadable by the worker)."""
        if not self.refused:
            return set()
        blocks = list(self.refused)
        sketches = self.sketcher.compute(blocks).cpu().numpy()
        for block, sketch in zip(blocks, sketches, strict=True):
            fp, readers = self.refused[block]
            if fp:
                self._audited[fp] = (sketch, block, readers)
        while len(self._audited) > AUDITS_KEPT:
            del self._audited[next(iter(self._audited))]
        self._out().audits.update(blocks)
        return set(blocks)

    def _compare_audits(self, fingerprints: np.ndarray, sketches: np.ndarray) -> None:
        """Pages sealed now whose loaded copy was refused for an audit: the same, within the
        sketch's tolerance, or the connector served wrong KV."""
        fps = fingerprints.tolist()
        # (Entries of requests that ended before their recomputation stay until pushed out: only
        # the fingerprints sealed now that are awaited are looked at, not each one in Python.)
        for fp in self._audited.keys() & set(fps):
            loaded, block, readers = self._audited.pop(fp)
            kept = torch.from_numpy(np.ascontiguousarray(sketches[fps.index(fp)], dtype=np.float32))
            got = torch.from_numpy(loaded)
            if bool(matches(got, kept).all()):
                self.counters.add("load_audits", label="match")
                continue
            self.counters.add("load_audits", label="mismatch")
            far = float(np.nan_to_num(distance(got, kept).amax().numpy(), nan=np.inf))
            self._out().audits_failed.append((block, readers, far))
            self.audit.error()
            self.audit.distrust()

    def drop(self, blocks: set[int]) -> None:
        """Device path: pages a settled check found bad since they were sealed (a bad load, rows
        that changed before the seal) are never kept as a reference."""
        for sealed in self._sealed:
            keep = ~np.isin(sealed.blocks, list(blocks))
            if not keep.all():
                sealed.blocks, sealed.fingerprints = sealed.blocks[keep], sealed.fingerprints[keep]
                sealed.digests = sealed.digests[torch.from_numpy(keep)]
                sealed.sketches = sealed.sketches[torch.from_numpy(keep)]

    def settle(self, *, wait: bool, before: int | None) -> None:
        """Device path: take the sealed digests whose copy has landed (all of them, waiting, with
        ``wait``) into the store, in step order, but only steps older than ``before`` (the oldest
        step with a check still unread: it may yet find one of them bad)."""
        while self._sealed:
            sealed = self._sealed[0]
            if before is not None and sealed.step >= before:
                return
            if not wait and not sealed.ready():
                return
            if sealed.event is not None:
                sealed.event.synchronize()
            self._sealed.pop(0)
            self._keep(sealed.fingerprints, sealed.digests.numpy().view(np.uint64), sealed.sketches.numpy())

    # ------------------------------------------------------------- drills

    def _faults_unchecked(self, meta: KVGuardMetadata) -> None:
        """Drill: ``load`` faults on a step whose loads cannot be checked here change nothing."""
        for injection in meta.inject:
            if injection.at == FaultSite.LOAD:
                self._out().unchanged_faults.append(injection.fault_id)

    def _inject(self, layer: int, meta: KVGuardMetadata) -> None:
        """Drill: a ``load`` fault corrupts its page in this layer after the load landed, just
        before the check (the page reversed in its last axis, as KV restored permuted)."""
        for injection in meta.inject:
            if injection.at != FaultSite.LOAD or injection.layer % self.pages.num_layers != layer:
                continue
            if injection.rank is not None and injection.rank != self.rank:
                continue
            page = self.pages.page(injection.block_id, layer)
            before = self.pages.digest_layer(layer, [injection.block_id])
            page.copy_(page.flip(-1))
            changed = self.pages.digest_layer(layer, [injection.block_id]) != before
            if not changed or injection.block_id not in self.blocks:
                # Unchanged, or a page that could not be checked (no digest for it here).
                self._out().unchanged_faults.append(injection.fault_id)
