"""The worker's state, and what its checks share: its output to the scheduler, internal
errors, and the diagnosis of a page that failed its seal (shape, where, repair).

The worker is one class (:class:`~vllm_kvguard.connector.worker.KVGuardWorker`) built from
one module per concern, each a layer over this one: :mod:`.device_checks` (checks read back
with the step's output), :mod:`.row_checks` (unfilled pages' rows), :mod:`.sealing` (after the
forward), :mod:`.drills` (fire-drill faults) and :mod:`.worker` (vLLM's hooks, in call order).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_kvguard.config import KVGuardConfig, Mode
from vllm_kvguard.connector.layout import WrittenRows
from vllm_kvguard.connector.loaded import LoadedPages
from vllm_kvguard.connector.metadata import (
    DeviceCheck,
    DeviceRowCheck,
    KVGuardMetadata,
    KVGuardWorkerMetadata,
)
from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.core.shapes import classify
from vllm_kvguard.digest.pages import KVPages
from vllm_kvguard.digest.rows import RowDigests
from vllm_kvguard.digest.syndrome import locate, page_words, syndromes
from vllm_kvguard.digest.table import DeviceDigestTable, DigestTable
from vllm_kvguard.logs import GuardLog


class WorkerState:
    """The worker side's state, shared by every layer of the worker (module docstring)."""

    def __init__(
        self,
        config: KVGuardConfig,
        num_blocks: int,
        rank: int,
        log: GuardLog,
        *,
        block_size: int = 0,
        weights: int = 0,
    ) -> None:
        self.config = config
        self.block_size = block_size
        # The weights' identity (digest/weights.py): the digest folder's namespace.
        self.weights = weights
        self.rows: RowDigests | None = None
        self.written: WrittenRows | None = None
        self.rows_as_written = 0  # rows digested from the bytes written (tests, benchmarks)
        self._read_partial: list[int] = []
        # Pages found changed at fill and never sealed (where they changed), until reused.
        self._tainted: dict[int, dict[str, object]] = {}
        # Drill: rows a lost_write fault puts back after the forward, by fault id.
        self._unlanded: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        self.rank = rank
        self.log = log
        self.internal_errors = 0
        # Time spent inside the guard's hooks (its own cost), and the worker's step time.
        self.hook_seconds = 0.0
        self._step_start: float | None = None
        self._num_blocks = num_blocks
        self.pages: KVPages | None = None
        self._every_layer: frozenset[int] = frozenset()
        self.table: DigestTable | None = None
        self._meta: KVGuardMetadata | None = None
        self._out: KVGuardWorkerMetadata | None = None
        self._invalid: set[int] = set()
        self.counters = GuardCounters()
        self._state_reported_at = 0.0
        self._layer_index: dict[str, int] = {}
        # Layers whose sampled or paranoid reads this step has yet to verify (empty on most
        # steps: the facade's wait_for_layer_load then returns without its hook's timing).
        self.reads_left: set[int] = set()
        self._read_blocks: list[int] = []
        # Per layer, the seals of _read_blocks (host table), as Python ints.
        self._read_expected: list[list[int]] = []
        self._read_seconds = 0.0
        # Device checks whose worker-side effect (forgetting bad seals) has not run yet;
        # the step's checks also travel in the worker metadata, settled with its output.
        self._unsettled: list[DeviceCheck | DeviceRowCheck] = []
        # Beside another KV connector: reference digests by page identity, this step's loads
        # (connector/loaded.py); made on the first step that loads or seals with identities.
        self.loaded: LoadedPages | None = None
        # Layers whose loaded pages this step has yet to check (host path; usually empty): the
        # loaded pages' own set once there are any.
        self.loads_left: set[int] = set()
        # Held finished requests whose pages this step verifies: reported done (get_finished).
        self._released: set[str] = set()

    def internal_error(self, where: str, exc: Exception) -> None:
        """A hook failed (fail-open): logged here, counted by the scheduler."""
        self.internal_errors += 1
        self.log.internal_error(where, exc, self.internal_errors)
        self._worker_meta().internal_errors.append(f"{where}: {exc!r}")

    def _worker_meta(self) -> KVGuardWorkerMetadata:
        if self._out is None:
            self._out = KVGuardWorkerMetadata()
        return self._out

    def _loaded_pages(self) -> LoadedPages:
        assert self.pages is not None and self.table is not None
        if self.loaded is None:
            self.loaded = LoadedPages(
                self.config, self.rank, self.pages, self.table, self.counters, self._worker_meta, self.weights
            )
            # One attribute test per attention layer (the facade's wait_for_layer_load).
            self.loads_left = self.loaded.left
        return self.loaded

    def _diagnose(
        self, block: int, layer: int, expected: int, actual: int
    ) -> tuple[str, dict[str, object], bool]:
        """The shape of a page that failed its seal (core/shapes.py), where it changed, and
        whether it was mended in place: a one-word change located by the page's syndrome,
        confirmed against the seal on a host copy first, and repaired (host path, quarantine
        mode, ``VLLM_KVGUARD_REPAIR``) only if the live page then matches its seal. The rare
        path: one page copied to the host."""
        assert self.pages is not None and self.table is not None
        device = str(self.pages.tensors[layer].device)
        pages, table = self.pages, self.table
        page = pages.host_page(block, layer)
        raw = page.view(torch.uint8).reshape(-1).numpy()
        _, previous, sealed_syndrome = table.seal_record(block, layer)
        copy_of = table.sealed_matching(layer, actual, block)
        where: dict[str, object] = {"device": device, "page_shape": list(page.shape)}
        if copy_of is not None:
            where["source_block"] = copy_of
        now = syndromes(raw[None])[0][: len(sealed_syndrome)]
        # Confirmed against the seal below, so a missing syndrome (all zero) cannot mislead.
        found = locate(sealed_syndrome, now, page_words(raw))
        confirmed = repaired = False
        if found is not None:
            mended = page_words(raw).copy()
            mended[found.word] = np.uint64(found.old)
            back = (
                torch.from_numpy(mended.view(np.uint8)[: len(raw)].copy())
                .view(page.dtype)
                .reshape(page.shape)
            )
            confirmed = pages.digest_of(layer, back) == expected
        if confirmed and found is not None:
            element = 8 * found.word // page.element_size()
            where |= {
                "word": found.word,
                "element": [int(i) for i in np.unravel_index(element, tuple(page.shape))],
                "flipped_bits": f"{found.flipped:016x}",
                "bits": [b for b in range(64) if found.flipped >> b & 1],
            }
            # Device path: diagnosed a step late (the forward has read the page; vLLM recomputes).
            host_path = not isinstance(table, DeviceDigestTable)
            if host_path and self.config.mode == Mode.QUARANTINE and self.config.repair:
                pages.write_word(block, layer, found.word, found.old)
                repaired = int(pages.digest([block])[0, layer]) == expected
                if not repaired:  # never leave the page in a third state
                    pages.write_word(block, layer, found.word, found.new)
        shape = classify(
            zeroed=not raw.any(),
            nonfinite=page.is_floating_point() and not bool(torch.isfinite(page).all()),
            copy_of=copy_of,
            stale=previous not in (0, expected) and previous == actual,
            single_word=confirmed,
            single_bit=found is not None and found.single_bit,
        )
        return str(shape), where, repaired
