"""Digest tables: the seals, kept beside the KV data and never in it (as ZFS keeps
checksums in the parent pointer). :class:`DigestTable` on the host; :class:`DeviceDigestTable`
on the device beside the KV cache, sealing and verifying in one kernel launch per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvguard.digest import kernel
from vllm_kvguard.digest.checks import PendingCheck
from vllm_kvguard.digest.kernel import SEAL, VERIFY
from vllm_kvguard.digest.pages import KVPages
from vllm_kvguard.digest.syndrome import SYNDROME_WORDS


@dataclass(frozen=True)
class PageMismatch:
    """A page whose bytes no longer match its seal."""

    block_id: int
    layer: str
    expected: int
    actual: int


class DigestTable:
    """Sealed digests by block: a dense (blocks x layers) table plus a sealed mask, each seal's
    syndrome (:mod:`.syndrome`: where a one-word change is), and the digest of the block's
    previous seal (a page that reverts to it lost a write)."""

    def __init__(self, num_blocks: int, num_layers: int, syndrome_words: int = SYNDROME_WORDS) -> None:
        self.digests = np.zeros((num_blocks, num_layers), dtype=np.uint64)
        self.previous = np.zeros((num_blocks, num_layers), dtype=np.uint64)
        self.syndromes = np.zeros((num_blocks, num_layers, syndrome_words), dtype=np.uint64)
        self.sealed = np.zeros(num_blocks, dtype=bool)

    def nbytes(self) -> int:
        """Bytes of the table's arrays, host and device (fixed at start)."""
        return sum(
            v.nbytes if isinstance(v, np.ndarray) else v.numel() * v.element_size()
            for v in vars(self).values()
            if isinstance(v, np.ndarray | torch.Tensor)
        )

    def seal(
        self, block_ids: Sequence[int], digests: np.ndarray, syndromes: np.ndarray | None = None
    ) -> None:
        if len(block_ids):
            ids = np.asarray(block_ids, dtype=np.int64)  # (once: not one conversion per table)
            self.previous[ids] = self.digests[ids]
            self.digests[ids] = digests
            if syndromes is not None:
                self.syndromes[ids] = syndromes
            self.sealed[ids] = True

    def seal_record(self, block_id: int, layer: int) -> tuple[int, int, np.ndarray]:
        """(digest, previous digest, syndrome) of one page's seal, on the host (the rare path)."""
        return (
            int(self.digests[block_id, layer]),
            int(self.previous[block_id, layer]),
            self.syndromes[block_id, layer].copy(),
        )

    def sealed_matching(self, layer: int, digest: int, exclude: int) -> int | None:
        """Another sealed block whose page in ``layer`` has this digest (a misdirected copy's
        source), or None."""
        hits = np.flatnonzero((self.digests[:, layer] == np.uint64(digest)) & self.sealed)
        hits = hits[hits != exclude]
        return int(hits[0]) if len(hits) else None

    def forget(self, block_ids: Sequence[int]) -> None:
        if len(block_ids):
            self.sealed[block_ids] = False

    def host_digests(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The seals of the given blocks, (blocks x layers) uint64 on the host (tests, tools)."""
        return self.digests[np.asarray(block_ids, dtype=np.int64)]

    def sealed_only(self, block_ids: Sequence[int]) -> list[int]:
        if not len(block_ids):
            return []
        ids = np.asarray(block_ids, dtype=np.int64)
        return ids[self.sealed[ids]].tolist()

    # Up to this many pages, read_seals looks them up in Python (a sampled step reads one or
    # two: a handful of numpy calls costs more after a forward).
    FEW_READS = 8

    def read_seals(self, block_ids: Sequence[int]) -> tuple[list[int], list[list[int]]]:
        """The sealed ones of ``block_ids`` and, per layer, their seals as Python ints (a
        step's reads are compared with them in Python: KVGuardWorker._compare_reads)."""
        if len(block_ids) > self.FEW_READS:
            blocks = self.sealed_only(block_ids)
            return blocks, self.digests[blocks].T.tolist()
        sealed, digests = self.sealed, self.digests
        blocks = [b for b in block_ids if sealed[b]]
        if not blocks:
            return [], [[] for _ in range(digests.shape[1])]
        return blocks, [list(c) for c in zip(*(digests[b].tolist() for b in blocks), strict=True)]

    def compare(
        self, block_ids: Sequence[int], actual: np.ndarray, names: Sequence[str]
    ) -> list[PageMismatch]:
        """Mismatches between ``actual`` (from :meth:`KVPages.digest`) and the seals."""
        if not len(block_ids):
            return []
        expected = self.digests[block_ids]
        rows, cols = np.nonzero(expected != actual)
        return [
            PageMismatch(int(block_ids[r]), names[c], int(expected[r, c]), int(actual[r, c]))
            for r, c in zip(rows.tolist(), cols.tolist(), strict=True)
        ]


class DeviceDigestTable(DigestTable):
    """The seals on the device beside the KV cache; the sealed mask stays on the host.

    Sealing stores the kernel's digests straight into the table and verifying
    compares against it in the same launch (kernel.py), so neither moves a digest
    to the host or waits: each returns a :class:`PendingCheck`.
    """

    def __init__(self, pages: KVPages) -> None:
        assert pages.geometry is not None
        super().__init__(0, pages.num_layers)
        self.pages = pages
        self.sealed = np.zeros(pages.num_blocks, dtype=bool)
        # uint64 for the kernel; every torch op on it goes through an int64 view (torch's
        # uint64 lacks most ops on CUDA).
        self.device_digests = torch.zeros(
            (pages.num_blocks, pages.num_layers), dtype=torch.int64, device=pages.geometry.device
        ).view(torch.uint64)
        # Beside each seal, on the device: the previous generation's digest and the syndrome
        # (int64 views: torch's uint64 lacks the index ops), read only when a page goes bad.
        shape = (pages.num_blocks, pages.num_layers)
        self.device_previous = torch.zeros(shape, dtype=torch.int64, device=pages.geometry.device)
        self.device_syndromes = torch.zeros(
            (*shape, pages.syndrome_words), dtype=torch.int64, device=pages.geometry.device
        )
        # Syndromes stored by the seal launch itself, in its one pass over the bytes, where the
        # page layout allows (kernel.py, PageGeometry.syndrome_block); else a torch pass first.
        self.fused_syndromes = pages.geometry.syndrome_block(kernel.SEAL_BLOCK_WORDS) is not None

    def _ids(self, block_ids: Sequence[int]) -> tuple[np.ndarray, torch.Tensor]:
        """The block ids on the host (numpy) and on the device (copied without a wait).
        Through numpy: torch.tensor of a list is 3x slower (about 0.4 ms for 4,096 ids)."""
        host = np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))
        ids = torch.from_numpy(host)
        device = self.device_digests.device
        return host, ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids

    def seal_async(
        self,
        block_ids: Sequence[int],
        *,
        check_finite: bool = False,
        zero_nonfinite: bool = False,
        void: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PendingCheck | None:
        """Seal the pages; flags NaN/Inf when ``check_finite`` (else nothing to read back).

        ``void``: (block id, flagged) of rows checked on the device just before (row digests,
        :class:`DeviceRowDigests`): a page with a flagged row gets a seal its bytes cannot match (its
        digest inverted), in stream order, so any read of it before the host learns of the
        finding fails verification instead of passing against a seal taken over changed data."""
        if not len(block_ids):
            return None
        geometry = self.pages.geometry
        assert geometry is not None
        host, ids = self._ids(block_ids)
        # In stream order, before the launch overwrites the seals.
        self.device_previous.index_copy_(0, ids, self.device_digests.view(torch.int64).index_select(0, ids))
        if not self.fused_syndromes:
            self.device_syndromes.index_copy_(0, ids, self.pages.syndromes_on_device(ids))
        digests, flags = geometry.launch(
            ids,
            mode=SEAL,
            table=self.device_digests,
            check_finite=check_finite,
            zero_nonfinite=zero_nonfinite,
            syndromes=self.device_syndromes if self.fused_syndromes else None,
        )
        if void is not None:
            self._void(ids, *void)
        self.sealed[host] = True
        return PendingCheck(block_ids, flags, digests, None) if check_finite else None

    def _void(self, ids: torch.Tensor, row_blocks: torch.Tensor, flagged: torch.Tensor) -> None:
        hits = torch.zeros(self.pages.num_blocks, dtype=torch.int32, device=ids.device)
        hits.index_add_(0, row_blocks, flagged.to(torch.int32))
        voided = hits.index_select(0, ids) > 0
        table = self.device_digests.view(torch.int64)
        seals = table.index_select(0, ids)
        table.index_copy_(0, ids, torch.where(voided[:, None], ~seals, seals))

    def verify_async(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> PendingCheck:
        """Compare the pages with their seals on the device (all layers, or ``layers``)."""
        _, ids = self._ids(block_ids)
        assert self.pages.geometry is not None
        actual, flags = self.pages.geometry.launch(ids, mode=VERIFY, table=self.device_digests, layers=layers)
        expected = self.device_digests.view(torch.int64).index_select(0, ids)
        if layers is not None:
            # Through the launch's own column tensor: indexing with a list would copy it from
            # the host and wait.
            expected = expected.index_select(1, self.pages.geometry.columns(layers))
        return PendingCheck(block_ids, flags, actual, expected, layers)

    def host_digests(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=self.device_digests.device)
        return self.device_digests.view(torch.int64).index_select(0, ids).cpu().numpy().view(np.uint64)

    def seal(
        self, block_ids: Sequence[int], digests: np.ndarray, syndromes: np.ndarray | None = None
    ) -> None:
        """Host digests (and syndromes) into the table (the synchronous path)."""
        if len(block_ids):
            ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=self.device_digests.device)
            self.device_previous.index_copy_(
                0, ids, self.device_digests.view(torch.int64).index_select(0, ids)
            )
            values = torch.from_numpy(digests.view(np.int64)).to(self.device_digests.device)
            self.device_digests.view(torch.int64).index_copy_(0, ids, values)
            if syndromes is not None:
                self.device_syndromes.index_copy_(
                    0, ids, torch.from_numpy(syndromes.view(np.int64)).to(self.device_digests.device)
                )
            self.sealed[list(block_ids)] = True

    def seal_record(self, block_id: int, layer: int) -> tuple[int, int, np.ndarray]:
        digest = int(self.device_digests.view(torch.int64)[block_id, layer].item()) % (1 << 64)
        previous = int(self.device_previous[block_id, layer].item()) % (1 << 64)
        return digest, previous, self.device_syndromes[block_id, layer].cpu().numpy().view(np.uint64).copy()

    def sealed_matching(self, layer: int, digest: int, exclude: int) -> int | None:
        column = self.device_digests.view(torch.int64)[:, layer].cpu().numpy().view(np.uint64)
        hits = np.flatnonzero((column == np.uint64(digest)) & self.sealed)
        hits = hits[hits != exclude]
        return int(hits[0]) if len(hits) else None
