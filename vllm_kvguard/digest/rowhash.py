"""The row digest on the host: KVG64 (the device path's row digest, :func:`rows.row_digests_reference`)
in compiled loops.

A row's digest is ``avalanche(sum over its 64-bit words j of term(word_j, (j + 1) x P5 + slot
x P3))`` (never 0). It is a sum of one term per word, so it can be taken a piece at a time, in
any order: the write op's wrapper adds each layer's K and V words to a per-row sum as vLLM
hands them over (:func:`add_layer`), with no copy of the rows, and :func:`finish` turns the sums
into digests after the forward. XXH3, which hashed host rows before (2026-12-05), needs a row's
bytes in one buffer: the wrapper copied every row of every layer into one (1 MiB a step at 128
running requests, into memory the forward had pushed out of the caches: ~95 us a layer).

The other host loops of the step live beside them, compiled the same way: after the forward the
worker keeps the step's rows in one call (``keep_written``: written order, landing probes read
in the pool by address, the tables' update, the previous owner's comparison); the seal reads
each page where it lies in the pool, with no copy: its fill check sums every row in place
(``page_sums``), and its syndrome parities and NaN/Inf test are one pass a page
(:func:`pool_facts`). Each has a numpy (or read-back, or copy) path where numba, or the
layout, does not allow it.

Compiled with numba (a dependency of vLLM) on first use, cached on disk (``cache=True``): about
a second once per machine, then a load. Where numba cannot be imported, the same digests are
computed with numpy (:func:`digest_rows` only; the wrapper is then not used: rows are read back
from the pages), several times slower; :func:`backend` says which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_kvguard.digest.kernel import P1, P2, P3, P5, _avalanche
from vllm_kvguard.digest.syndrome import SYNDROME_WORDS

_compiled: dict[str, Callable[..., Any]] | None = None
_why_not = ""


def _sums_numpy(words: np.ndarray, slots: np.ndarray, first_word: int = 0) -> np.ndarray:
    """Per row, the sum of its words' terms (words (rows, n) uint64; word i is the row's word
    ``first_word + i``), in numpy (the fallback; :func:`rows.row_digests_reference` is the
    definition both are tested against)."""
    n = words.shape[1]
    with np.errstate(over="ignore"):
        keys = np.arange(first_word + 1, first_word + n + 1, dtype=np.uint64) * np.uint64(P5)
        a = keys[None, :] + (slots.astype(np.uint64) * np.uint64(P3))[:, None] + words * np.uint64(P2)
        a = (a << np.uint64(31)) | (a >> np.uint64(33))
        return _avalanche(a * np.uint64(P1)).sum(axis=1, dtype=np.uint64)


def _finish_numpy(sums: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out = _avalanche(np.asarray(sums, dtype=np.uint64))
    out[out == 0] = 1
    return out


def compiled() -> dict[str, Callable[..., Any]] | None:
    """The compiled kernels, built once (None where numba cannot be used: :func:`backend`)."""
    global _compiled, _why_not
    if _compiled is None and not _why_not:
        try:
            # Imported here, not with this module: importing numba (llvmlite) before vLLM's
            # worker has started breaks vLLM 0.32's kernel scan (connector/patches.py,
            # guard_kernel_scan: the plugin guards the scans of later engines; the first
            # engine's scan has run before its worker calls this).
            from vllm_kvguard.digest import _rowkernels

            kernels = _rowkernels.KERNELS
            # Compile (or load from the cache) now, not in a step: a 1-row call of each, with
            # the argument kinds the worker passes.
            w = np.zeros((1, 1), dtype=np.uint64)
            s = np.zeros(1, dtype=np.int64)
            out = np.zeros(1, dtype=np.uint64)
            kernels["digest_rows"](w, s, out)
            kernels["finish"](out, out)
            # add_layer reads and writes addresses: an empty call (n = 0) touches none.
            spec = np.zeros((1, 4), dtype=np.int64)
            kernels["add_layer"](0, 0, 0, 0, 0, 1, 0, 0, True, 16, 0, 1, 0, 0, 1, spec)
            # keep_written with no rows (its tables' kinds: 1-d, 3-d probe and land tables).
            probe = np.zeros((1, 1, 1), dtype=np.uint64)
            land = np.zeros((1, 1, 3), dtype=np.int64)
            kernels["keep_written"](s[:0], s[:0], s[:0], 16, out, probe, land, spec, out, out, out == 0, s)
            # page_sums and page_facts over no pages (page_facts' words are uint64 whatever
            # the pages' dtype).
            lanes = np.zeros((0, 5), dtype=np.int64)
            kernels["page_sums"](s, 0, s[:0], 16, 1, lanes, spec[:0], out)
            kernels["page_changes"](
                s,
                0,
                s[:0],
                1,
                np.zeros((0, 16), np.uint64),
                1,
                lanes,
                spec[:0],
                out,
                s,
                np.zeros(2, np.int64),
            )
            zero = np.uint64(0)
            kernels["page_facts"](
                s, 0, s[:0], 1, zero, zero, zero, False, np.zeros((0, SYNDROME_WORDS), np.uint64), out == 0
            )
            _compiled = kernels
        except Exception as exc:  # numba missing or unusable here: numpy computes the same
            _why_not = f"{type(exc).__name__}: {exc}"
    return _compiled


def backend() -> str:
    """Which code computes host row digests: ``numba`` or ``numpy (why)``."""
    return "numba" if compiled() is not None else f"numpy ({_why_not})"


def digest_rows(raw: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """KVG64 digest of each row of ``raw`` (rows x bytes, a multiple of 8 bytes; any dtype
    viewed as bytes), keyed by its slot in the block; uint64, never 0."""
    words = np.ascontiguousarray(raw).view(np.uint8).view(np.uint64).reshape(len(raw), -1)
    slots = np.asarray(slots, dtype=np.int64)
    kernels = compiled()
    if kernels is None:
        return _finish_numpy(_sums_numpy(words, slots))
    out = np.empty(len(words), dtype=np.uint64)
    kernels["digest_rows"](words, slots, out)
    return out


def finish(sums: np.ndarray) -> np.ndarray:
    """Digests from per-row sums of every word's term (:func:`add_layer`'s)."""
    kernels = compiled()
    if kernels is None:
        return _finish_numpy(sums)
    out = np.empty(len(sums), dtype=np.uint64)
    kernels["finish"](sums, out)
    return out


def page_facts(lanes: np.ndarray, test: tuple[int, int, int] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(syndromes, NaN/Inf flags) of pages given as element lanes (pages, elements;
    C-contiguous, whole 64-bit words a page): :func:`pool_facts` of the array's rows. None
    without numba, or for pages not laid out so (numpy's passes then)."""
    if lanes.ndim != 2 or not lanes.flags.c_contiguous or lanes.ctypes.data % 8:
        return None
    n = len(lanes)
    at = np.array([lanes.ctypes.data], dtype=np.int64)
    return pool_facts(
        at, lanes.strides[0], np.arange(n, dtype=np.int64), lanes.shape[1] * lanes.itemsize, test
    )


