"""Page identity: what a full KV page is supposed to hold, as a 64-bit fingerprint.

A page's fingerprint covers the tokens of its slots and every input vLLM must key a
cached page by besides them (LoRA adapter, cache salt, multimodal inputs placed in
the page, prompt embeddings), chained to the fingerprint of the page before it: two
pages have the same fingerprint only if they were computed from the same inputs
from the first token on. It is the guard's own reading of the request with its own
hash (XXH3-64 keyed by the parent fingerprint), never vLLM's block hash, so a bug in
vLLM's hashing (a missing salt, a LoRA id or multimodal hash left out, a collision)
cannot hide from it.

0 means "unknown" (a page whose tokens are not all known yet): never compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

# The chain's root (b"KVGUARD1"): the first page's parent, keyed with the weights' identity
# (digest/weights.py) where known: other weights, other fingerprints.
ROOT = 0x4B56_4755_4152_4431


def root_for(weights: int) -> int:
    """The chain's root for pages computed by the weights ``weights`` (0: unknown, ROOT)."""
    if not weights:
        return ROOT
    return xxhash.xxh3_64_intdigest(ROOT.to_bytes(8, "little"), weights) or 1


@dataclass(frozen=True)
class Media:
    """One multimodal input placed in the prompt: its content hash and token range."""

    identifier: str
    offset: int
    length: int


@dataclass
class RequestInputs:
    """What a request's pages are computed from, as the guard reads it.

    ``tokens`` is the request's live token list (prompt then output; it grows).
    ``context``: inputs that apply to every page (adapter, salt), already encoded.
    ``embeds(start, end)``: the prompt-embedding bytes of tokens [start, end), or None.
    """

    tokens: Sequence[int]
    context: bytes = b""
    media: tuple[Media, ...] = ()
    embeds: Callable[[int, int], bytes] | None = None
    pages: list[int] = field(default_factory=list)


def context_bytes(*, lora: str | None = None, salt: str | None = None) -> bytes:
    """The per-request part of every page's fingerprint."""
    parts = []
    if lora is not None:
        parts.append(f"lora={lora}")
    if salt is not None:
        parts.append(f"salt={salt}")
    return "\x1f".join(parts).encode()


class PageIdentity:
    """Chained page fingerprints of live requests, each page computed once, on demand."""

    def __init__(self, block_size: int, root: int = ROOT) -> None:
        self.block_size = block_size
        self.root = root
        self.requests: dict[str, RequestInputs] = {}

    def add(self, req_id: str, inputs: RequestInputs) -> None:
        self.requests[req_id] = inputs

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def fingerprints(self, req_id: str, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """Fingerprints of the request's pages at ``positions`` (0: unknown), uint64."""
        out = np.zeros(len(positions), dtype=np.uint64)
        inputs = self.requests.get(req_id)
        if inputs is None or not len(positions):
            return out
        top = int(max(positions)) + 1
        pages = self._pages(inputs, top)
        if len(positions) == 1:  # a decode step's page: no array work
            out[0] = pages[top - 1] if top <= len(pages) else 0
            return out
        have = np.asarray(pages, dtype=np.uint64)
        pos = np.asarray(positions, dtype=np.int64)
        inside = pos < len(have)
        out[inside] = have[pos[inside]]
        return out

    def fingerprint_each(self, req_ids: Sequence[str], positions: np.ndarray) -> np.ndarray:
        """:meth:`fingerprints` of one page each of many requests (``req_ids[i]``'s page at
        ``positions[i]``; a decode batch's pages), uint64, 0 where unknown."""
        return np.fromiter(
            map(self._fingerprint, req_ids, positions.tolist()), dtype=np.uint64, count=len(req_ids)
        )

    def _fingerprint(self, req_id: str, p: int) -> int:
        inputs = self.requests.get(req_id)
        if inputs is None or p < 0:
            return 0
        pages = self._pages(inputs, p + 1)
        return pages[p] if p < len(pages) else 0

    def owner_key_each(self, req_ids: Sequence[str], positions: np.ndarray) -> np.ndarray:
        """:meth:`owner_keys` of one page position each of many requests."""
        return np.fromiter(
            map(self._owner_key, req_ids, positions.tolist()), dtype=np.uint64, count=len(req_ids)
        )

    def _owner_key(self, req_id: str, p: int) -> int:
        parent = self._fingerprint(req_id, p - 1) if p else self.root * (req_id in self.requests)
        key = ((parent * 0x9E3779B185EBCA87) & 0xFFFFFFFFFFFFFFFF) ^ p if parent else 0
        return key or (1 if parent else 0)

    def owner_keys(self, req_id: str, positions: np.ndarray) -> np.ndarray:
        """A key per page position of the request: the same for two requests exactly when they
        write that position after the same prefix (the fingerprint of the page before it, and the
        position), so their rows there are the same computation. 0: unknown."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) == 1:  # one block handed out: plain ints
            return np.array([self._owner_key(req_id, int(positions[0]))], dtype=np.uint64)
        parents = self.fingerprints(req_id, np.maximum(positions - 1, 0))
        parents[positions == 0] = self.root if req_id in self.requests else 0
        with np.errstate(over="ignore"):
            keys = (parents * np.uint64(0x9E3779B185EBCA87)) ^ positions.astype(np.uint64)
        keys[parents == 0] = 0
        keys[(keys == 0) & (parents != 0)] = 1
        return keys

    def _pages(self, inputs: RequestInputs, top: int) -> list[int]:
        """The request's page fingerprints, computed up to page ``top`` (where its tokens reach).
        The missing pages' tokens are read out of the live list once for all of them (a new
        request's whole prefix at once: 2.6x cheaper than a page at a time, 33 pages)."""
        pages = inputs.pages
        bs = self.block_size
        first, last = len(pages), min(top, len(inputs.tokens) // bs)
        if first >= last:
            return pages
        tokens = np.asarray(inputs.tokens[first * bs : last * bs], dtype=np.int64).tobytes()
        width = bs * 8
        parent = pages[-1] if pages else self.root
        for i in range(last - first):
            parent = self._page(inputs, first + i, parent, tokens[i * width : (i + 1) * width])
            pages.append(parent)
        return pages

    def _page(self, inputs: RequestInputs, i: int, parent: int, tokens: bytes) -> int:
        """Page ``i``'s fingerprint: XXH3-64 keyed by ``parent`` over its tokens (int64 bytes),
        a separator, the request's context, then the media placed in it and its prompt
        embeddings, if any."""
        if not inputs.media and inputs.embeds is None:
            return xxhash.xxh3_64_intdigest(tokens + b"\x1e" + inputs.context, parent) or 1
        bs = self.block_size
        start, end = i * bs, (i + 1) * bs
        h = xxhash.xxh3_64(seed=parent)
        h.update(tokens)
        h.update(b"\x1e")
        h.update(inputs.context)
        for m in inputs.media:
            if m.offset < end and m.offset + m.length > start:
                h.update(f"\x1d{m.identifier}@{m.offset - start}+{m.length}".encode())
        if inputs.embeds is not None:
            h.update(b"\x1c")
            h.update(inputs.embeds(start, end))
        return h.intdigest() or 1
