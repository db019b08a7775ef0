"""rowhash's compiled loops (numba); imported by :func:`rowhash.compiled` only, never with the
package (see there). Module-level functions, so that numba can cache them on disk."""

# mypy: ignore-errors
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from vllm_kvguard.digest.kernel import P1, P2, P3, P5

_U = numba.uint64
_P1, _P2, _P3, _P5 = _U(P1), _U(P2), _U(P3), _U(P5)


@numba.njit(cache=True, nogil=True)
def _mix(x):
    x ^= x >> _U(33)
    x *= _P2
    x ^= x >> _U(29)
    x *= _P3
    return x ^ (x >> _U(32))


@numba.njit(cache=True, nogil=True)
def _terms(words, count, key):
    # The sum of the terms of a row's ``count`` words (an array row, or a pointer to them);
    # key: the key of the word before words[0] (j x P5 + slot x P3).
    acc = _U(0)
    for j in range(count):
        key += _P5
        a = key + words[j] * _P2
        a = (a << _U(31)) | (a >> _U(33))
        acc += _mix(a * _P1)
    return acc


@numba.njit(cache=True, nogil=True)
def digest_rows(words, slots, out):
    for r in range(words.shape[0]):
        d = _mix(_terms(words[r], words.shape[1], _U(slots[r]) * _P3))
        out[r] = d if d != _U(0) else _U(1)


def _pointer_to(kind):
    # An intrinsic: the ``kind`` values at a memory address (an int), as a pointer the loops
    # can index.
    @intrinsic
    def at(typingctx, address):
        sig = types.CPointer(kind)(address)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return at


_words_at = _pointer_to(types.uint64)
_ints_at = _pointer_to(types.int64)
_halves_at = _pointer_to(types.uint16)


@numba.njit(cache=True, nogil=True)
def add_layer(
    n,
    k_at,
    k_step,
    v_at,
    v_step,
    words,
    slots_from,
    slots_at,
    first,
    block_size,
    jk,
    jv,
    sums_at,
    probe_at,
    probe_step,
    spec,
):
    # One layer of the n rows the write op was handed, read where they lie (addresses, not
    # arrays: numba's dispatch of a few ints costs a fraction of that of strided arrays, and
    # the caller needs no numpy views of torch's tensors). Row r's K words are the ``words``
    # 64-bit words at k_at + r x k_step (bytes), its V words at v_at + r x v_step; they are the
    # row's words jk.. and jv... ``first`` (the step's first layer): the slot mapping at
    # slots_from is copied to slots_at (int64) and sums[r] starts again. ``spec`` (m, 4): copy
    # words [lo, lo + count) of K (0) or V (1) to the probe at probe_at + r x probe_step
    # words + at. The caller checks every address and extent (WrittenRows.observe).
    slots = _ints_at(slots_at)
    sums = _words_at(sums_at)
    probe = _words_at(probe_at)
    if first:
        source = _ints_at(slots_from)
        for r in range(n):
            slots[r] = source[r]
    for r in range(n):
        k = _words_at(k_at + r * k_step)
        v = _words_at(v_at + r * v_step)
        s = _U(slots[r] % block_size) * _P3
        t = _terms(k, words, s + _U(jk) * _P5) + _terms(v, words, s + _U(jv) * _P5)
        sums[r] = t if first else sums[r] + t
        row = r * probe_step
        for m in range(spec.shape[0]):
            lo, at, count = spec[m, 1], spec[m, 2], spec[m, 3]
            src = k if spec[m, 0] == 0 else v
            for i in range(count):
                probe[row + at + i] = src[lo + i]


@numba.njit(cache=True, nogil=True)
def finish(sums, out):
    for r in range(sums.shape[0]):
        d = _mix(sums[r])
        out[r] = d if d != _U(0) else _U(1)


