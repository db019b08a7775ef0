"""The ledger's compiled loops (core/_plankernels.py), built or loaded once at start-up, and
the arguments that warm every kind a step passes; numpy computes the same where numba is
missing (:func:`backend` says which).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from vllm_kvguard.core.plan import (
    NO_FLAGS,
)

_compiled: ModuleType | None = None
_why_not = ""


def compiled() -> ModuleType | None:
    """The ledger's compiled loops (core/_plankernels.py), built or loaded once; None where
    numba cannot be used (the plan then takes its numpy path, which computes the same):
    :func:`backend` says which. A decode step's placement is then one call instead of a dozen
    numpy expressions, each of which costs 10-25 µs in the engine, where the forward has pushed
    numpy's code out of the CPU's caches (docs/performance.md)."""
    global _compiled, _why_not
    if _compiled is None and not _why_not:
        try:
            # Imported here, not with this module (see digest/rowhash.py's compiled(): numba
            # imported before vLLM's worker starts trips vLLM 0.32's kernel scan, which the
            # plugin guards).
            from vllm_kvguard.core import _plankernels

            # Compile (or load from numba's cache) now, not in a step: the kinds the plan passes.
            for args in _warm_args():
                _plankernels.place_decodes(*args)
            for args in _warm_grow_args():
                _plankernels.grow_decodes(*args)
            for args in _warm_close_args():
                _plankernels.close_decodes(*args)
            state = np.zeros(2, dtype=np.uint8)
            _plankernels.count_states(state, 1, 2)
            _plankernels.next_states(state, 0, 1, 4096, 1, 2, np.empty(1, dtype=np.int64))
            _compiled = _plankernels
        except Exception as exc:  # numba missing or unusable here: numpy computes the same
            _why_not = f"{type(exc).__name__}: {exc}"
    return _compiled


def _warm_args() -> list[tuple[object, ...]]:
    """place_decodes' arguments of every kind a step passes: the mirror rows are writeable, or
    read-only where they are the cached rows of the last step's request list (numba compiles
    each kind apart: one missed here would be compiled in a step, 0.16 s on the machine of
    docs/performance.md with an empty numba cache)."""
    one = np.zeros(1, dtype=np.int64)
    cached = one.copy()
    cached.flags.writeable = False
    table = np.zeros((1, 1), dtype=np.int32)
    return [(one, rows, table, one + 1, 16, np.empty((3, 1), dtype=np.int64)) for rows in (one, cached)]


def _warm_grow_args() -> list[tuple[object, ...]]:
    """grow_decodes' arguments of every kind a step passes (the mirror rows writeable or the
    cached read-only ones, as for :func:`_warm_args`), on tables of one block: block 0 is
    handed to writer 0 and appended to mirror row 0 (scratch tables, thrown away)."""
    one = np.zeros(1, dtype=np.int64)
    cached = one.copy()
    cached.flags.writeable = False
    # table_len, writers, then the ledger's tables in grow_decodes' order (state .. held)
    tables = (
        np.int64,
        np.int64,
        np.uint8,
        np.uint64,
        np.int64,
        np.int64,
        np.uint64,
        np.uint64,
        bool,
        np.int64,
    )
    return [
        (
            one,
            one.copy(),
            rows,
            NO_FLAGS,
            False,
            np.full((1, 2), -1, dtype=np.int32),
            *(np.zeros(1, dtype=t) for t in tables),
            np.zeros(1, dtype=np.int32),
            np.empty(1, dtype=np.int64),
            np.empty(1, dtype=np.int8),
        )
        for rows in (one, cached)
    ]


def _warm_close_args() -> list[tuple[object, ...]]:
    """close_decodes' arguments as a step passes them (the placement's rows of blocks and slots,
    the ledger's tables), on one block (scratch tables, thrown away)."""
    placed = np.zeros((3, 1), dtype=np.int64)
    # state, generation, writer_of, checked_at, verified_step, verified_before
    tables = (np.uint8, np.uint32, np.int64, np.float64, np.int64, np.int64)
    out = (np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64))
    return [(placed[0], placed[1], 16, *(np.zeros(1, dtype=t) for t in tables), 0.0, 1, *out)]


def backend() -> str:
    """Which code places a decode step's rows: ``numba`` or ``numpy (why)``."""
    return "numba" if compiled() is not None else f"numpy ({_why_not})"
