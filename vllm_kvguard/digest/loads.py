"""Page digests by what the page holds (its identity), kept after the page leaves vLLM's pool.

Another KV connector (LMCache, NIXL, an offloading connector) can load a page back long after
vLLM evicted the block that computed it. The guard keeps, for every page it sealed here, the
page's digests (one per layer) under its identity fingerprint (digest/identity.py: the tokens,
adapter, salt and media it was computed from); a loaded page is checked against the digests of
its own identity before attention reads it. Bounded: least recently sealed or checked first out.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

# Bytes one entry costs besides its digests: the dict's slot and node, the int key, the
# array's header (measured with sys.getsizeof on CPython 3.11: about 200).
ENTRY_OVERHEAD = 200


class LoadDigests:
    def __init__(self, num_layers: int, max_bytes: int) -> None:
        self.num_layers = num_layers
        self.entry_bytes = 8 * num_layers + ENTRY_OVERHEAD
        self.capacity = max(1, max_bytes // self.entry_bytes)
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return len(self._entries) * self.entry_bytes

    def remember(self, fingerprints: np.ndarray, digests: np.ndarray) -> None:
        """Pages sealed here: ``digests`` (pages x layers) under their ``fingerprints`` (0:
        unknown identity, skipped)."""
        entries = self._entries
        for fp, row in zip(fingerprints.tolist(), digests, strict=True):
            if fp:
                entries[fp] = row.copy()
                entries.move_to_end(fp)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def expected(self, fingerprints: np.ndarray) -> list[np.ndarray | None]:
        """Each loaded page's digests as sealed here (None: never sealed here, or evicted)."""
        entries = self._entries
        found: list[np.ndarray | None] = []
        for fp in fingerprints.tolist():
            row = entries.get(fp) if fp else None
            if row is not None:
                entries.move_to_end(fp)
            found.append(row)
        return found