@numba.njit(cache=True, nogil=True)
def keep_written(blocks, slots, flat, block_size, sums, probe, land, spec, rows, previous, same, missed):
    # The rows a step wrote, kept as their digests where they landed: row r is written row r
    # (its slot flat[r] = blocks[r] x block_size + slots[r], else -1 is returned and nothing is
    # touched); it landed where every layer's page holds its probe (land[layer, m]: the page
    # address of run m's first word, bytes a block, bytes a slot; spec[m]: its words in the
    # probe); then rows[flat] = its digest and same[r] = whether that equals previous[flat]
    # (nonzero). The rows that did not land are listed in ``missed`` (their count returned),
    # same[r] False: the caller digests what their pages hold.
    n = blocks.shape[0]
    for r in range(n):
        if blocks[r] * block_size + slots[r] != flat[r]:
            return -1
    layers = probe.shape[1]
    # First every cache line the check reads, with loads independent of one another (one
    # store a row, to ``same`` as scratch): after a forward the pages and the previous owner's
    # rows are out of cache, and misses the core issues together cost a fraction of misses
    # taken one by one. The check itself follows.
    for r in range(n):
        f = flat[r]
        hit = (previous[f] != _U(0)) & (rows[f] != _U(1))  # (both lines: read, then written)
        for layer in range(layers):
            for m in range(spec.shape[0]):
                where = land[layer, m]
                word = _words_at(where[0] + blocks[r] * where[1] + slots[r] * where[2])[0]
                hit &= word == probe[r, layer, spec[m, 2]]
        same[r] = hit
    missing = 0
    for r in range(n):
        ok = True
        for layer in range(layers):
            for m in range(spec.shape[0]):
                where = land[layer, m]
                page = _words_at(where[0] + blocks[r] * where[1] + slots[r] * where[2])
                at = spec[m, 2]
                for i in range(spec[m, 3]):
                    if page[i] != probe[r, layer, at + i]:
                        ok = False
        if ok:
            d = _mix(sums[r])
            if d == _U(0):
                d = _U(1)
            f = flat[r]
            p = previous[f]
            rows[f] = d
            same[r] = d == p and p != _U(0)
        else:
            same[r] = False
            missed[missing] = r
            missing += 1
    return missing


@numba.njit(cache=True, nogil=True)
def _sum_page(layer_at, page_bytes, block, upto, layer_words, lanes, runs, sums):
    # sums[s] (s < upto) = the sum of row s's terms over every layer's page of ``block``:
    # page_sums' loop for one page, its first ``upto`` slots only.
    for s in range(upto):
        sums[s] = _U(0)
    for layer in range(layer_at.shape[0]):
        page = layer_at[layer] + block * page_bytes
        first = _U(layer * layer_words)
        for m in range(lanes.shape[0]):
            e0 = _halves_at(page + lanes[m, 1])
            e1 = _halves_at(page + lanes[m, 2])
            e2 = _halves_at(page + lanes[m, 3])
            e3 = _halves_at(page + lanes[m, 4])
            key = (first + _U(lanes[m, 0] + 1)) * _P5
            for s in range(upto):
                w = _U(e0[s]) | (_U(e1[s]) << _U(16)) | (_U(e2[s]) << _U(32)) | (_U(e3[s]) << _U(48))
                a = key + _U(s) * _P3 + w * _P2
                a = (a << _U(31)) | (a >> _U(33))
                sums[s] += _mix(a * _P1)
        for q in range(runs.shape[0]):
            j0, count, off, step = runs[q, 0], runs[q, 1], runs[q, 2], runs[q, 3]
            for s in range(upto):
                key = (first + _U(j0)) * _P5 + _U(s) * _P3
                sums[s] += _terms(_words_at(page + off + s * step), count, key)


@numba.njit(cache=True, nogil=True)
def page_sums(layer_at, page_bytes, ids, block_size, layer_words, lanes, runs, sums):
    # The sums of every row of whole pages, read where they lie (HostRows.copy_plan): layer L's
    # page of block ids[p] starts at layer_at[L] + ids[p] x page_bytes (the pool, or a copy
    # of pages: ids 0, 1, ..); sums[p x block_size + s] is row s's. lanes (m, 5): row word j
    # (of a layer) made of 4 16-bit elements whose slots lie side by side (vLLM's CPU K: slot
    # s's element at byte offset off + 2 s), the 4 offsets; the loop over slots reads them as
    # vectors. runs (r, 4): words j0 .. j0 + count of every slot contiguous at byte offset
    # off + s x step.
    for p in range(ids.shape[0]):
        row = p * block_size
        _sum_page(
            layer_at, page_bytes, ids[p], block_size, layer_words, lanes, runs, sums[row : row + block_size]
        )


