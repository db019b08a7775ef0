"""Pending device checks: one kernel launch's results, read back once the step is over."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class PendingCheck:
    """One launch's results, still on the device: read them when the step is over.

    The flags (one byte per page and layer) are copied to pinned host memory in
    the launch's stream order and an event is recorded after the copy; nothing
    waits for them until :meth:`settle`, which the guard calls once vLLM itself
    has waited for the step's output (or, non-blocking, when :meth:`ready`).
    Digests are fetched only for flagged pages (the rare path).
    """

    def __init__(
        self,
        block_ids: Sequence[int],
        flags: torch.Tensor,
        actual: torch.Tensor,
        expected: torch.Tensor | None,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.block_ids = list(block_ids)
        # The layer of each column, when the launch covered only some layers.
        self._layers = list(layers) if layers is not None else None
        self._flags, self._actual, self._expected = flags, actual, expected
        self._event: Any = None
        if flags.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._host_flags = host
        else:
            self._host_flags = flags
        self._result: list[tuple[int, int, int, int, int]] | None = None
        # The output thread (pickling the worker's output) and the worker's next step may
        # both settle the same check.
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether :meth:`settle` would not wait."""
        return self._result is not None or self._event is None or bool(self._event.query())

    @property
    def settled(self) -> bool:
        return self._result is not None

    def settle(self) -> list[tuple[int, int, int, int, int]]:
        """Flagged pages as (block id, layer index, flags, actual digest, sealed digest); idempotent."""
        with self._lock:
            return self._settle()

    def _settle(self) -> list[tuple[int, int, int, int, int]]:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            flags = self._host_flags.numpy()
            rows, cols = np.nonzero(flags)
            result = []
            if len(rows):
                actual = self._actual.cpu().view(torch.int64).numpy().view(np.uint64)
                expected = (
                    self._expected.cpu().view(torch.int64).numpy().view(np.uint64)
                    if self._expected is not None
                    else None
                )
                for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
                    sealed = int(expected[r, c]) if expected is not None else 0
                    layer = self._layers[c] if self._layers is not None else c
                    result.append((self.block_ids[r], layer, int(flags[r, c]), int(actual[r, c]), sealed))
            self._result = result
            self._flags = self._actual = self._expected = self._host_flags = None  # type: ignore[assignment]
            self._event = None
        return self._result
