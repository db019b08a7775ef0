"""The ledger's compiled loops (numba); imported by :func:`compiled.compiled` only, never with the
package. Module-level functions, so that numba can cache them on disk. The ledger's numpy code
is the definition they are tested against (tests/unit/core/test_ledger.py)."""

# mypy: ignore-errors
from __future__ import annotations

import numba


@numba.njit(cache=True)
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


@numba.njit(cache=True)
def grow_decodes(
    grown,
    blocks,
    d_rows,
    fetched,
    has_fetched,
    table,
    table_len,
    writers,
    state,
    fingerprint,
    verified_step,
    verified_before,
    previous_key,
    owner_key,
    lost_evidence,
    writer_of,
    held,
    positions,
    sealed_out,
):
    # Decodes given one new block each this step (decode grown[i], mirror row d_rows[grown[i]],
    # block blocks[i], writer number writers[i]): append each block to its mirrored table (not
    # where fetched[grown[i]]: that table was read whole from vLLM) and hand it to its writer, as
    # the ledger's numpy path (_grow, _allocate_many, _owned) does. Checked first, nothing
    # changed where it fails: returns (1, 0) where a block is quarantined, still being written,
    # or given twice (the numpy path's audit then), (2, width) where the mirror needs
    # ``width`` columns (the caller widens it and calls again). Else (0, pages sealed): writes
    # each block's table position, and sealed_out[i] = 1 where block i was a sealed page, 2
    # where one that a live request still held (held before this step's hand-out).
    n = blocks.shape[0]
    width = 0
    for i in range(n):
        s = state[blocks[i]]
        if s == 1 or s == 3:  # FILLING, QUARANTINED
            return 1, 0
        if not (has_fetched and fetched[grown[i]]):
            end = table_len[d_rows[grown[i]]] + 1
            if end > width:
                width = end
    if n > 1:
        ordered = blocks.copy()
        ordered.sort()
        for i in range(1, n):
            if ordered[i] == ordered[i - 1]:
                return 1, 0
    if width > table.shape[1]:
        return 2, width
    sealed = 0
    for i in range(n):
        row = d_rows[grown[i]]
        end = table_len[row]
        if not (has_fetched and fetched[grown[i]]):
            table[row, end] = blocks[i]
            table_len[row] = end + 1
            end += 1
        positions[i] = end - 1
        b = blocks[i]
        sealed_out[i] = 0
        if state[b] == 2:  # SEALED: a cached page leaves the prefix cache
            sealed_out[i] = 2 if held[b] > 0 else 1
            sealed += 1
        state[b] = 1
        fingerprint[b] = 0
        verified_step[b] = -1
        verified_before[b] = -1
        previous_key[b] = owner_key[b]
        owner_key[b] = 0
        lost_evidence[b] = False
        writer_of[b] = writers[i]
        held[b] += 1
    return 0, sealed


@numba.njit(cache=True)
def close_decodes(
    blocks,
    slots,
    block_size,
    state,
    generation,
    writer_of,
    checked_at,
    verified_step,
    verified_before,
    now,
    step,
    fill_out,
    begun_out,
):
    # After a decode step's placement (decode i writes slot slots[i] of block blocks[i]): the
    # pages whose last slot a decode writes are sealed after the forward (not a quarantined one:
    # its index is left out), the pages whose first slot one writes are begun; both are marked
    # verified at ``step`` (the ledger's numpy path: _sealed, then mark_verified). Writes the
    # indices of the pages sealed into fill_out, of those begun into begun_out; returns how many
    # of each, or (-1, -1), with nothing changed, where two decodes fill the same block (a
    # fault's doing: the numpy path's fancy-indexed writes count it once).
    n_fill = 0
    n_begun = 0
    for i in range(blocks.shape[0]):
        if slots[i] == block_size - 1 and state[blocks[i]] != 3:  # not QUARANTINED
            fill_out[n_fill] = i
            n_fill += 1
        if slots[i] == 0:
            begun_out[n_begun] = i
            n_begun += 1
    if n_fill > 1:
        filled = blocks[fill_out[:n_fill]]
        filled.sort()
        for j in range(1, n_fill):
            if filled[j] == filled[j - 1]:
                return -1, -1
    for j in range(n_fill):
        b = blocks[fill_out[j]]
        state[b] = 2  # SEALED
        generation[b] += 1
        writer_of[b] = -1
    for j in range(n_fill + n_begun):
        b = blocks[fill_out[j]] if j < n_fill else blocks[begun_out[j - n_fill]]
        checked_at[b] = now
        last = verified_step[b]
        if last != step:
            verified_before[b] = last
        verified_step[b] = step
    return n_fill, n_begun


@numba.njit(cache=True)
def count_states(state, a, b):
    # How many entries of state are a or b (the scrubber's recount of sealed and filling pages:
    # one loop that keeps the GIL, where numpy's comparisons over the pool let go of it).
    count = 0
    for i in range(state.shape[0]):
        s = state[i]
        if s == a or s == b:  # noqa: SIM109 (numba)
            count += 1
    return count


@numba.njit(cache=True)
def next_states(state, cursor, want, window, a, b, out):
    # The scrubber's walk (core/scrub.py, Scrubber._next_sealed, whose numpy form this follows
    # window by window): up to want entries that are a or b from cursor on, wrapping once round
    # the pool, into out. Returns (how many, the cursor after them).
    n = state.shape[0]
    got = 0
    scanned = 0
    while got < want and scanned < n:
        end = min(n, cursor + window)
        last = -1
        more = False
        for j in range(cursor, end):
            s = state[j]
            if s == a or s == b:  # noqa: SIM109 (numba)
                if got < want:
                    out[got] = j
                    got += 1
                    last = j
                else:
                    more = True
                    break
        scanned += end - cursor
        cursor = last + 1 if more else end
        if cursor >= n:
            cursor = 0
    return got, cursor
