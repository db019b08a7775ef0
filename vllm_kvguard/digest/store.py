"""Page digests shared between engines (prefill/decode disaggregation), behind one interface.

A decode engine loads pages a prefill engine computed: it never sealed them, so its own
:class:`~vllm_kvguard.digest.loads.LoadDigests` has nothing to check them against. The producer
publishes what it sealed (identity fingerprint -> every layer's digest); the consumer looks up
what it loads. :class:`DigestStore` is the interface (a network store can replace the folder);
:class:`DigestFolder` keeps it in a shared folder (``VLLM_KVGUARD_DIGEST_DIR``).

The folder: one subfolder per KV layout (layers, page bytes, hash, sketch width, rank: only the same
shard of the same layout is comparable) and weights (a model redeployed with other weights under the
same name never verifies against the old one's pages), append-only segment files of fixed-size
records (the fingerprint, one digest per layer, little-endian uint64, then the page's sketch,
float32, digest/sketch.py), one writer per file. A writer keeps at most
``max_bytes`` of its own segments and deletes its oldest; readers read only whole records and drop
files that are gone. Nothing else is ever deleted: a folder outlives the engines that wrote it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np

from vllm_kvguard.digest.sketch import WIDTH, sketched_layers

SEGMENTS = 4  # a writer's segments kept at once: each holds max_bytes / SEGMENTS


class DigestStore(Protocol):
    def publish(self, fingerprints: np.ndarray, digests: np.ndarray, sketches: np.ndarray) -> None:
        """Pages this engine sealed: (pages,) fingerprints, (pages x layers) digests, (pages x
        layers x WIDTH) sketches."""

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What other engines published since the last call: fingerprints, digests, sketches."""


class DigestFolder:
    def __init__(self, root: str | Path, layout: str, num_layers: int, max_bytes: int) -> None:
        self.folder = Path(root) / layout
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_layers = num_layers
        self.record = np.dtype(
            [
                ("fp", "<u8"),
                ("digests", "<u8", (num_layers,)),
                ("sketches", "<f4", (len(sketched_layers(num_layers)), WIDTH)),
            ]
        )
        self.segment_bytes = max(self.record.itemsize, max_bytes // SEGMENTS)
        self._writer = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._mine: list[Path] = []
        self._segments = 0
        self._out: BinaryIO | None = None
        self._written = 0
        self._offsets: dict[Path, int] = {}

    def _segment(self) -> BinaryIO:
        if self._out is None or self._written + self.record.itemsize > self.segment_bytes:
            if self._out is not None:
                self._out.close()
            path = self.folder / f"{self._writer}-{self._segments:06d}.bin"
            self._segments += 1
            self._mine.append(path)
            self._out = open(path, "ab", buffering=0)  # noqa: SIM115 - kept open between steps
            self._written = 0
            while len(self._mine) > SEGMENTS:
                self._mine.pop(0).unlink(missing_ok=True)
        return self._out

    def publish(self, fingerprints: np.ndarray, digests: np.ndarray, sketches: np.ndarray) -> None:
        keep = fingerprints != 0
        if not np.count_nonzero(keep):
            return
        records = np.zeros(int(np.count_nonzero(keep)), dtype=self.record)
        records["fp"] = fingerprints[keep]
        records["digests"] = digests[keep]
        records["sketches"] = sketches[keep]
        data = records.tobytes()
        at = 0
        while at < len(data):
            out = self._segment()
            room = (self.segment_bytes - self._written) // self.record.itemsize * self.record.itemsize
            piece = data[at : at + max(self.record.itemsize, room)]
            out.write(piece)
            self._written += len(piece)
            at += len(piece)

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        size = self.record.itemsize
        mine = {p.name for p in self._mine}
        found: list[np.ndarray] = []
        present = set()
        for path in sorted(self.folder.glob("*.bin")):
            if path.name in mine:
                continue
            present.add(path)
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except FileNotFoundError:
                continue
            whole = len(data) // size * size
            if whole:
                found.append(np.frombuffer(data[:whole], dtype=self.record))
                self._offsets[path] = start + whole
        for gone in [p for p in self._offsets if p not in present]:
            del self._offsets[gone]
        if not found:
            return (
                np.zeros(0, dtype=np.uint64),
                np.zeros((0, self.num_layers), dtype=np.uint64),
                np.zeros((0, len(sketched_layers(self.num_layers)), WIDTH), dtype=np.float32),
            )
        records = np.concatenate(found)
        return (
            records["fp"].astype(np.uint64),
            records["digests"].astype(np.uint64),
            records["sketches"].astype(np.float32),
        )

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
