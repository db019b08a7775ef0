"""The worker side of the guard: seal pages after the forward, verify them before it reads.

One instance per worker process (tensor/pipeline rank), behind the
:class:`~vllm_kvguard.connector.facade.KVGuardConnector` facade. Per step, in vLLM's
call order: ``bind_connector_metadata`` (before the forward: forget digests of
re-allocated blocks, verify prefix-cache hits and scrub pages), ``wait_for_layer_load``
per attention layer (verify the pages running requests read: sampled or paranoid),
``finish_forward`` (layers whose hook did not run), ``wait_for_save`` (after the
forward: seal pages whose last slot was written, drill faults),
``get_block_ids_with_load_errors`` (bad blocks to vLLM) and
``build_connector_worker_meta`` (detections and counters to the scheduler).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_kvguard.config import HashAlgorithm, Mode, VerifyPolicy
from vllm_kvguard.connector.drills import Drills
from vllm_kvguard.connector.layout import row_digests
from vllm_kvguard.connector.metadata import KVGuardMetadata, KVGuardWorkerMetadata
from vllm_kvguard.connector.sealing import Sealing
from vllm_kvguard.core.events import Detection, GuardStarted
from vllm_kvguard.core.faults import FaultSite
from vllm_kvguard.digest.device_rows import DeviceRowDigests, RowCheck
from vllm_kvguard.digest.kernel import kernel_available
from vllm_kvguard.digest.pages import KVPages
from vllm_kvguard.digest.table import DeviceDigestTable, DigestTable


class KVGuardWorker(Sealing, Drills):
    """The guard in one worker process: vLLM's hooks, in its call order (module docstring)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        # The block dimension is the one sized num_blocks: 0 on CPU, 1 for the
        # (2, num_blocks, ...) GPU layouts.
        block_dim = next((d for d, n in enumerate(first.shape) if n == self._num_blocks and d < 2), 0)
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
        self._every_layer = frozenset(range(self.pages.num_layers))
        by_storage = {t.data_ptr(): i for i, t in enumerate(self.pages.tensors)}
        self._layer_index = {
            name: by_storage[t.movedim(block_dim, 0).data_ptr()]
            for name, t in kv_caches.items()
            if t.movedim(block_dim, 0).data_ptr() in by_storage
        }
        self.table = (
            DeviceDigestTable(self.pages)
            if self.pages.deferred
            else DigestTable(self.pages.num_blocks, self.pages.num_layers, self.pages.syndrome_words)
        )
        rows = self._row_digests(kv_caches, first_t)
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
                    "row_digests": rows,
                },
            ),
            # The scheduler's line shows the settings; the worker's console line its own details.
            console_skip=("config",),
        )

    def _row_digests(self, kv_caches: dict[str, torch.Tensor], first: torch.Tensor) -> str:
        """Set up row digests (digest/rows.py) for this KV layout; returns what the start-up
        line says about them."""
        assert self.pages is not None
        self.rows, self.written, how = row_digests(
            self.config, self.pages, first, self.block_size, self._observe_write
        )
        return how

    def _observe_write(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """After vLLM's CPU write op (patches.observe_cpu_kv_writes): keep the rows it was given.
        Never raises into the forward: an error is logged and counted, and the step's rows are
        read back from the pages instead."""
        written = self.written
        if written is None or not written.open:
            return
        start = time.perf_counter()
        try:
            written.observe(key, value, key_cache, slot_mapping)
        except Exception as exc:
            written.broken = True
            self.internal_error("kv_write", exc)
        finally:
            # Inside the forward, but the guard's own time all the same.
            self.hook_seconds += time.perf_counter() - start

    # ------------------------------------------------------------ before the forward

    def bind_connector_metadata(self, meta: KVGuardMetadata | None) -> None:
        self._step_start = time.perf_counter()
        self._meta = meta
        if meta is not None and meta.release:
            # Done this step whatever happens below (a failed check fails open): vLLM keeps a
            # held request's blocks, and steps, until it is reported.
            self._released |= set(meta.release)
        if self.table is None or meta is None:
            return
        if self._unsettled or (self.loaded is not None and self.loaded.copying):
            self._apply_settled(wait=False)
        plan = meta.plan
        if self.rows is not None:
            # Before the forward: blocks handed to new owners keep their rows as the previous
            # generation's; the rows this forward writes are recorded after it (wait_for_save).
            if plan.given:
                self.rows.roll(plan.given)
            if self._tainted:
                for block in plan.given:
                    self._tainted.pop(block, None)
                self._tainted_hits(meta)
            if meta.inject:
                self._snapshot_lost(meta)
            if len(plan.written_blocks):
                self.rows.clear(plan.written_blocks, plan.written_slots)
                if self.written is not None:
                    self.written.begin()
        if meta.zero:
            assert self.pages is not None
            self.pages.zero(meta.zero)
            self.table.forget(meta.zero)
            if self.rows is not None:
                self.rows.forget(meta.zero)
        # Before the forward: this step's prefix hits are read by its attention.
        if plan.forget:
            self.table.forget(plan.forget)
        if isinstance(self.table, DeviceDigestTable) and (plan.verify or meta.scrub or meta.finish):
            self._verify_on_device(meta)
        else:
            if plan.verify:
                self._verify(meta, plan.verify, "reuse")
            if meta.scrub:
                self._verify(meta, meta.scrub, "scrub")
            if meta.finish:
                self._verify(meta, meta.finish, "finish")
        if self.rows is not None and meta.scrub_filling:
            self._verify_rows(meta, meta.scrub_filling, "scrub")
        if self.rows is not None and meta.finish_filling:
            self._verify_rows(meta, meta.finish_filling, "finish")
        if meta.invalidate and self.config.mode != Mode.LOG:
            self._invalid.update(meta.invalidate)
            self.table.forget(meta.invalidate)
            if self.rows is not None:
                self.rows.forget(meta.invalidate)
        self.reads_left = set()
        if self.loaded is not None:
            self.loaded.new_step()
        if meta.loaded is not None:
            self._begin_loads(meta)
        self._read_partial = plan.read_partial if self.rows is not None else []
        if self._read_partial and not plan.read_verify:
            assert self.pages is not None
            self.reads_left = set(self._every_layer)
            self._read_blocks = []
            self._read_expected = [[] for _ in range(self.pages.num_layers)]
            self._read_seconds = 0.0
        if plan.read_verify:
            assert self.pages is not None
            self.reads_left = set(self._every_layer)
            # Resolved once per step (blocks, their seals), reused by every layer's hook.
            if isinstance(self.table, DeviceDigestTable):
                self._read_blocks = self.table.sealed_only(plan.read_verify)
            else:
                self._read_blocks, self._read_expected = self.table.read_seals(plan.read_verify)
            self._read_seconds = 0.0
            self.counters.add("verified", len(self._read_blocks), label=meta.read_trigger)

    # ------------------------------------------------------------- loaded pages

    def _begin_loads(self, meta: KVGuardMetadata) -> None:
        """Pages another connector loads for this step (connector/loaded.py). The device path
        first takes every digest sealed so far into the store (a wait only on steps with loads)."""
        loaded = self._loaded_pages()
        if loaded.on_device:
            self._apply_settled(wait=True)
        loaded.begin(meta)

    def _check_loads(self, layers: list[int]) -> None:
        """Host path: the loaded pages of ``layers``; when all are checked, the bad ones are
        reported unreadable (outside log mode) so that vLLM recomputes their readers."""
        assert self.loaded is not None and self._meta is not None
        bad = self.loaded.check(layers, self._meta)
        if bad and self.config.mode != Mode.LOG:
            self._invalid |= bad

    def _verify(self, meta: KVGuardMetadata, block_ids: list[int], trigger: str) -> None:
        assert self.pages is not None and self.table is not None
        start = time.perf_counter()
        blocks = self.table.sealed_only(block_ids)
        mismatches = self.table.compare(blocks, self.pages.digest(blocks), self.pages.names)
        out = self._worker_meta()
        out.verified_steps.add(meta.step)
        self.counters.add("verified", len(blocks), label=trigger)
        self.counters.add("bytes_hashed", len(blocks) * self.pages.bytes_per_block, label="verify")
        self.counters.observe("verify_seconds", time.perf_counter() - start)
        unmended: set[int] = set()
        for m in mismatches:
            layer = self.pages.names.index(m.layer)
            shape, where, repaired = self._diagnose(m.block_id, layer, m.expected, m.actual)
            if not repaired:
                unmended.add(m.block_id)
            out.detections.append(
                Detection(
                    self.rank,
                    m.block_id,
                    m.layer,
                    m.expected,
                    m.actual,
                    tuple(meta.plan.readers.get(m.block_id, ())),
                    trigger,
                    meta.step,
                    shape=shape,
                    where=where,
                    repaired=repaired,
                )
            )
        if unmended and self.config.mode != Mode.LOG:
            self._invalid |= unmended
            # The readers recompute these blocks; their old digests mean nothing now.
            self.table.forget(sorted(unmended))

    # ------------------------------------------------------------- during the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Called per attention layer after this step's KV write and before attention
        # reads the cache: verify the sealed pages the step reads, for this layer.
        if self.loads_left:
            at = self._layer_index.get(layer_name)
            if at is not None and at in self.loads_left:
                self._check_loads([at])
        if not self.reads_left:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None or layer not in self.reads_left:
            return
        if self.config.verify == VerifyPolicy.PARANOID:
            # Each layer right before its own read.
            self.reads_left.discard(layer)
            self._verify_reads([layer])
        else:
            # Sampled: every layer in one call at the first attention layer; one pass
            # between layers costs far less than one per layer (docs/performance.md).
            layers, self.reads_left = sorted(self.reads_left), set()
            self._verify_reads(layers)

    def _verify_reads(self, layers: list[int]) -> None:
        assert self.pages is not None and self.table is not None and self._meta is not None
        meta = self._meta
        if self._read_partial:
            partial, self._read_partial = self._read_partial, []
            self._verify_rows(meta, partial, meta.read_trigger or str(self.config.verify))
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
        if not self.reads_left:
            # Last layer of the step: account once per step, not once per layer.
            self.counters.add("bytes_hashed", self.pages.bytes_per_block * len(blocks), label="verify")
            self.counters.observe("verify_seconds", self._read_seconds)
        if bad and self.config.mode != Mode.LOG:
            self._invalid |= bad
            self.table.forget(sorted(bad))

    def _compare_reads(self, meta: KVGuardMetadata, layers: list[int], blocks: list[int]) -> set[int]:
        """Host path: hash the read pages of ``layers`` and compare with their seals now."""
        assert self.pages is not None
        bad: set[int] = set()
        for layer in layers:
            actual = self.pages.digest_layer(layer, blocks)
            expected = self._read_expected[layer]
            if actual == expected:
                continue
            for row in [i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]:
                shape, where, repaired = self._diagnose(blocks[row], layer, expected[row], actual[row])
                if not repaired:
                    bad.add(blocks[row])
                self._worker_meta().detections.append(
                    Detection(
                        self.rank,
                        blocks[row],
                        self.pages.names[layer],
                        expected[row],
                        actual[row],
                        (),
                        meta.read_trigger,
                        meta.step,
                        shape=shape,
                        where=where,
                        repaired=repaired,
                    )
                )
        return bad

    def finish_forward(self) -> None:
        """Layers whose attention hook did not run: skipped without attention metadata, or
        the whole forward replayed as one CUDA graph (no per-layer Python hooks)."""
        if self.reads_left and self._meta is not None:
            layers, self.reads_left = sorted(self.reads_left), set()
            self._verify_reads(layers)

    # ------------------------------------------------------------- after the forward

    def wait_for_save(self) -> None:
        meta = self._meta
        if self.table is None or self.pages is None or meta is None:
            return
        self.finish_forward()
        loaded = self.loaded
        if loaded is not None and loaded.left:  # layers whose hook did not run: checked now
            self._check_loads(sorted(loaded.left))
        elif loaded is not None and loaded.on_device and loaded.blocks:
            # Before the seal in stream order; read with the step's output (connector/loaded.py).
            deferred = self._defer(
                loaded.check_on_device(meta),
                "external_load",
                meta.step,
                meta.load_readers,
                "checksum_mismatch",
                where={"device": str(self.pages.tensors[0].device)},
            )
            if deferred is not None:
                deferred.verdicts = loaded.verdicts(meta.step)
        if loaded is not None and loaded.refused:  # audits: recomputed, compared when sealed again
            self._invalid |= loaded.take_audits()
        seal = meta.plan.seal
        if loaded is not None and loaded.failed:  # a bad load is never sealed; its readers recompute it
            seal = [b for b in seal if b not in loaded.failed]
        # After the forward: the pages whose last slot was written this step are final.
        at_rest, filling = [], []
        for injection in meta.inject:
            if injection.rank is not None and injection.rank != self.rank:
                continue  # another worker's fault (rank=N): this worker's copy stays intact
            if injection.at == FaultSite.WRITE:
                self._inject(injection)
            elif injection.at == FaultSite.FORWARD:
                self._unland(meta, injection)
            elif injection.at == FaultSite.FILLING:
                filling.append(injection)
            elif injection.at == FaultSite.REST:
                at_rest.append(injection)
        void: RowCheck | None = None
        earlier: np.ndarray | None = None
        if isinstance(self.rows, DeviceRowDigests):
            void = self._rows_on_device(meta, seal)
        elif self.rows is not None:
            seal, earlier = self._rows_after_forward(meta, seal)
        for injection in filling:
            if not self._corrupt_rows(injection):
                self._worker_meta().unchanged_faults.append(injection.fault_id)
        if seal and isinstance(self.table, DeviceDigestTable):
            check_finite = self.config.nonfinite_mode is not None
            if check_finite and meta.inject:
                self._worker_meta().verified_steps.add(meta.step)
            check = self.table.seal_async(
                seal,
                check_finite=check_finite,
                zero_nonfinite=check_finite and self.config.nonfinite_mode != Mode.LOG,
                void=(void.blocks, void.flagged) if void is not None else None,
            )
            self._defer(check, "seal", meta.step, {}, "nonfinite")
            self.counters.add("bytes_hashed", len(seal) * self.pages.bytes_per_block, label="seal")
        elif earlier is not None:  # (only where there are pages to seal)
            self._seal_host_pages(meta, seal, earlier)
        elif seal:
            # One gather of the pages being sealed for both the NaN/Inf test and the syndromes.
            flags, facts = self.pages.seal_facts(seal, check_finite=self.config.nonfinite_mode is not None)
            self._seal_host(meta, seal, flags, facts, None)
        if meta.sealed_identity is not None:
            self._loaded_pages().remember(meta)
        for injection in at_rest:
            if not self._inject(injection):
                self._worker_meta().unchanged_faults.append(injection.fault_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid = self._invalid, set()
        return bad

    def take_released(self) -> set[str]:
        """The finished requests this step's finish check covered (connector/finish.py)."""
        released, self._released = self._released, set()
        return released

    def build_connector_worker_meta(self) -> KVGuardWorkerMetadata | None:
        start = self._step_start
        if start is not None:
            self.counters.add("step_seconds", time.perf_counter() - start)
            self.counters.add("guard_seconds", self.hook_seconds, label="worker")
            self.hook_seconds, self._step_start = 0.0, None
            now = time.monotonic()
            if self.table is not None and now - self._state_reported_at >= 1.0:
                self._state_reported_at = now
                rows = self.rows.nbytes() if self.rows is not None else 0
                loads = self.loaded.nbytes() if self.loaded is not None else 0
                self.counters.set("state_bytes", self.table.nbytes() + rows + loads, label="worker")
        if start is not None or not self.counters.empty():  # (a step's counters hold its time: not empty)
            self._worker_meta().counters = self.counters.take()
        # Device checks are read back after vLLM waits for the step's output, not here
        # (no added sync): they ride in the metadata unsettled.
        out, self._out = self._out, None
        return out

    def clear_connector_metadata(self) -> None:
        # vLLM clears the step's metadata after the step; a hook called without a new one
        # (wait_for_save on a step the scheduler sent nothing for) must not replay it.
        self._meta = None

    # ---------------------------------------------------------------- sleep mode

    def unregister_kv_caches(self) -> None:
        """vLLM's sleep mode discards the KV cache: no seal describes the pages after wake-up."""
        if self.table is not None:
            self._apply_settled(wait=True)
            dropped = int(self.table.sealed.sum())
            self.table.forget(np.flatnonzero(self.table.sealed).tolist())
            if self.rows is not None:
                self.rows.reset()
            self.log.line("kvguard_seals_dropped", reason="kv_cache_unregistered", pages=dropped)
