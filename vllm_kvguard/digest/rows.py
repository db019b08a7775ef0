"""Row digests: pages covered while they are still being written.

A page's seal is taken when its last slot is written; until then its written slots
were covered by nothing, and a change to them was sealed in at fill time. A *row* is
one slot of one block across every layer (its K and V, every head): what one token
wrote. Each row is hashed once, right after the forward that wrote it, into a
(blocks x slots) table, so a page carries a digest per written slot from its first
token on:

- a partial page is verified by re-hashing its written rows (sampled, paranoid and
  scrub verification cover unfilled pages this way);
- at fill, the rows written in earlier steps are checked before the page is sealed,
  so a page is never sealed over data that changed after it was written;
- a row whose digest after the forward that wrote it equals the digest the block's
  previous owner had at that slot is a write that never landed (lost write).

Every row digest is KVG64 (kernel.py's word function): one term per 64-bit word of the row
(layers concatenated in order, each layer's K then V), keyed by slot and word, summed,
then avalanched; its numpy reference is :func:`row_digests_reference`. Host pages: in
compiled loops (:mod:`.rowhash`), after one gather per layer of only the rows asked for,
or, for rows vLLM's CPU write op was just handed, summed a layer at a time as it hands
them over (no copy of the rows). Pages off the host: computed where the rows live with
torch (no page leaves the device). A digest is never 0 (0 marks an unwritten slot).
(Host rows were XXH3-64 until 2026-12-05; a row digest never leaves the process, so the
change needs no migration.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vllm_kvguard.digest import rowhash
from vllm_kvguard.digest.kernel import P1, P2, P3, P5, _avalanche
from vllm_kvguard.digest.row_access import HostRows, RowAccess

_MASK = (1 << 64) - 1


def _ints(values: np.ndarray) -> np.ndarray:
    """``values`` as a writeable, contiguous int64 array (the one kind the compiled loops are
    built for: numba compiles again for a read-only one)."""
    out = np.ascontiguousarray(values, dtype=np.int64)
    return out if out.flags.writeable else out.copy()


def row_digests_reference(rows: np.ndarray, slots: Sequence[int]) -> np.ndarray:
    """The device path's row digest of each row (uint8 array, one row per line; a multiple of 8
    bytes): avalanche(sum over words j of kvg64_term(word_j, key (j + 1) * P5 + slot * P3)). The
    definition the torch version is checked against."""
    words = np.ascontiguousarray(rows).view("<u8").astype(np.uint64)
    out = np.empty(len(words), dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = np.arange(1, words.shape[1] + 1, dtype=np.uint64) * np.uint64(P5)
        for i, (w, s) in enumerate(zip(words, slots, strict=True)):
            a = keys + np.uint64((int(s) * P3) & _MASK) + w * np.uint64(P2)
            a = (a << np.uint64(31)) | (a >> np.uint64(33))
            h = np.uint64(int(_avalanche(a * np.uint64(P1)).sum(dtype=np.uint64)) & _MASK)
            d = int(_avalanche(np.array([h], dtype=np.uint64))[0])
            out[i] = d or 1
    return out


class RowDigests:
    """The digest of every written slot of every block, this generation and the previous one.

    ``gathers``: per layer, the :class:`RowAccess` of that layer (fire drills write rows
    through it; it also reads them where there is no ``host``). ``host``: the numpy gather of
    host pages that hashing reads rows through."""

    # Whether recording and checking return device results read later (DeviceRowDigests).
    deferred = False
    # What the host tables hold: the digests (here), or 0/1 markers (DeviceRowDigests).
    _host_dtype: type = np.uint64

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        gathers: Sequence[RowAccess],
        num_blocks: int,
        block_size: int,
        host: HostRows | None = None,
    ) -> None:
        self.gathers = list(gathers)
        self.host = host
        self.block_size = block_size
        self.device = tensors[0].device
        self.on_host = all(t.device.type == "cpu" for t in tensors)
        probe = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.row_bytes = sum(g(probe, probe).numel() for g in gathers) * tensors[0].element_size()
        if self.row_bytes % 8:
            raise ValueError(f"a row of {self.row_bytes} bytes is not whole 64-bit words")
        self.rows: np.ndarray = np.zeros((num_blocks, block_size), dtype=self._host_dtype)
        self.previous: np.ndarray = np.zeros((num_blocks, block_size), dtype=self._host_dtype)
        # Flat views of both (the tables are never reallocated, only written in place), as
        # record_written's compiled call takes them every step.
        self._rows_flat = self.rows.reshape(-1)
        self._previous_flat = self.previous.reshape(-1)
        self._slots = np.zeros(0, dtype=np.int64)
        # check_pages' compiled call: one page's row sums, and the changed rows' indices (grown
        # to the largest check).
        self._page_scratch = np.zeros(block_size, dtype=np.uint64)
        self._changed = np.zeros(0, dtype=np.int64)
        # record_written's compiled call (found once) and its outputs (grown to the largest
        # step: a step's flags are a view of them, valid until the next call).
        self._keep_written: Any = None
        self._same = np.zeros(0, dtype=bool)
        self._missed = np.zeros(0, dtype=np.int64)

    def nbytes(self) -> int:
        return self.rows.nbytes + self.previous.nbytes

    def hash(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Digests of the rows (blocks[i], slots[i]) as they are now, uint64 (never 0)."""
        n = len(blocks)
        if not n:
            return np.zeros(0, dtype=np.uint64)
        if self.host is not None:
            return self._hash_host(self.host, blocks, np.asarray(slots, dtype=np.int64))
        b = torch.as_tensor(blocks, dtype=torch.int64, device=self.device)
        s = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        # One gather per layer of just these rows, layers side by side: (rows, bytes).
        gathered = torch.cat([g(b, s).contiguous().view(torch.uint8) for g in self.gathers], dim=1)
        if not self.on_host:
            return row_digests_torch(gathered.view(torch.int64), s).cpu().numpy().view(np.uint64)
        return rowhash.digest_rows(gathered.numpy(), np.asarray(slots))

    # Rows gathered and hashed at a time on the host: the scratch rows stay in cache between the
    # gather and the hash (a prefill's thousands of rows at once were 5-10x slower per row).
    CHUNK = 256

    def _hash_host(self, host: HostRows, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        n = len(blocks)
        out = np.empty(n, dtype=np.uint64)
        for lo in range(0, n, self.CHUNK):
            hi = min(n, lo + self.CHUNK)
            raw = host.gather(blocks[lo:hi], slots[lo:hi], reuse=True)
            out[lo:hi] = rowhash.digest_rows(raw, slots[lo:hi])
        return out

    def _as_written(
        self, host: HostRows, blocks: np.ndarray, slots: np.ndarray, digests: np.ndarray, probe: np.ndarray
    ) -> np.ndarray:
        landed = host.landed(blocks, slots, probe)
        if landed.all():
            return digests
        # Not as written: digest what the page holds (as rows read back from it always were).
        missed = np.flatnonzero(~landed)
        digests = digests.copy()
        digests[missed] = self.hash(blocks[missed], slots[missed])
        return digests

    def record(
        self,
        blocks: np.ndarray,
        slots: np.ndarray,
        digests: np.ndarray | None = None,
        probe: np.ndarray | None = None,
        flat: np.ndarray | None = None,
    ) -> np.ndarray:
        """Hash rows just written and keep their digests; returns which of them equal what the
        block's previous owner had at that slot (a write that did not land). ``digests`` and
        ``probe`` (host rows with a :attr:`HostRows.probe_spec` only): the digests of the bytes
        vLLM was asked to write to each row and what :meth:`HostRows.landed` compares of them
        (the write op's wrapper, :class:`connector.layout.WrittenRows`); a row's digest is kept
        from them where the page shows it landed, instead of gathering the row back out of its
        page, and taken from the page where not. ``flat``: ``blocks * block_size + slots``
        where the caller has it (vLLM's slot mapping): the tables are then read and written
        through one flat index."""
        if digests is not None and probe is not None and self.host is not None and len(blocks):
            b = np.asarray(blocks, dtype=np.int64)
            s_ = np.asarray(slots, dtype=np.int64)
            digests = self._as_written(self.host, b, s_, digests, probe)
        else:
            digests = self.hash(blocks, slots)
        if flat is None:
            previous = self.previous[blocks, slots]
            self.rows[blocks, slots] = digests
        else:
            previous = self.previous.reshape(-1).take(flat)
            self.rows.reshape(-1)[flat] = digests
        same = digests == previous
        same &= previous != 0
        return same

    def record_written(
        self,
        blocks: np.ndarray,
        slots: np.ndarray,
        flat: np.ndarray,
        sums: np.ndarray,
        probe: np.ndarray,
    ) -> np.ndarray | None:
        """:meth:`record` of the rows a step wrote, from their KVG64 sums as the write op's
        wrapper took them (:class:`connector.layout.WrittenRows`), in one compiled call (the
        usual step): the rows in the order they were written (``flat``: vLLM's slot mapping,
        ``blocks * block_size + slots``), the landing check, the tables' update and the
        comparison with the previous owner's rows. Rows that did not land are digested from
        their pages, as :meth:`record` does. None (nothing recorded) where the rows are not in
        written order, or the pages cannot be read by address (:attr:`HostRows.land`): the
        caller records them another way. The flags returned are a view of a buffer kept here
        (no allocation a step): valid until the next call."""
        host = self.host
        keep = self._keep_written
        if keep is None:
            kernels = rowhash.compiled()
            if kernels is None:
                return None
            keep = self._keep_written = kernels["keep_written"]
        if host is None or host.land is None or host.probe_spec is None:
            return None
        n = len(blocks)
        if len(flat) != n or len(sums) != n or len(probe) != n:
            return None
        blocks = _ints(blocks)
        slots = _ints(slots)
        if len(self._same) < n:
            self._same = np.zeros(max(n, 2 * len(self._same)), dtype=bool)
            self._missed = np.zeros(len(self._same), dtype=np.int64)
        same = self._same[:n]  # (every flag written: by the call, the rows that did not land below)
        missed = self._missed[:n]
        count = keep(
            blocks,
            slots,
            flat,
            self.block_size,
            sums,
            probe,
            host.land,
            host.probe_spec,
            self._rows_flat,
            self._previous_flat,
            same,
            missed,
        )
        if count < 0:
            return None
        if count:
            # Not as written: digest what the page holds (as rows read back always were).
            at = missed[:count]
            same[at] = self.record(blocks[at], slots[at])
        return same

    def written(self, blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, slots) of every written row of ``blocks``."""
        ids = np.asarray(blocks, dtype=np.int64)
        r, s = np.nonzero(self.rows[ids])
        return ids[r], s.astype(np.int64)

    def check(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Indices of the rows (blocks[i], slots[i]) that changed since they were recorded."""
        if not len(blocks):
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.hash(blocks, slots) != self.rows[blocks, slots])

    def check_pages(
        self, ids: np.ndarray, expected: np.ndarray, copy: np.ndarray | None = None
    ) -> np.ndarray:
        """:meth:`check` of whole pages (blocks ``ids``), where they lie in the pool or, with
        ``copy``, in a copy of them (layers, pages, page elements: :meth:`KVPages.seal_host_pages`
        where it copies them): ``expected`` (pages, slots) holds the digests the rows must
        still have (0: a row not checked). Returns the flat indices (page x slots + slot) of the
        rows that changed. One compiled call (rowhash's ``page_changes``) sums each page's rows in
        place up to its last checked row (the few not checked below it cost less than picking
        out the rest) and compares them; where the layout has no such plan
        (:attr:`HostRows.copy_plan`) or numba is missing, the copy's rows are transposed out of
        it (:meth:`HostRows.page_rows`), and the wanted rows are gathered out of the pool."""
        return self.check_pages_counted(ids, expected, copy)[0]

    def check_pages_counted(
        self, ids: np.ndarray, expected: np.ndarray, copy: np.ndarray | None = None
    ) -> tuple[np.ndarray, int, int]:
        """:meth:`check_pages`, and how many rows and pages (with a row checked) it checked."""
        assert self.host is not None
        host = self.host
        expected = np.ascontiguousarray(expected, dtype=np.uint64)
        if copy is not None:
            layout = self._copy_layout(host, copy)
        else:
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            layout = None if host.page_at is None else (host.page_at, host.page_bytes, ids)
        if layout is not None:
            # Pages read by address: the compiled call checks every id is in the pool (or the
            # copy) before it reads any.
            limit = host.num_blocks if copy is None else copy.shape[1]
            found = self._page_changes(host, *layout, expected, limit)
            if found is not None:
                return found
        wanted = np.flatnonzero(expected)
        if not len(wanted):
            return wanted, 0, 0
        pages = int(np.count_nonzero(expected.any(axis=1)))
        if copy is not None:
            got = rowhash.digest_rows(host.page_rows(copy), self._slot_run(len(expected)))
            return wanted[got[wanted] != expected.reshape(-1)[wanted]], len(wanted), pages
        if ids.min() < 0 or ids.max() >= host.num_blocks:
            raise IndexError(f"block ids outside the pool's {host.num_blocks} blocks")
        bs = self.block_size
        changed = wanted[self.hash(ids[wanted // bs], wanted % bs) != expected.reshape(-1)[wanted]]
        return changed, len(wanted), pages

    def _copy_layout(self, host: HostRows, pages: np.ndarray) -> tuple[np.ndarray, int, np.ndarray] | None:
        """(layer_at, page_bytes, ids) of a copy of whole pages (layers, pages, page elements),
        read as the pool is (:meth:`_page_digests`); None where its layout does not allow it."""
        layers, k = pages.shape[:2]
        if (
            layers != len(host.flat)
            or pages.shape[2] * pages.itemsize != host.page_elements * host.flat[0].itemsize
            or pages.strides[2] != pages.itemsize
            or pages.strides[1] % 8
            or pages.strides[0] % 8
            or pages.ctypes.data % 8
        ):
            return None
        at = pages.ctypes.data + pages.strides[0] * np.arange(layers, dtype=np.int64)
        return at, pages.strides[1], np.arange(k, dtype=np.int64)

    def _copy_digests(self, host: HostRows, pages: np.ndarray) -> np.ndarray | None:
        """Every row's digest of a copy of whole pages (layers, pages, page elements), read in
        place (:meth:`_page_digests`); None where the copy's layout does not allow it."""
        layout = self._copy_layout(host, pages)
        return None if layout is None else self._page_digests(host, *layout)

    @staticmethod
    def _in_place(host: HostRows) -> tuple[dict[str, Callable[..., Any]], np.ndarray, np.ndarray] | None:
        """(rowhash's kernels, lanes, runs) to read whole pages' rows in place
        (:attr:`HostRows.copy_plan`); None where the layout has no plan or numba is missing."""
        kernels = rowhash.compiled()
        plan = host.copy_plan
        if plan is None or kernels is None:
            return None
        return kernels, plan[0], plan[1]

    def _page_changes(
        self,
        host: HostRows,
        layer_at: np.ndarray,
        page_bytes: int,
        ids: np.ndarray,
        expected: np.ndarray,
        limit: int,
    ) -> tuple[np.ndarray, int, int] | None:
        """:meth:`check_pages_counted` by rowhash's ``page_changes`` (IndexError where some id
        is outside ``[0, limit)``); None where there is no plan or no numba."""
        compiled = self._in_place(host)
        if compiled is None:
            return None
        kernels, lanes, runs = compiled
        if len(self._changed) < expected.size:
            self._changed = np.empty(expected.size, dtype=np.int64)
        counts = np.zeros(2, dtype=np.int64)
        found = kernels["page_changes"](
            layer_at,
            page_bytes,
            ids,
            limit,
            expected,
            host.width * host.flat[0].itemsize // 8,
            lanes,
            runs,
            self._page_scratch,
            self._changed,
            counts,
        )
        if found < 0:
            raise IndexError(f"block ids outside the pool's {limit} blocks")
        return self._changed[:found].copy(), int(counts[0]), int(counts[1])

    def _page_digests(
        self, host: HostRows, layer_at: np.ndarray, page_bytes: int, ids: np.ndarray
    ) -> np.ndarray | None:
        """Every row's digest of the pages ``ids`` (layer L's page of block b at ``layer_at[L]
        + b x page_bytes``), read in place by rowhash's ``page_sums``
        (:meth:`HostRows._copy_plan`), page after page, slot after slot; None where there is no
        plan or no numba (tests and benchmarks compare every row's digest with the rows
        gathered; the checks use :meth:`_page_changes`)."""
        compiled = self._in_place(host)
        if compiled is None:
            return None
        kernels, lanes, runs = compiled
        sums = np.empty(len(ids) * self.block_size, dtype=np.uint64)
        kernels["page_sums"](
            layer_at,
            page_bytes,
            ids,
            self.block_size,
            host.width * host.flat[0].itemsize // 8,
            lanes,
            runs,
            sums,
        )
        return rowhash.finish(sums)

    def _slot_run(self, pages: int) -> np.ndarray:
        """0, 1, .., block_size - 1, ``pages`` times: every row's slot, page after page."""
        if len(self._slots) < pages * self.block_size:
            self._slots = np.tile(np.arange(self.block_size, dtype=np.int64), pages)
        return self._slots[: pages * self.block_size]

    def _ids(self, blocks: Sequence[int], slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.as_tensor(np.asarray(blocks, dtype=np.int64), device=self.device),
            torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.device),
        )

    def snapshot(self, blocks: Sequence[int], slots: Sequence[int]) -> list[torch.Tensor]:
        """Copies of the rows, every layer (fire drills: a write made not to land)."""
        b, s = self._ids(blocks, slots)
        return [g(b, s).clone() for g in self.gathers]

    def restore(self, blocks: Sequence[int], slots: Sequence[int], rows: list[torch.Tensor]) -> None:
        b, s = self._ids(blocks, slots)
        for g, values in zip(self.gathers, rows, strict=True):
            g.put(b, s, values)

    def flip(self, block: int, slots: Sequence[int], layer: int, bit: int) -> None:
        """Flip one bit of the first element of each of these rows in one layer (fire drills)."""
        b, s = self._ids([block] * len(slots), slots)
        access = self.gathers[layer]
        values = access(b, s).clone()
        values.view(torch.uint8)[:, 0] ^= 1 << (bit % 8)
        access.put(b, s, values)

    def roll(self, blocks: Sequence[int]) -> None:
        """Blocks handed to a new owner: their rows become the previous generation's."""
        if len(blocks):
            ids = np.asarray(blocks, dtype=np.int64)
            self.previous[ids] = self.rows[ids]
            self.rows[ids] = 0

    def forget(self, blocks: Sequence[int]) -> None:
        """Rows that mean nothing any more (a page being recomputed or zeroed)."""
        if len(blocks):
            self.rows[np.asarray(blocks, dtype=np.int64)] = 0

    def clear(self, blocks: np.ndarray, slots: np.ndarray) -> None:
        """Rows about to be rewritten (this step's forward writes them)."""
        self.rows[blocks, slots] = 0

    def had_previous(self, block: int, slots: Sequence[int]) -> bool:
        """Whether the block's previous owner left a row at any of these slots."""
        return bool(self.previous[block, list(slots)].any())

    def reset(self) -> None:
        """Every row forgotten, both generations (the KV cache was discarded)."""
        self.rows[:] = 0
        self.previous[:] = 0


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    # Logical shift right of int64 lanes (torch's >> is arithmetic).
    return (x >> n) & ((1 << (64 - n)) - 1)


def _avalanche_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 33)
    x = x * _signed(P2)
    x = x ^ _shr(x, 29)
    x = x * _signed(P3)
    return x ^ _shr(x, 32)


def row_digests_torch(words: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """:func:`row_digests_reference` on int64 words (rows x words) where they live."""
    n = words.shape[1]
    keys = torch.arange(1, n + 1, dtype=torch.int64, device=words.device) * _signed(P5)
    a = keys + slots.to(torch.int64)[:, None] * _signed(P3) + words * _signed(P2)
    a = (a << 31) | _shr(a, 33)
    h = _avalanche_t(a * _signed(P1)).sum(dim=1)
    d = _avalanche_t(h)
    return torch.where(d == 0, torch.ones_like(d), d)
