"""Row digests kept on the device (GPU pages): recorded and compared where the rows live, in
one launch a call where the KVG64 row kernel runs, read back with the step's output
(:class:`RowCheck`), never inside a step. Torch computes the same digests elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_kvguard.digest.checks import PendingCheck
from vllm_kvguard.digest.kernel import CHECK, RECORD, RowGeometry
from vllm_kvguard.digest.row_access import RowAccess
from vllm_kvguard.digest.rows import RowDigests, row_digests_torch


class RowCheck(NamedTuple):
    """Row digests compared on the device: ``pending`` reads back which rows were flagged
    (each row's place in the call's arrays stands as its "block" in
    :meth:`PendingCheck.settle`); ``blocks``/``flagged`` stay on the device for the seal
    that follows (:meth:`DeviceDigestTable.seal_async`'s ``void``)."""

    pending: PendingCheck
    blocks: torch.Tensor
    flagged: torch.Tensor


class DeviceRowDigests(RowDigests):
    """Row digests of pages off the host, kept, compared and read back without a wait.

    :class:`RowDigests` on a GPU hashed rows there but read every digest back (``.cpu()``):
    a host wait for the step's forward, every step. Here the digests stay in a table on the
    device beside the pages (this generation and the previous one); recording and checking
    rows compare there and return a :class:`RowCheck` whose flags are read with the step's
    output, as the page seals' :class:`PendingCheck` are. The host keeps only which slots
    hold a row (``rows``/``previous`` as 0/1 markers), which is all the ledger of written
    rows needs.

    ``geometry`` (kernel.py's :class:`RowGeometry`, where the layout allows): each call is one
    kernel launch over every layer that hashes, compares and stores; without it, a gather per
    layer and torch's arithmetic (about twenty small kernels), the same digests."""

    deferred = True
    _host_dtype = np.uint8

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        gathers: Sequence[RowAccess],
        num_blocks: int,
        block_size: int,
        geometry: RowGeometry | None = None,
    ) -> None:
        super().__init__(tensors, gathers, num_blocks, block_size)
        self.geometry = geometry
        shape = (num_blocks * block_size,)  # flat: entry block x block_size + slot
        self.table = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.table_previous = torch.zeros(shape, dtype=torch.int64, device=self.device)

    def nbytes(self) -> int:
        return super().nbytes() + 2 * self.table.numel() * self.table.element_size()

    def try_kernel(self) -> str | None:
        """At start-up: build the row kernel and check it against torch on two rows (the one
        wait on the device this class makes). Where it fails to build or disagrees, the torch
        path is used from then on; returns why, or None where the kernel is in use."""
        if self.geometry is None:
            return "no kernel for this layout"
        blocks = np.zeros(2, dtype=np.int64)
        slots = np.array([0, self.block_size - 1], dtype=np.int64)
        b, s, _ = self._flat(blocks, slots)
        try:
            by_kernel = self.geometry.launch(b, s)[0].cpu()
        except Exception as exc:
            self.geometry = None
            return f"row kernel failed: {exc!r}"[:300]
        if not torch.equal(by_kernel, self._digests(b, s).cpu()):
            self.geometry = None
            return "row kernel disagrees with torch"
        return None

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        """Host ids to the device without waiting for it (pinned, in stream order)."""
        ids = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type != "cuda":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _flat(self, blocks: np.ndarray, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(blocks, slots, table entries) on the device, in one copy (the entries computed on
        the host: no device arithmetic per call)."""
        b = np.asarray(blocks, dtype=np.int64)
        s = np.asarray(slots, dtype=np.int64)
        ids = self._to_device(np.stack([b, s, b * self.block_size + s]))
        return ids[0], ids[1], ids[2]

    def _digests(self, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        gathered = torch.cat([g(b, s).contiguous().view(torch.uint8) for g in self.gathers], dim=1)
        return row_digests_torch(gathered.view(torch.int64), s)

    def record_async(self, blocks: np.ndarray, slots: np.ndarray, *, compare: bool) -> RowCheck | None:
        """Hash the rows just written into the table. With ``compare``: flags those that equal
        what the block's previous owner had at that slot (lost writes), read later."""
        if not len(blocks):
            return None
        self.rows[blocks, slots] = 1
        b, s, flat = self._flat(blocks, slots)
        if self.geometry is not None:
            digests, previous, flags = self.geometry.launch(
                b, s, mode=RECORD, table=self.table, previous=self.table_previous
            )
            same = flags
        else:
            digests = self._digests(b, s)
            self.table.index_copy_(0, flat, digests)
            if not compare:
                return None
            previous = self.table_previous.index_select(0, flat)
            same = (digests == previous) & (previous != 0)
        if not compare:
            return None
        pending = PendingCheck(
            range(len(blocks)), same.to(torch.uint8)[:, None], digests[:, None], previous[:, None]
        )
        return RowCheck(pending, b, same)

    def check_async(self, blocks: np.ndarray, slots: np.ndarray) -> RowCheck | None:
        """Compare rows with their recorded digests; flags the rows that changed, read later."""
        if not len(blocks):
            return None
        b, s, flat = self._flat(blocks, slots)
        if self.geometry is not None:
            digests, expected, flags = self.geometry.launch(b, s, mode=CHECK, table=self.table)
            changed = flags
        else:
            digests = self._digests(b, s)
            expected = self.table.index_select(0, flat)
            changed = digests != expected
        pending = PendingCheck(
            range(len(blocks)), changed.to(torch.uint8)[:, None], digests[:, None], expected[:, None]
        )
        return RowCheck(pending, b, changed)

    def hash(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """As :meth:`RowDigests.hash` (reads back and waits: drills and diagnosis only)."""
        if not len(blocks):
            return np.zeros(0, dtype=np.uint64)
        b, s, _ = self._flat(blocks, slots)
        digests = self.geometry.launch(b, s)[0] if self.geometry is not None else self._digests(b, s)
        return digests.cpu().numpy().view(np.uint64)

    def record(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("device row digests are recorded with record_async")

    def check(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("device row digests are checked with check_async")

    def roll(self, blocks: Sequence[int]) -> None:
        if len(blocks):
            super().roll(blocks)
            ids = self._to_device(np.asarray(blocks, dtype=np.int64))
            rows = self.table.view(-1, self.block_size)
            self.table_previous.view(-1, self.block_size).index_copy_(0, ids, rows.index_select(0, ids))
            rows.index_fill_(0, ids, 0)

    def forget(self, blocks: Sequence[int]) -> None:
        if len(blocks):
            super().forget(blocks)
            self.table.view(-1, self.block_size).index_fill_(
                0, self._to_device(np.asarray(blocks, dtype=np.int64)), 0
            )

    def clear(self, blocks: np.ndarray, slots: np.ndarray) -> None:
        if len(blocks):
            super().clear(blocks, slots)
            flat = np.asarray(blocks, dtype=np.int64) * self.block_size + np.asarray(slots, dtype=np.int64)
            self.table.index_fill_(0, self._to_device(flat), 0)

    def reset(self) -> None:
        super().reset()
        self.table.zero_()
        self.table_previous.zero_()
