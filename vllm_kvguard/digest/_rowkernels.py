"""rowhash's compiled loops (numba); imported by :func:`rowhash.compiled` only, never with the
package (see there). Module-level functions, so that numba can cache them on disk."""

# mypy: ignore-errors
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba

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
def _terms(words, r, key):
    # key: the key of the row's word before words[r, 0] (j x P5 + slot x P3).
    acc = _U(0)
    for j in range(words.shape[1]):
        key += _P5
        a = key + words[r, j] * _P2
        a = (a << _U(31)) | (a >> _U(33))
        acc += _mix(a * _P1)
    return acc


@numba.njit(cache=True, nogil=True)
def digest_rows(words, slots, out):
    for r in range(words.shape[0]):
        d = _mix(_terms(words, r, _U(slots[r]) * _P3))
        out[r] = d if d != _U(0) else _U(1)


@numba.njit(cache=True, nogil=True)
def add_layer(kw, vw, flat, block_size, jk, jv, sums, first, probe, spec):
    # One layer of the rows the write op was handed: K words (rows, n) are the row's words
    # jk.., V words jv..; sums[r] starts again where ``first``. ``spec`` (m, 4): copy words
    # [lo, lo + count) of K (0) or V (1) to probe[r, at:at + count].
    for r in range(kw.shape[0]):
        s = _U(flat[r] % block_size) * _P3
        t = _terms(kw, r, s + _U(jk) * _P5) + _terms(vw, r, s + _U(jv) * _P5)
        sums[r] = t if first else sums[r] + t
        for m in range(spec.shape[0]):
            lo, at, count = spec[m, 1], spec[m, 2], spec[m, 3]
            if spec[m, 0] == 0:
                for i in range(count):
                    probe[r, at + i] = kw[r, lo + i]
            else:
                for i in range(count):
                    probe[r, at + i] = vw[r, lo + i]


@numba.njit(cache=True, nogil=True)
def finish(sums, out):
    for r in range(sums.shape[0]):
        d = _mix(sums[r])
        out[r] = d if d != _U(0) else _U(1)


KERNELS: dict[str, Callable[..., Any]] = {
    "digest_rows": digest_rows,
    "add_layer": add_layer,
    "finish": finish,
}
