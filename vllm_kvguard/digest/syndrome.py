"""Page syndromes: a little redundancy beside each digest that locates, and mends, a change
confined to one 64-bit word of a page (as SECDED memory does for one bit of a word).

The digest says *that* a page changed; the syndrome says *where*, when the change is small.
A page is read as ``W`` little-endian 64-bit words ``w_j`` (zero-padded); its syndrome is
``1 + ADDRESS_BITS`` words::

    S     = XOR of every w_j
    S_b   = XOR of the w_j whose index j has bit b set        (b = 0 .. ADDRESS_BITS - 1)

If only word ``j`` changed, by ``D = old ^ new`` (not 0), then ``S ^ S' = D`` and, for each
``b``, ``S_b ^ S_b'`` is ``D`` where bit ``b`` of ``j`` is 1 and 0 where it is 0: the
differences spell ``j`` and ``D`` says which bits flipped, so the old word is ``new ^ D``.
A change to several words gives some ``S_b ^ S_b'`` that is neither 0 nor ``D`` -- or, rarely,
a consistent but wrong answer, or ``D = 0`` (changes that cancel): callers confirm every
location against the page's digest before believing it (:func:`locate` only proposes).

Computed with two vectorised passes over the page (numpy, straight over the gathered pages; the
host seal takes the same parities in one compiled pass, rowhash.page_facts):
the page as a (rows x 64) array of words, XOR-reduced down the columns and along the rows;
the low 6 address bits come from the 64 column parities, the others from the row parities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ADDRESS_BITS = 26  # pages up to 2**26 words (512 MiB): far beyond any vLLM KV page
SYNDROME_WORDS = 1 + ADDRESS_BITS
_COLS = 64  # words per row: the low 6 address bits
_LOW = 6


def width(page_bytes: int) -> int:
    """How many syndrome words a page of this many bytes needs (the rest are always zero):
    tables keep only these (a 64 KiB page: 14 words, 112 bytes)."""
    rows = max(1, -(-page_bytes // (8 * _COLS)))
    return 1 + _LOW + int(rows - 1).bit_length()


def _words(pages: np.ndarray) -> np.ndarray:
    """(pages, bytes) uint8 -> (pages, rows * 64) uint64, zero-padded (a view when aligned)."""
    raw = pages.view(np.uint8).reshape(len(pages), -1)
    pad = -raw.shape[1] % (8 * _COLS)
    if pad:
        raw = np.concatenate([raw, np.zeros((len(raw), pad), dtype=np.uint8)], axis=1)
    return raw.view("<u8")


def _bit_parities(parts: np.ndarray, bits: int, out: np.ndarray) -> None:
    """out[:, b] = XOR of parts[:, i] for the i with bit b set (parts: (pages, 2**bits)); each
    bit one reduction over strided views (no copies)."""
    n = len(parts)
    for b in range(bits):
        out[:, b] = np.bitwise_xor.reduce(parts.reshape(n, -1, 2, 1 << b)[:, :, 1, :].reshape(n, -1), axis=1)


def parities(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two passes over the pages (rows: the pages' bytes): column parities (pages, 64) and
    row parities (pages, rows), uint64. :func:`finish` turns them into syndromes; pages of
    several layers can be finished together (fewer small operations per step)."""
    grid = _words(pages).reshape(len(pages), -1, _COLS)
    return np.bitwise_xor.reduce(grid, axis=1), np.bitwise_xor.reduce(grid, axis=2)