class PoolFacts:
    """:func:`pool_facts` of one pool, its tests and constants taken once (a step's seal then
    pays one allocation each for the results and the compiled call): made by
    :func:`pool_facts_plan`."""

    def __init__(
        self, kernel: Any, layer_at: np.ndarray, page_bytes: int, words: int, test: tuple[int, int, int]
    ):
        self._kernel = kernel
        self._layer_at = layer_at
        self._page_bytes = page_bytes
        self._words = words
        self._layers = len(layer_at)
        self._test = tuple(np.uint64(x & _WORD) for x in test)
        self._no_test = (np.uint64(0),) * 3

    def __call__(self, ids: np.ndarray, check: bool) -> tuple[np.ndarray, np.ndarray]:
        """(syndromes, NaN/Inf flags) of the pages ``ids`` (inside the pool: the caller checks),
        as :func:`pool_facts` gives them; ``check``: the NaN/Inf test (else all False)."""
        n = self._layers * len(ids)
        syn = np.empty((n, SYNDROME_WORDS), dtype=np.uint64)
        flags = np.empty(n, dtype=bool)
        mask, low, sign = self._test if check else self._no_test
        self._kernel(self._layer_at, self._page_bytes, ids, self._words, mask, low, sign, check, syn, flags)
        return syn, flags


def pool_facts_plan(
    layer_at: np.ndarray, page_bytes: int, size: int, test: tuple[int, int, int] | None
) -> PoolFacts | None:
    """:func:`pool_facts` for pages of this pool, checked once; None where it would return
    None (numpy's passes then)."""
    kernels = compiled()
    layer_at = np.ascontiguousarray(layer_at, dtype=np.int64)
    if kernels is None or size % 8 or page_bytes % 8 or (layer_at % 8).any():
        return None
    words = size // 8
    rows = -(-words // 64)
    if (rows - 1).bit_length() > SYNDROME_WORDS - 7:
        return None  # a page larger than syndromes address: numpy's passes raise
    return PoolFacts(kernels["page_facts"], layer_at, page_bytes, words, test or (0, 0, 0))


def pool_facts(
    layer_at: np.ndarray, page_bytes: int, ids: np.ndarray, size: int, test: tuple[int, int, int] | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(syndromes, NaN/Inf flags) of pages read where they lie, in one compiled pass each:
    layer L's page of block ``ids[p]`` is the ``size`` bytes at ``layer_at[L] + ids[p] x
    page_bytes`` (every address 8-byte aligned; the caller checks that they lie inside the
    pool), its results row ``L x len(ids) + p``. The syndromes as ``syndrome.syndromes`` gives
    them ((layers x pages, SYNDROME_WORDS) uint64: numpy's two passes and ``finish``) and, with
    ``test`` (the exponent mask, lowest exponent bit and sign bit of every lane of a word:
    ``dtypes.EXPONENT_TESTS``), whether each page holds a NaN or Inf (all False without). None
    without numba, for pages that are not whole aligned words, or too large for the syndromes
    to address (numpy's passes then)."""
    plan = pool_facts_plan(layer_at, page_bytes, size, test)
    return None if plan is None else plan(ids, test is not None)


_WORD = (1 << 64) - 1
