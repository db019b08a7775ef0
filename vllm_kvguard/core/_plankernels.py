"""The ledger's compiled loops (numba); imported by :func:`ledger.compiled` only, never with the
package. Module-level functions, so that numba can cache them on disk. The ledger's numpy code
is the definition they are tested against (tests/unit/core/test_ledger.py)."""

# mypy: ignore-errors
from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def place_decodes(nc, rows, table, table_len, block_size, out):
    # Where each decode of a step writes its one row: decode i has computed nc[i] tokens and
    # mirror row rows[i], so it writes slot nc[i] % block_size of the page at table position
    # nc[i] // block_size. out (3, n): the block, the slot and the table position. Returns
    # (pages filled by this row: slot block_size - 1, pages begun: slot 0, decodes with no
    # full page yet: col 0), or (-1, -1, -1) where some decode's page lies past its mirrored
    # table (the caller's numpy path handles that).
    fills = 0
    begun = 0
    short = 0
    for i in range(nc.shape[0]):
        col = nc[i] // block_size
        row = rows[i]
        if col >= table_len[row]:
            return -1, -1, -1
        if col == 0:
            short += 1
        slot = nc[i] - col * block_size
        out[0, i] = table[row, col]
        out[1, i] = slot
        out[2, i] = col
        if slot == block_size - 1:
            fills += 1
        if slot == 0:
            begun += 1
    return fills, begun, short
