"""How a page's rows are read: one layer's rows (block, slot) gathered through a slot axis
(GPU layouts) or an element map (vLLM's CPU packing), and :class:`HostRows`, the host pool's
rows read where they lie (strided views, in-place page sums, the landing probe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_kvguard.digest.pages import layer_step


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
