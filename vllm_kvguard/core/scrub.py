"""Scrubbing: sealed pages (and the written rows of pages still being filled) verified
round-robin in the background of serving.

A page that sits in the prefix cache is only verified when a request reuses
it; a bit that flips while nobody reads it waits there. The scrubber, like a
ZFS scrub, walks the sealed pages in block order and hands a few to each step's
verification, so that every sealed page is verified at least once every
``interval`` seconds at steady state.

It spends no more than it must: each step it earns ``sealed pages x elapsed /
interval`` pages of credit, capped by the per-step budget, and scrubs the whole
pages the credit buys. When the budget cannot keep up (too many pages for the
interval) :attr:`Scrubber.behind` says so, and the oldest-unverified-page age
(:meth:`vllm_kvguard.core.ledger.BlockLedger.oldest_unverified_age`) grows past the
interval. Scrubbing runs inside engine steps: an idle engine does not scrub
(every prefix-cache hit is still verified before it is read).
"""

from __future__ import annotations

import numpy as np

from vllm_kvguard.core.compiled import compiled
from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.core.plan import FILLING, SEALED, BlockState

_WINDOW = 4096  # blocks scanned per slice when looking for sealed pages
_RECOUNT_S = 0.25  # how often the number of sealed pages is recounted (an O(blocks) pass)


def _scrubbed(state: np.ndarray) -> np.ndarray:
    # Sealed pages, and pages being written (their rows written so far: digest/rows.py).
    return (state == BlockState.SEALED) | (state == BlockState.FILLING)


class Scrubber:
    def __init__(self, interval_s: float, max_pages_per_step: int) -> None:
        if interval_s <= 0 or max_pages_per_step < 1:
            raise ValueError("scrubbing needs an interval > 0 and at least one page per step")
        self.interval_s = interval_s
        self.max_pages = max_pages_per_step
        self.behind = False
        self._credit = 0.0
        self._last: float | None = None
        self._cursor = 0
        self._sealed = 0
        self._counted_at = float("-inf")

    def select(self, ledger: BlockLedger, now: float) -> list[int]:
        """The sealed pages to verify this step (marked verified in the ledger)."""
        last, self._last = self._last, now
        if last is None:
            return []
        if now - self._counted_at >= _RECOUNT_S:
            kernels = compiled()
            self._sealed = (
                int(np.count_nonzero(_scrubbed(ledger.state)))
                if kernels is None
                else int(kernels.count_states(ledger.state, SEALED, FILLING))
            )
            self._counted_at = now
        sealed = self._sealed
        earned = sealed * max(0.0, now - last) / self.interval_s
        self.behind = earned > self.max_pages
        self._credit = min(self._credit + earned, float(self.max_pages))
        want = int(self._credit)
        if want == 0 or sealed == 0:
            return []
        self._credit -= want
        out = self._next_sealed(ledger.state, min(want, sealed))
        ledger.mark_verified(out, now)
        return out

    def _next_sealed(self, state: np.ndarray, want: int) -> list[int]:
        kernels = compiled()
        if kernels is not None:
            # One compiled walk that keeps the GIL (docs/design/decisions.md, "The GIL"); the
            # numpy walk below is its definition (tests/unit/core/test_scrub.py).
            out = np.empty(want, dtype=np.int64)
            got, self._cursor = kernels.next_states(
                state, self._cursor % len(state), want, _WINDOW, SEALED, FILLING, out
            )
            return out[:got].tolist()
        return self._next_sealed_numpy(state, want)

    def _next_sealed_numpy(self, state: np.ndarray, want: int) -> list[int]:
        n = len(state)
        out: list[int] = []
        scanned = 0
        cursor = self._cursor % n
        while len(out) < want and scanned < n:
            end = min(n, cursor + _WINDOW)
            found = np.flatnonzero(_scrubbed(state[cursor:end]))
            take = found[: want - len(out)]
            out.extend((take + cursor).tolist())
            scanned += end - cursor
            cursor = cursor + int(take[-1]) + 1 if len(take) < len(found) else end
            if cursor >= n:
                cursor = 0
        self._cursor = cursor
        return out