@numba.njit(cache=True, nogil=True)
def page_changes(layer_at, page_bytes, ids, limit, expected, layer_words, lanes, runs, sums, changed, counts):
    # The rows of pages (read as page_sums reads them) whose digest is no longer ``expected``
    # (pages x slots; 0: a row not checked): their flat indices p x slots + s go to ``changed``
    # and their count is returned; -1, with nothing read, where some id is outside [0, limit).
    # A page's rows are summed up to its last checked row only (a page being filled reads its
    # written rows, not the empty rest); sums: scratch of one page's rows. counts[0] += rows
    # checked, counts[1] += pages with a row checked.
    for p in range(ids.shape[0]):
        if ids[p] < 0 or ids[p] >= limit:
            return -1
    block_size = expected.shape[1]
    found = 0
    for p in range(ids.shape[0]):
        upto = 0
        for s in range(block_size):
            if expected[p, s] != _U(0):
                upto = s + 1
                counts[0] += 1
        if upto == 0:
            continue
        counts[1] += 1
        _sum_page(layer_at, page_bytes, ids[p], upto, layer_words, lanes, runs, sums)
        for s in range(upto):
            want = expected[p, s]
            if want == _U(0):
                continue
            d = _mix(sums[s])
            if d == _U(0):
                d = _U(1)
            if d != want:
                changed[found] = p * block_size + s
                found += 1
    return found


@numba.njit(cache=True, nogil=True)
def page_facts(layer_at, page_bytes, ids, count, mask, low, sign, check, syn, flags):
    # One pass over each page for its syndrome and the NaN/Inf test, read where it lies: layer
    # L's page of block ids[p] is ``count`` 64-bit words at layer_at[L] + ids[p] x page_bytes
    # (the pool, or rows of an array: ids 0, 1, ..); its results go to row L x len(ids) + p.
    # col[c] the XOR of the page's words c, c + 64, ..; syn[i] as
    # syndrome.finish(*syndrome.parities(page)) gives it: [0] the XOR of every word, [1 + b]
    # (b < 6) of the columns c with bit b set, [7 + b] of the 64-word rows r with bit b set;
    # with ``check``, flags[i] whether some element lane has every exponent bit set (NaN or
    # Inf): the word test of dtypes.EXPONENT_TESTS, ((w & mask) + low) & sign, on the same words.
    width = syn.shape[1]
    k = ids.shape[0]
    col = np.empty(64, dtype=np.uint64)
    for layer in range(layer_at.shape[0]):
        for p in range(k):
            page = _words_at(layer_at[layer] + ids[p] * page_bytes)
            out = syn[layer * k + p]
            for c in range(64):
                col[c] = _U(0)
            for i in range(width):
                out[i] = _U(0)
            bad = _U(0)
            for r in range((count + 63) // 64):
                lo = 64 * r
                acc = _U(0)
                for c in range(min(64, count - lo)):
                    w = page[lo + c]
                    col[c] ^= w
                    acc ^= w
                    bad |= ((w & mask) + low) & sign
                b = 0
                while r >> b:
                    if (r >> b) & 1:
                        out[7 + b] ^= acc
                    b += 1
            for c in range(64):
                out[0] ^= col[c]
                for b in range(6):
                    if (c >> b) & 1:
                        out[1 + b] ^= col[c]
            flags[layer * k + p] = check and bad != _U(0)


KERNELS: dict[str, Callable[..., Any]] = {
    "digest_rows": digest_rows,
    "add_layer": add_layer,
    "finish": finish,
    "keep_written": keep_written,
    "page_sums": page_sums,
    "page_changes": page_changes,
    "page_facts": page_facts,
}
