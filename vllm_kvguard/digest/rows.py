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
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_kvguard.digest import rowhash
from vllm_kvguard.digest.checks import PendingCheck
from vllm_kvguard.digest.kernel import CHECK, P1, P2, P3, P5, RECORD, RowGeometry, _avalanche
from vllm_kvguard.digest.pages import layer_step

_MASK = (1 << 64) - 1


def _ints(values: np.ndarray) -> np.ndarray:
    """``values`` as a writeable, contiguous int64 array (the one kind the compiled loops are
    built for: numba compiles again for a read-only one)."""
    out = np.ascontiguousarray(values, dtype=np.int64)
    return out if out.flags.writeable else out.copy()


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


class RowAccess:
    """Reads (and, for drills, writes) the rows (block, slot) of one layer as (rows, elements)."""

    def __call__(self, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def put(self, blocks: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError


def slot_view(tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """(num_blocks, block_size, ...) view of a block-first KV tensor whose pages index slots
    along page dimension ``axis`` (vLLM's GPU layouts). No copy."""
    return tensor.movedim(axis + 1, 1)


class AxisRows(RowAccess):
    """Rows of a layout that indexes slots along one page dimension."""

    def __init__(self, tensor: torch.Tensor, axis: int) -> None:
        self.view = slot_view(tensor, axis)

    def __call__(self, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.view[blocks, slots].reshape(len(blocks), -1)

    def put(self, blocks: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.view[blocks, slots] = values.reshape(self.view[blocks, slots].shape)


class PackedRows(RowAccess):
    """Rows of a packed layout: ``elements[s]`` lists the page's elements (flat, in memory order
    of a contiguous page) that slot ``s`` writes (vLLM's CPU layouts pack K per instruction set;
    the connector finds the map by probing vLLM's own write op)."""

    def __init__(self, tensor: torch.Tensor, elements: np.ndarray) -> None:
        if not tensor[0].is_contiguous():
            raise ValueError("packed rows need contiguous pages")
        self.flat = tensor.view(tensor.shape[0], -1)
        self.index = torch.as_tensor(np.asarray(elements, dtype=np.int64), device=tensor.device)

    def __call__(self, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.flat[blocks[:, None], self.index[slots]]

    def put(self, blocks: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.flat[blocks[:, None], self.index[slots]] = values


_LANES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _grid(offsets: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, strides) such that the ascending ``offsets`` are ``offsets[0] + sum(i_k x
    strides_k)`` over ``shape`` in C order, or None where they are no such grid."""
    shape: list[int] = []
    strides: list[int] = []
    cur = offsets
    while len(cur) > 1:
        step = int(cur[1] - cur[0])
        off = np.flatnonzero(np.diff(cur) != step)
        run = int(off[0]) + 1 if len(off) else len(cur)
        if len(cur) % run:
            return None
        grid = cur.reshape(-1, run)
        if not (grid - grid[:, :1] == np.arange(run) * step).all():
            return None
        shape.insert(0, run)
        strides.insert(0, step)
        cur = grid[:, 0]
    return tuple(shape) or (1,), tuple(strides) or (1,)


class _Part(NamedTuple):
    """Elements of a row that sit on one strided grid: columns [start, stop) of the row are the
    page's elements ``base + sum(i_k x strides_k) + slot x slot_stride`` over ``shape``."""

    start: int
    stop: int
    base: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    slot_stride: int


def _part_rows(view: np.ndarray, part: _Part, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """(rows, layers, part width): the part's elements of rows (blocks[i], slots[i]) through its
    view (layers, blocks, *grid, slots)."""
    index: tuple[Any, ...] = (slice(None), blocks, *(slice(None),) * len(part.shape), slots)
    return view[index].reshape(len(blocks), view.shape[0], -1)


def strided_parts(elements: np.ndarray) -> tuple[np.ndarray, list[_Part]] | None:
    """Split the element map (slots x elements: the flat elements of a page each slot writes)
    into strided grids: returns the map with its columns reordered part after part, and the
    parts; None where a slot is not the first slot's elements shifted by a fixed step per
    element (then the rows are read through the map itself)."""
    if len(elements) < 2:
        return None
    first = elements[0]
    step = elements[1] - first
    slots = np.arange(len(elements), dtype=np.int64)[:, None]
    if not (elements == first + slots * step).all():
        return None
    columns: list[np.ndarray] = []
    parts: list[_Part] = []
    start = 0
    for slot_stride in dict.fromkeys(step[np.argsort(first, kind="stable")].tolist()):
        cols = np.flatnonzero(step == slot_stride)
        cols = cols[np.argsort(first[cols], kind="stable")]
        grid = _grid(first[cols])
        if grid is None:
            return None
        columns.append(cols)
        parts.append(_Part(start, start + len(cols), int(first[cols[0]]), *grid, int(slot_stride)))
        start += len(cols)
    return elements[:, np.concatenate(columns)], parts


class HostRows:
    """Every layer's rows (block, slot) of host pages, gathered with numpy into one (rows,
    layers x elements) buffer, layers side by side in order. The rows of vLLM's CPU layouts are
    scattered over the page (K is packed per instruction set: one element of a row in each of
    many cache lines), so how they are read decides the cost: through strided views of the pool
    fitted from the probed element map (:func:`strided_parts`: numpy indexes (blocks, slots)
    across each grid in C), 1.4x (16 rows) to 4x (hundreds) faster than a ``take`` through the
    map's precomputed linear indices, which stays the fallback for maps with no such grid
    (docs/performance.md). ``elements`` (after construction): the map in this class's row
    order, which every other reader of the rows must use."""

    def __init__(self, tensors: Sequence[torch.Tensor], elements: np.ndarray) -> None:
        first = tensors[0]
        if first.element_size() not in _LANES:
            raise ValueError(f"KV element size {first.element_size()} has no numpy lane")
        self.flat: list[np.ndarray] = []
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("host rows need contiguous host pages")
            lanes = t.view(getattr(torch, f"int{8 * t.element_size()}"))
            self.flat.append(lanes.reshape(-1).numpy().view(_LANES[t.element_size()]))
        self.page_elements = first[0].numel()
        self.num_blocks = first.shape[0]
        self.dtype = first.dtype
        elements = np.asarray(elements, dtype=np.int64)
        fitted = strided_parts(elements)
        self.parts: list[_Part] = []
        # Per group of layers (all of them where they lie evenly spaced in one buffer, as vLLM
        # allocates them; else one each), per part: a view (layers, blocks, *grid, slots).
        self.views: list[tuple[int, int, list[np.ndarray]]] = []
        if fitted is not None:
            elements, self.parts = fitted
            size = first.element_size()
            step = layer_step(tensors) or 0
            groups = [(0, len(self.flat))] if step else [(i, 1) for i in range(len(self.flat))]
            for start, count in groups:
                self.views.append(
                    (
                        start,
                        count,
                        [
                            np.lib.stride_tricks.as_strided(
                                self.flat[start][p.base :],
                                shape=(count, self.num_blocks, *p.shape, len(elements)),
                                strides=tuple(
                                    size * x
                                    for x in (step // size, self.page_elements, *p.strides, p.slot_stride)
                                ),
                                writeable=False,
                            )
                            for p in self.parts
                        ],
                    )
                )
        # The parts laid out in contiguous runs (what landed() compares).
        self._runs = [(i, p) for i, p in enumerate(self.parts) if p.strides[-1] == 1 and p.shape[-1] > 1]
        self.elements = elements
        self.width = self.elements.shape[1]
        self.row_bytes = len(tensors) * self.width * first.element_size()
        self._buffer = np.empty((0, len(self.flat), self.width), dtype=self.flat[0].dtype)
        self.probe_spec = self._probe_spec(first.element_size())
        self.probe_words = int(self.probe_spec[:, 3].sum()) if self.probe_spec is not None else 0
        self.land = self._land_table(first.element_size())
        self.copy_plan = self._copy_plan(first.element_size())
        # Where each layer's page of block 0 lies and the bytes from a page to the next: the
        # fill check reads pages there (RowDigests.check_pages); None if not 8-byte aligned.
        self.page_bytes = self.page_elements * first.element_size()
        at = np.asarray([f.ctypes.data for f in self.flat], dtype=np.int64)
        self.page_at = None if (at % 8).any() or self.page_bytes % 8 else at

    @property
    def strided(self) -> bool:
        return bool(self.parts)

    def gather(self, blocks: np.ndarray, slots: np.ndarray, *, reuse: bool = False) -> np.ndarray:
        """(rows, row_bytes) uint8: each row's bytes, layer by layer. ``reuse``: into this
        object's scratch buffer (valid until the next such call) instead of a new array."""
        n = len(blocks)
        if reuse:
            if len(self._buffer) < n:
                self._buffer = np.empty((n, len(self.flat), self.width), dtype=self.flat[0].dtype)
            out = self._buffer[:n]
        else:
            out = np.empty((n, len(self.flat), self.width), dtype=self.flat[0].dtype)
        blocks = np.asarray(blocks, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if self.parts:
            for start, count, views in self.views:
                for part, view in zip(self.parts, views, strict=True):
                    out[:, start : start + count, part.start : part.stop] = _part_rows(
                        view, part, blocks, slots
                    )
        else:
            index = self.elements[slots]
            index += (blocks * self.page_elements)[:, None]
            for layer, flat in enumerate(self.flat):
                # Every index is inside the pool by construction: "clip" skips the bounds error path.
                np.take(flat, index, out=out[:, layer, :], mode="clip")
        return out.reshape(n, -1).view(np.uint8)

    def page_rows(self, pages: np.ndarray) -> np.ndarray:
        """(pages x slots, row_bytes) uint8: every row of pages given as a copy (layers, pages,
        page elements; :meth:`KVPages.seal_host_pages` where it copies them), in this class's
        row order, slot after slot of each page. One transposing copy per part over the copy's
        own strides (no index arrays; numpy's: torch's was 1.6x faster with two threads but
        1.15x slower with the one vLLM's CPU worker leaves it): a whole page's rows cost less
        than gathering a third of them out of the pool did. The result is this object's
        scratch (valid until the next gather)."""
        layers, k, _ = pages.shape
        slots = len(self.elements)
        n = k * slots
        if len(self._buffer) < n:
            self._buffer = np.empty((n, layers, self.width), dtype=self.flat[0].dtype)
        out = self._buffer[:n].reshape(k, slots, layers, self.width)
        if self.parts:
            size = out.itemsize
            lanes = np.ascontiguousarray(pages).view(out.dtype)
            for part in self.parts:
                # ndarray() over the copy's memory: as_strided's Python wrapper cost 7x more.
                grid = np.ndarray(
                    (layers, k, *part.shape, slots),
                    out.dtype,
                    lanes,
                    part.base * size,
                    (*lanes.strides[:2], *(size * x for x in part.strides), size * part.slot_stride),
                )
                last = grid.ndim - 1
                np.copyto(
                    out[..., part.start : part.stop].reshape(k, slots, layers, *part.shape),
                    grid.transpose(1, last, 0, *range(2, last)),
                )
        else:
            np.copyto(out, np.take(pages.view(out.dtype), self.elements, axis=2).transpose(1, 2, 0, 3))
        return out.reshape(n, -1).view(np.uint8)

    # Most of each run the landing check compares: one cache line.
    PROBE_WORDS = 8

    def _probe_spec(self, size: int) -> np.ndarray | None:
        """What :meth:`landed` compares, as the write op's wrapper copies it out of the rows it
        is handed (rowhash's ``add_layer``): per run (the start of the first contiguous run
        of each part that has runs, at most :attr:`PROBE_WORDS` words), (0 for K or 1 for V,
        first 64-bit word in it, first word in the probe, words). None where there is no
        run, or a run is not whole words of K or of V (then rows are read back out of their
        pages)."""
        half = self.width // 2
        spec: list[tuple[int, int, int, int]] = []
        at = 0
        for _, part in self._runs:
            col, run = part.start, part.shape[-1]
            src, lo = (0, col) if col < half else (1, col - half)
            if lo + run > half or (lo * size) % 8 or (run * size) % 8 or (half * size) % 8:
                return None
            words = min(run * size // 8, self.PROBE_WORDS)
            spec.append((src, lo * size // 8, at, words))
            at += words
        return np.asarray(spec, dtype=np.int64).reshape(-1, 4) if spec else None

    def _land_table(self, size: int) -> np.ndarray | None:
        """Where :meth:`landed` reads each probe run in the pool, for rowhash's compiled
        ``keep_written``: (layers, runs, 3) int64 of (address of the run's first word in block
        0, slot 0; bytes from a block to the next; bytes from a slot to the next). None where
        there is no probe or a run does not start on a 64-bit word in every block and slot
        (then :meth:`landed` compares, in numpy)."""
        if self.probe_spec is None:
            return None
        page = self.page_elements * size
        table = np.zeros((len(self.flat), len(self._runs), 3), dtype=np.int64)
        for layer, flat in enumerate(self.flat):
            for m, (_, part) in enumerate(self._runs):
                table[layer, m] = (flat.ctypes.data + part.base * size, page, part.slot_stride * size)
        return None if (table % 8).any() else table

    def _copy_plan(self, size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """How rowhash's ``page_sums`` reads every row of whole pages in place, in the pool or
        in a copy (the seal's fill check, instead of :meth:`page_rows`' transposing copy):
        each 64-bit word
        of a layer's row is either four 16-bit elements whose slots lie side by side (vLLM's
        CPU K: ``lanes``, (m, 5) of the word and its elements' byte offsets in slot 0) or part
        of a run of whole words, contiguous in each slot (its V: ``runs``, (r, 4) of first
        word, words, byte offset in slot 0, bytes from a slot to the next). None where some
        word is neither (then :meth:`page_rows` copies the rows out)."""
        if not self.parts or 8 % size or self.width % (8 // size):
            return None
        per = 8 // size
        first = self.elements[0] * size
        step = (self.elements[1] - self.elements[0]) * size
        lanes: list[list[int]] = []
        runs: list[list[int]] = []
        for j in range(self.width // per):
            cols = slice(per * j, per * (j + 1))
            at, by = first[cols], step[cols]
            if size == 2 and (by == 2).all():
                lanes.append([j, *at.tolist()])
            elif (
                (at == at[0] + size * np.arange(per)).all()
                and (by == by[0]).all()
                and not (at[0] % 8 or by[0] % 8)
            ):
                last = runs[-1] if runs else None
                if last and last[0] + last[1] == j and last[3] == by[0] and last[2] + 8 * last[1] == at[0]:
                    last[1] += 1
                else:
                    runs.append([j, 1, int(at[0]), int(by[0])])
            else:
                return None
        return (
            np.asarray(lanes, dtype=np.int64).reshape(-1, 5),
            np.asarray(runs, dtype=np.int64).reshape(-1, 4),
        )

    def probe_of(self, rows: np.ndarray) -> np.ndarray:
        """The probe of whole rows (rows x row_bytes, this class's order): (rows, layers,
        :attr:`probe_words`) uint64, what the write op's wrapper copies of each row."""
        assert self.probe_spec is not None
        half_words = self.width * self.flat[0].itemsize // 16
        words = np.ascontiguousarray(rows).view(np.uint64).reshape(len(rows), len(self.flat), 2 * half_words)
        out = np.empty((len(rows), len(self.flat), self.probe_words), dtype=np.uint64)
        for src, lo, at, count in self.probe_spec.tolist():
            base = src * half_words + lo
            out[:, :, at : at + count] = words[:, :, base : base + count]
        return out

    def landed(self, blocks: np.ndarray, slots: np.ndarray, probe: np.ndarray) -> np.ndarray:
        """Which rows (blocks[i], slots[i]) hold in the page what ``probe[i]`` says was written
        there (:meth:`probe_of`: the start of the first contiguous run of each part that has
        runs, every layer: on vLLM's CPU layout the first 64 bytes of the first head's V, one
        cache line a layer, where reading a row's transposed K costs one line per element). A
        write that did not land (or landed in another slot) leaves the whole of that layer's
        row as it was, which any run of it shows; a change to other elements after the write
        is what the fill check and read verification find. Only where :attr:`probe_spec` is
        not None."""
        assert self.probe_spec is not None
        blocks = np.asarray(blocks, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        size = self.flat[0].itemsize
        ok: np.ndarray | None = None
        for start, count, views in self.views:
            for (i, part), (_, _, at, words) in zip(self._runs, self.probe_spec.tolist(), strict=True):
                # The start of the part's first run, every layer: every grid index but the last
                # at 0.
                index: tuple[Any, ...] = (
                    slice(None),
                    blocks,
                    *(0,) * (len(part.shape) - 1),
                    slice(0, words * 8 // size),
                    slots,
                )
                got = np.ascontiguousarray(views[i][index]).view(np.uint64)  # (rows, layers, words)
                same = (got == probe[:, start : start + count, at : at + words]).all(axis=(1, 2))
                ok = same if ok is None else ok & same
        assert ok is not None  # probe_spec is not None: there are runs
        return ok


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


class RowCheck(NamedTuple):
    """Row digests compared on the device: ``pending`` reads back which rows were flagged
    (each row's place in the call's arrays stands as its "block" in
    :meth:`PendingCheck.settle`); ``blocks``/``flagged`` stay on the device for the seal
    that follows (:meth:`DeviceDigestTable.seal_async`'s ``void``)."""

    pending: PendingCheck
    blocks: torch.Tensor
    flagged: torch.Tensor


class DeviceRowDigests(RowDigests):
    """Row digests of pages off the host, kept, compared and read back without a wait.

    :class:`RowDigests` on a GPU hashed rows there but read every digest back (``.cpu()``):
    a host wait for the step's forward, every step. Here the digests stay in a table on the
    device beside the pages (this generation and the previous one); recording and checking
    rows compare there and return a :class:`RowCheck` whose flags are read with the step's
    output, as the page seals' :class:`PendingCheck` are. The host keeps only which slots
    hold a row (``rows``/``previous`` as 0/1 markers), which is all the ledger of written
    rows needs.

    ``geometry`` (kernel.py's :class:`RowGeometry`, where the layout allows): each call is one
    kernel launch over every layer that hashes, compares and stores; without it, a gather per
    layer and torch's arithmetic (about twenty small kernels), the same digests."""

    deferred = True
    _host_dtype = np.uint8

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        gathers: Sequence[RowAccess],
        num_blocks: int,
        block_size: int,
        geometry: RowGeometry | None = None,
    ) -> None:
        super().__init__(tensors, gathers, num_blocks, block_size)
        self.geometry = geometry
        shape = (num_blocks * block_size,)  # flat: entry block x block_size + slot
        self.table = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.table_previous = torch.zeros(shape, dtype=torch.int64, device=self.device)

    def nbytes(self) -> int:
        return super().nbytes() + 2 * self.table.numel() * self.table.element_size()

    def try_kernel(self) -> str | None:
        """At start-up: build the row kernel and check it against torch on two rows (the one
        wait on the device this class makes). Where it fails to build or disagrees, the torch
        path is used from then on; returns why, or None where the kernel is in use."""
        if self.geometry is None:
            return "no kernel for this layout"
        blocks = np.zeros(2, dtype=np.int64)
        slots = np.array([0, self.block_size - 1], dtype=np.int64)
        b, s, _ = self._flat(blocks, slots)
        try:
            by_kernel = self.geometry.launch(b, s)[0].cpu()
        except Exception as exc:
            self.geometry = None
            return f"row kernel failed: {exc!r}"[:300]
        if not torch.equal(by_kernel, self._digests(b, s).cpu()):
            self.geometry = None
            return "row kernel disagrees with torch"
        return None

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        """Host ids to the device without waiting for it (pinned, in stream order)."""
        ids = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type != "cuda":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _flat(self, blocks: np.ndarray, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(blocks, slots, table entries) on the device, in one copy (the entries computed on
        the host: no device arithmetic per call)."""
        b = np.asarray(blocks, dtype=np.int64)
        s = np.asarray(slots, dtype=np.int64)
        ids = self._to_device(np.stack([b, s, b * self.block_size + s]))
        return ids[0], ids[1], ids[2]

    def _digests(self, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        gathered = torch.cat([g(b, s).contiguous().view(torch.uint8) for g in self.gathers], dim=1)
        return row_digests_torch(gathered.view(torch.int64), s)

    def record_async(self, blocks: np.ndarray, slots: np.ndarray, *, compare: bool) -> RowCheck | None:
        """Hash the rows just written into the table. With ``compare``: flags those that equal
        what the block's previous owner had at that slot (lost writes), read later."""
        if not len(blocks):
            return None
        self.rows[blocks, slots] = 1
        b, s, flat = self._flat(blocks, slots)
        if self.geometry is not None:
            digests, previous, flags = self.geometry.launch(
                b, s, mode=RECORD, table=self.table, previous=self.table_previous
            )
            same = flags
        else:
            digests = self._digests(b, s)
            self.table.index_copy_(0, flat, digests)
            if not compare:
                return None
            previous = self.table_previous.index_select(0, flat)
            same = (digests == previous) & (previous != 0)
        if not compare:
            return None
        pending = PendingCheck(
            range(len(blocks)), same.to(torch.uint8)[:, None], digests[:, None], previous[:, None]
        )
        return RowCheck(pending, b, same)

    def check_async(self, blocks: np.ndarray, slots: np.ndarray) -> RowCheck | None:
        """Compare rows with their recorded digests; flags the rows that changed, read later."""
        if not len(blocks):
            return None
        b, s, flat = self._flat(blocks, slots)
        if self.geometry is not None:
            digests, expected, flags = self.geometry.launch(b, s, mode=CHECK, table=self.table)
            changed = flags
        else:
            digests = self._digests(b, s)
            expected = self.table.index_select(0, flat)
            changed = digests != expected
        pending = PendingCheck(
            range(len(blocks)), changed.to(torch.uint8)[:, None], digests[:, None], expected[:, None]
        )
        return RowCheck(pending, b, changed)

    def hash(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """As :meth:`RowDigests.hash` (reads back and waits: drills and diagnosis only)."""
        if not len(blocks):
            return np.zeros(0, dtype=np.uint64)
        b, s, _ = self._flat(blocks, slots)
        digests = self.geometry.launch(b, s)[0] if self.geometry is not None else self._digests(b, s)
        return digests.cpu().numpy().view(np.uint64)

    def record(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("device row digests are recorded with record_async")

    def check(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("device row digests are checked with check_async")

    def roll(self, blocks: Sequence[int]) -> None:
        if len(blocks):
            super().roll(blocks)
            ids = self._to_device(np.asarray(blocks, dtype=np.int64))
            rows = self.table.view(-1, self.block_size)
            self.table_previous.view(-1, self.block_size).index_copy_(0, ids, rows.index_select(0, ids))
            rows.index_fill_(0, ids, 0)

    def forget(self, blocks: Sequence[int]) -> None:
        if len(blocks):
            super().forget(blocks)
            self.table.view(-1, self.block_size).index_fill_(
                0, self._to_device(np.asarray(blocks, dtype=np.int64)), 0
            )

    def clear(self, blocks: np.ndarray, slots: np.ndarray) -> None:
        if len(blocks):
            super().clear(blocks, slots)
            flat = np.asarray(blocks, dtype=np.int64) * self.block_size + np.asarray(slots, dtype=np.int64)
            self.table.index_fill_(0, self._to_device(flat), 0)

    def reset(self) -> None:
        super().reset()
        self.table.zero_()
        self.table_previous.zero_()
