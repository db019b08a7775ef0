"""Page digests by what the page holds (its identity), kept after the page leaves vLLM's pool.

Another KV connector (LMCache, NIXL, an offloading connector) can load a page back long after
vLLM evicted the block that computed it. The guard keeps, for every page it sealed here, the
page's digests (one per layer) under its identity fingerprint (digest/identity.py: the tokens,
adapter, salt and media it was computed from); a loaded page is checked against the digests of
its own identity before attention reads it.

vLLM is not batch-invariant: the same tokens computed in another batch give other KV bytes, so
one identity can be sealed with several digest sets over its life (recomputed after an eviction,
a preemption, a connector miss), and a connector keeps whichever copy it stored first (LMCache
skips a key it holds; ``ExampleConnector`` stores a prompt once). Each identity keeps its
``PER_IDENTITY`` most recent distinct digest sets, newest first; a load that matches any of them
is what one computation of its inputs gave. Each identity also keeps the sketch of its first
computation (digest/sketch.py): a load whose exact digest is not kept (an identity computed more
often than ``PER_IDENTITY``) is compared with it, within the sketch's tolerance. Bounded in
bytes: least recently sealed or checked identity first out.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from vllm_kvguard.digest.sketch import WIDTH, distance, sketched_layers

# Bytes one identity costs besides its digests: the dict's slot and node, the int key, the list
# and a bytes header per digest set (measured with sys.getsizeof on CPython 3.11: about 200, and
# 33 a set).
ENTRY_OVERHEAD = 200
SET_OVERHEAD = 40
# Distinct digest sets kept per identity: computations of the same inputs in other batches.
PER_IDENTITY = 4
# Bytes a kept sketch costs besides its floats (a dict slot and a bytes header).
SKETCH_OVERHEAD = 100


class LoadDigests:
    def __init__(self, num_layers: int, max_bytes: int, per_identity: int = PER_IDENTITY) -> None:
        self.num_layers = num_layers
        self.per_identity = max(1, per_identity)
        self.set_bytes = 8 * num_layers + SET_OVERHEAD
        self.sketched = len(sketched_layers(num_layers))
        self.sketch_bytes = 4 * WIDTH * self.sketched + SKETCH_OVERHEAD
        self.max_bytes = max(ENTRY_OVERHEAD + self.set_bytes + self.sketch_bytes, max_bytes)
        # fingerprint -> its digest sets (each one row's bytes, layers in order), newest first.
        self._entries: OrderedDict[int, list[bytes]] = OrderedDict()
        # fingerprint -> the sketch of its first computation seen (sketched layers x WIDTH float32);
        # only identities in _entries.
        self._sketches: dict[int, bytes] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return self._bytes

    def _cost(self, sets: int) -> int:
        return ENTRY_OVERHEAD + sets * self.set_bytes

    def remember(
        self, fingerprints: np.ndarray, digests: np.ndarray, sketches: np.ndarray | None = None
    ) -> np.ndarray:
        """Pages sealed here (or published by another engine): ``digests`` (pages x layers)
        under their ``fingerprints`` (0: unknown identity, skipped), with their ``sketches``
        (pages x sketched layers x WIDTH float32; NaN: none) where known. A set the identity already
        has moves to the front; a new one is added there, the oldest beyond ``per_identity``
        dropped. The first sketch of an identity is kept. Returns, for each page that brought a
        new digest set to an identity with a kept sketch, each sketched layer's relative distance
        from that sketch (pages x sketched layers): how far a recomputation of the same inputs landed (the
        clean spread that the sketch's tolerance must exceed)."""
        entries = self._entries
        rows = np.ascontiguousarray(digests, dtype=np.uint64)
        spread: list[int] = []  # rows whose new set met a kept sketch
        for i, (fp, row) in enumerate(zip(fingerprints.tolist(), rows, strict=True)):
            if not fp:
                continue
            key = row.tobytes()
            sets = entries.get(fp)
            if sets is None:
                entries[fp] = [key]
                self._bytes += self._cost(1)
                self._keep_sketch(fp, sketches, i)
                continue
            before = len(sets)
            if key in sets:
                sets.remove(key)
            elif sketches is not None and fp in self._sketches:
                spread.append(i)
            sets.insert(0, key)
            del sets[self.per_identity :]
            self._bytes += (len(sets) - before) * self.set_bytes
            entries.move_to_end(fp)
            if fp not in self._sketches:
                self._keep_sketch(fp, sketches, i)
        distances = np.zeros((0, self.sketched), dtype=np.float32)
        if spread:
            assert sketches is not None
            fps = fingerprints[spread].tolist()
            kept = self.sketches(fps)
            new = torch.from_numpy(np.ascontiguousarray(sketches[spread], dtype=np.float32))
            old = torch.from_numpy(np.stack([k for k in kept if k is not None]))
            distances = distance(new, old).numpy()
        while self._bytes > self.max_bytes and entries:
            fp, sets = entries.popitem(last=False)
            self._bytes -= self._cost(len(sets))
            if self._sketches.pop(fp, None) is not None:
                self._bytes -= self.sketch_bytes
        return distances

    def _keep_sketch(self, fp: int, sketches: np.ndarray | None, i: int) -> None:
        if sketches is None or np.isnan(sketches[i]).all():
            return
        self._sketches[fp] = np.ascontiguousarray(sketches[i], dtype=np.float32).tobytes()
        self._bytes += self.sketch_bytes

    def sketches(self, fingerprints: list[int]) -> list[np.ndarray | None]:
        """The kept sketch of each identity (sketched layers x WIDTH float32), None where none."""
        out: list[np.ndarray | None] = []
        for fp in fingerprints:
            raw = self._sketches.get(fp)
            out.append(None if raw is None else np.frombuffer(raw, dtype=np.float32).reshape(-1, WIDTH))
        return out

    def expected(self, fingerprints: np.ndarray) -> list[np.ndarray | None]:
        """Each loaded page's digest sets as kept here, (sets x layers), newest first (None: never
        sealed here, or evicted)."""
        entries = self._entries
        found: list[np.ndarray | None] = []
        for fp in fingerprints.tolist():
            sets = entries.get(fp) if fp else None
            if sets is None:
                found.append(None)
                continue
            entries.move_to_end(fp)
            found.append(np.frombuffer(b"".join(sets), dtype=np.uint64).reshape(len(sets), self.num_layers))
        return found

    def set_counts(self) -> dict[int, int]:
        """Each kept identity's number of distinct digest sets (what tests and drills inspect;
        unlike :meth:`expected`, it leaves the least-recently-used order as it is)."""
        return {fp: len(sets) for fp, sets in self._entries.items()}


def candidates(found: list[np.ndarray]) -> np.ndarray:
    """Pages' digest sets as one array (pages x sets x layers), the sets of pages with fewer
    padded with copies of their newest (a copy matches only what the newest matches)."""
    width = max(len(sets) for sets in found)
    out = np.empty((len(found), width, found[0].shape[1]), dtype=np.uint64)
    for i, sets in enumerate(found):
        out[i, : len(sets)] = sets
        out[i, len(sets) :] = sets[0]
    return out