def finish(cols: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Syndromes (pages, SYNDROME_WORDS) from :func:`parities`."""
    n = len(cols)
    out = np.zeros((n, SYNDROME_WORDS), dtype=np.uint64)
    out[:, 0] = np.bitwise_xor.reduce(cols, axis=1)
    _bit_parities(cols, _LOW, out[:, 1 : 1 + _LOW])
    high = max(0, int(rows.shape[1] - 1).bit_length())
    if high > ADDRESS_BITS - _LOW:
        raise ValueError(f"a page of {rows.shape[1] * _COLS} words is larger than syndromes address")
    if rows.shape[1] != 1 << high:
        padded = np.zeros((n, 1 << high), dtype=np.uint64)
        padded[:, : rows.shape[1]] = rows
        rows = padded
    _bit_parities(rows, high, out[:, 1 + _LOW : 1 + _LOW + high])
    return out


def syndromes(pages: np.ndarray) -> np.ndarray:
    """Syndromes of pages given as a 2-D array whose rows are the pages' bytes (any dtype),
    shape (pages, SYNDROME_WORDS), uint64."""
    return finish(*parities(pages))


@dataclass(frozen=True)
class Location:
    """Where a single-word change is, and what the word was."""

    word: int  # index of the 64-bit word in the page (its bytes: 8 * word .. 8 * word + 7)
    old: int  # the word's value at seal time (uint64)
    new: int  # its value now
    flipped: int  # old ^ new: the bits that changed

    @property
    def single_bit(self) -> bool:
        return self.flipped.bit_count() == 1


def locate(sealed: np.ndarray, now: np.ndarray, page_words: np.ndarray) -> Location | None:
    """The one word whose change explains ``now`` against ``sealed`` (two syndromes), given the
    page's current words (:func:`page_words`); None when no single word does. A proposal:
    confirm it against the digest before repairing."""
    diff = [int(a) ^ int(b) for a, b in zip(sealed, now, strict=True)]
    flipped = diff[0]
    if flipped == 0:
        return None
    word = 0
    for b, d in enumerate(diff[1:]):
        if d == flipped:
            word |= 1 << b
        elif d != 0:
            return None
    if word >= len(page_words):
        return None
    new = int(page_words[word])
    return Location(word, new ^ flipped, new, flipped)


def page_words(page_bytes: np.ndarray) -> np.ndarray:
    """A page's bytes as little-endian uint64 words, zero-padded."""
    raw = np.ascontiguousarray(page_bytes).view(np.uint8).ravel()
    pad = -len(raw) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)])
    return raw.view("<u8")


def _xor_reduce(x: Any, dim: int) -> Any:
    """XOR of ``x`` along ``dim`` by halving (torch has no XOR reduction), keeping the dim."""
    import torch

    while x.shape[dim] > 1:
        if x.shape[dim] % 2:
            pad = list(x.shape)
            pad[dim] = 1
            x = torch.cat([x, x.new_zeros(pad)], dim=dim)
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) ^ x.narrow(dim, half, half)
    return x


def syndromes_device(pages: Any, words: int) -> Any:
    """:func:`syndromes` where the pages live (torch; a GPU's pages on the GPU), the first
    ``words`` of each, int64 (the same bits as the uint64 of :func:`syndromes`). ``pages``:
    (pages, ...) with each row a page's bytes in logical order."""
    import torch

    n = pages.shape[0]
    raw = pages.contiguous().view(torch.uint8).reshape(n, -1)
    pad = -raw.shape[1] % (8 * _COLS)
    if pad:
        raw = torch.cat([raw, raw.new_zeros((n, pad))], dim=1)
    grid = raw.view(torch.int64).reshape(n, -1, _COLS)
    cols = _xor_reduce(grid, 1).reshape(n, _COLS)
    rows = _xor_reduce(grid, 2).reshape(n, -1)
    high = int(rows.shape[1] - 1).bit_length()
    if rows.shape[1] != 1 << high:
        rows = torch.cat([rows, rows.new_zeros((n, (1 << high) - rows.shape[1]))], dim=1)
    out = [_xor_reduce(cols, 1).reshape(n)]
    for parts, bits in ((cols, _LOW), (rows, high)):
        for b in range(bits):
            picked = parts.reshape(n, -1, 2, 1 << b)[:, :, 1, :].reshape(n, -1)
            out.append(_xor_reduce(picked, 1).reshape(n))
    full = torch.stack(out, dim=1)
    if full.shape[1] < words:
        full = torch.cat([full, full.new_zeros((n, words - full.shape[1]))], dim=1)
    return full[:, :words]
