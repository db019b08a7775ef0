"""Finished readers: which recently finished requests held which blocks, until when.

Under ``sampled`` or ``reuse`` verification a page can go bad under a request that then
finishes before any verification reaches the page; its text has left the engine. The
page is still caught later (the next reader's hit, the scrubber), and then these
requests must be named: each one that held the page and ran a forward after the page was
last known good may have emitted tokens computed from it (``suspect``, reported late).

Entries are kept for ``retention_s`` seconds (the scrub interval: at steady state every
sealed page is verified at least that often, so a bad page is caught within it) and at
most ``max_entries``; one entry per finished request, its blocks as one numpy array.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class FinishedRequest(NamedTuple):
    req_id: str
    step: int  # the engine step in which it finished (its last forward)
    at: float  # the caller's clock
    blocks: np.ndarray


class FinishedReaders:
    def __init__(self, retention_s: float, max_entries: int = 16384) -> None:
        self.retention_s = retention_s
        self._entries: deque[FinishedRequest] = deque(maxlen=max_entries)
        # Set when the cap, not the retention, dropped an entry: history is shorter than promised.
        self.truncated = False

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, req_id: str, step: int, now: float, blocks: Sequence[int]) -> None:
        """A request finished in ``step`` holding ``blocks``."""
        if not len(blocks):
            return
        entries = self._entries
        while entries and now - entries[0].at > self.retention_s:
            entries.popleft()
        if len(entries) == entries.maxlen:
            self.truncated = True
        entries.append(FinishedRequest(req_id, step, now, np.asarray(blocks, dtype=np.int64)))

    def take_readers_since(self, block_id: int, last_good_step: int) -> list[str]:
        """Finished requests that held ``block_id`` and ran a forward after ``last_good_step``;
        they are taken out, so a request is named once (the rare path: one scan, on a detection)."""
        taken = [e for e in self._entries if e.step > last_good_step and bool(np.any(e.blocks == block_id))]
        if taken:
            gone = {id(e) for e in taken}
            kept = [e for e in self._entries if id(e) not in gone]
            self._entries = deque(kept, maxlen=self._entries.maxlen)
        return [e.req_id for e in taken]
