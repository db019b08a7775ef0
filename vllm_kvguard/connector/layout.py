"""How the worker reads rows of this KV layout (host pages, vLLM's CPU packing, GPU layouts).

Start-up probes of vLLM's CPU write op (which elements each slot of a page holds, whether a
row reads back as written), :class:`WrittenRows` (the rows vLLM's CPU attention was handed,
digested as they are written), and :func:`row_digests`, which picks the row-digest path for
the layout (digest/rows.py) and says why in the start-up line.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_kvguard.config import KVGuardConfig
from vllm_kvguard.connector import patches
from vllm_kvguard.digest import rowhash
from vllm_kvguard.digest.device_rows import DeviceRowDigests
from vllm_kvguard.digest.kernel import RowGeometry
from vllm_kvguard.digest.pages import KVPages
from vllm_kvguard.digest.row_access import AxisRows, HostRows, PackedRows, RowAccess
from vllm_kvguard.digest.rows import RowDigests


def slot_axis(page_shape: tuple[int, ...], block_size: int) -> int | None:
    """Which page dimension indexes the block's slots in vLLM's GPU layouts ((2, block_size,
    heads, head) or (2, heads, block_size, head), written with logical indexing). None where it
    cannot be told apart."""
    same = [d for d, n in enumerate(page_shape) if n == block_size]
    if len(same) == 1:
        return same[0]
    if len(page_shape) == 4 and page_shape[0] == 2 and page_shape[1] == block_size:
        return 1  # NHD where heads == block_size
    return None


def cpu_isa(name: str, dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The instruction-set layout vLLM's CPU attention packs this layer's pages in."""
    try:
        from vllm.config import get_current_vllm_config

        layer = get_current_vllm_config().compilation_config.static_forward_context.get(name)
        isa = getattr(layer, "isa", None)
        if isinstance(isa, str):
            return isa
    except Exception:  # fall back to vLLM's own choice below
        pass
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size))


def _scratch_page(
    page_shape: tuple[int, ...], dtype: torch.dtype, isa: str
) -> tuple[torch.Tensor, Callable[[torch.Tensor, torch.Tensor, int], None]]:
    """A one-block scratch page and ``put(key, value, slot)``, which writes one token's rows into
    it with vLLM's own CPU write op (unobserved by the guard): the start-up probes."""
    write = patches.original_cpu_kv_write()
    heads, bs, two_head = page_shape
    scratch = torch.zeros((1, *page_shape), dtype=dtype)
    key_cache, value_cache = scratch.view(1, heads, bs * 2, two_head // 2).chunk(2, dim=2)

    def put(key: torch.Tensor, value: torch.Tensor, slot: int) -> None:
        write(key, value, key_cache, value_cache, torch.tensor([slot], dtype=torch.int64), isa)

    return scratch, put


def cpu_slot_elements(
    page_shape: tuple[int, ...], dtype: torch.dtype, block_size: int, isa: str
) -> np.ndarray:
    """The elements each slot of a CPU page holds, found by writing one token into a scratch page
    with vLLM's own write op (``cpu_attn_reshape_and_cache``): the CPU kernels pack K per
    instruction set (e.g. transposed), so a slot is not a slice of the page. (slots, elements)."""
    heads, bs, two_head = page_shape
    if bs != block_size or two_head % 2:
        raise ValueError(f"page shape {page_shape} is not (heads, {block_size}, 2 x head_size)")
    scratch, put = _scratch_page(page_shape, dtype, isa)
    ones = torch.ones((1, heads, two_head // 2), dtype=dtype)
    rows = []
    for slot in range(bs):
        scratch.zero_()
        put(ones, ones, slot)
        rows.append(torch.nonzero(scratch.reshape(-1)).flatten().numpy())
    width = heads * two_head
    if any(len(r) != width for r in rows) or len(np.unique(np.concatenate(rows))) != bs * width:
        raise ValueError(f"vLLM's CPU write op ({isa}) does not place each slot in its own elements")
    return np.stack(rows)


def written_order_matches(
    page_shape: tuple[int, ...], dtype: torch.dtype, block_size: int, isa: str, elements: np.ndarray
) -> bool:
    """Whether a row read through ``elements`` (the host rows' order) is the write op's key then
    value, as given (heads x head each): then the rows vLLM writes can be digested as it hands
    them over (:class:`WrittenRows`). Checked by writing random rows with vLLM's own op."""
    heads, _, two_head = page_shape
    scratch, put = _scratch_page(page_shape, dtype, isa)
    gen = torch.Generator().manual_seed(7)
    for slot in (0, block_size - 1):
        key = torch.randn((1, heads, two_head // 2), generator=gen).to(dtype)
        value = torch.randn((1, heads, two_head // 2), generator=gen).to(dtype)
        put(key, value, slot)
        row = scratch.reshape(-1)[torch.from_numpy(np.asarray(elements[slot], dtype=np.int64))]
        if not torch.equal(
            row.view(torch.int16), torch.cat([key.reshape(-1), value.reshape(-1)]).view(torch.int16)
        ):
            return False
    return True


class WrittenRows:
    """The rows vLLM's CPU attention was handed to write this step, every layer, kept as their
    row digests (the sum of each row's KVG64 terms, added a layer at a time by rowhash's
    compiled ``add_layer`` as the write op is called: no copy of the rows) and, for the landing
    check (:meth:`HostRows.landed`), a probe of each row (the start of the first contiguous run
    of each part that has runs, every layer: on vLLM's CPU layout the first 64 bytes of the
    first head's V),
    with the slots they went to. Reading a row back out of a page after the forward costs one
    cache line per K element on vLLM's CPU layout (about 4 us a row and layer inside the
    engine). Fed by the write op's wrapper (patches.observe_cpu_kv_writes); a step whose writes
    were not all seen (more rows than ``capacity``, another dtype, a layer missing or seen
    twice) uses none of them."""

    # Host memory kept for the sums and probes: this many bytes, and room for at least MIN_ROWS
    # rows.
    BYTES = 16 << 20
    MIN_ROWS = 256

    def __init__(
        self,
        layer_of: dict[int, int],
        num_layers: int,
        width: int,
        dtype: torch.dtype,
        block_size: int,
        spec: np.ndarray,
    ) -> None:
        kernels = rowhash.compiled()
        if kernels is None:
            raise ValueError(f"row sums need numba: {rowhash.backend()}")
        if (width * dtype.itemsize) % 16:
            raise ValueError("a layer's K and V rows are not whole 64-bit words")
        self._add = kernels["add_layer"]
        self.layer_of = layer_of
        self.num_layers = num_layers
        self.block_size = block_size
        self.layer_words = width * dtype.itemsize // 8
        self._half_words = self.layer_words // 2  # a row's K (and its V) words in one layer
        self.spec = np.ascontiguousarray(spec, dtype=np.int64)
        probe_words = int(self.spec[:, 3].sum()) if len(self.spec) else 0
        lo, at, count = (self.spec[:, i] for i in (1, 2, 3))
        if len(self.spec) and (
            (lo < 0).any()
            or (at < 0).any()
            or (lo + count > self._half_words).any()
            or (at + count > probe_words).any()
        ):
            raise ValueError("the landing probe reads outside a row's K or V words")
        self.probe_words = probe_words
        # Per row: its sum and its slot (8 bytes each), its probe (8 x probe_words a layer).
        self.capacity = max(self.MIN_ROWS, self.BYTES // (16 + 8 * num_layers * probe_words))
        # Zeroed, not empty: their pages are touched now, not on a step's first long prefill.
        self.sums = np.zeros(self.capacity, dtype=np.uint64)
        self.probe = np.zeros((self.capacity, num_layers, probe_words), dtype=np.uint64)
        self._slots = np.zeros(self.capacity, dtype=np.int64)
        # add_layer's arguments that do not change: where the tables lie (they are never resized).
        self._sums_at = self.sums.ctypes.data
        self._probe_at = self.probe.ctypes.data
        self._slots_at = self._slots.ctypes.data
        self._half = width // 2  # elements of a row's K (and of its V) in one layer
        self.dtype = dtype
        # The last (shapes, strides, dtypes) of K and V that _rows_at accepted, and their row
        # steps in bytes: a layer written alike is not checked again.
        self._form: tuple[object, ...] | None = None
        self._steps = (0, 0)
        self.slots: np.ndarray | None = None
        self.seen: set[int] = set()
        self.open = False
        self.broken = False

    def nbytes(self) -> int:
        return int(self.sums.nbytes + self.probe.nbytes + self._slots.nbytes)

    def begin(self) -> None:
        self.open, self.broken, self.slots, self.seen = True, False, None, set()

    def close(self) -> None:
        self.open = False

    def _rows_at(self, t: torch.Tensor, n: int) -> tuple[int, int] | None:
        """(address, bytes from one row to the next) of ``t``, n rows of one layer's K (or V)
        on the host, each row one run of whole, aligned 64-bit words; None where ``t`` is
        anything else (its rows are then read back out of the pages)."""
        shape = t.shape
        if not t.is_cpu or t.dtype != self.dtype or not len(shape) or shape[0] != n:
            return None
        stride = t.stride()
        run = 1
        for size, step in zip(reversed(shape[1:]), reversed(stride[1:]), strict=True):
            if size != 1 and step != run:
                return None
            run *= size
        step = stride[0] * self.dtype.itemsize
        address = t.data_ptr()
        if run != self._half or address % 8 or step % 8:
            return None
        return address, step

    def observe(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        layer = self.layer_of.get(key_cache.data_ptr())
        if not self.open or self.broken or layer is None:
            return
        n = int(slot_mapping.shape[0])
        if n > self.capacity or layer in self.seen:
            self.broken = True  # (a layer written twice would add its terms twice)
            return
        first = not self.seen
        if first:
            if not (
                slot_mapping.is_cpu
                and slot_mapping.dtype == torch.int64
                and slot_mapping.dim() == 1
                and slot_mapping.stride(0) == 1
            ):
                slot_mapping = slot_mapping.to("cpu", torch.int64).contiguous()
            self.slots = self._slots[:n]
        elif self.slots is None or len(self.slots) != n:
            self.broken = True
            return
        # The layout is checked in full once per kind (every layer of a step has the same:
        # vLLM's attention layers are alike); the other layers compare it (torch's accessors
        # cost ~5 us each after a forward: benchmarks/cold_calls.py).
        form = (
            key.is_cpu and value.is_cpu,
            key.shape,
            key.stride(),
            key.dtype,
            value.shape,
            value.stride(),
            value.dtype,
        )
        if form == self._form:
            k = v = None
            k_at, v_at = key.data_ptr(), value.data_ptr()
            if not (k_at | v_at) % 8:
                k, v = (k_at, self._steps[0]), (v_at, self._steps[1])
        else:
            k, v = self._rows_at(key, n), self._rows_at(value, n)
            if k is not None and v is not None:
                self._form, self._steps = form, (k[1], v[1])
        if k is None or v is None:
            self.broken = True  # a layout the compiled loop does not read: rows read back
            return
        j = layer * self.layer_words
        # One compiled call a layer, all ints: it reads the rows where vLLM's QKV output holds
        # them (checked above: n rows of whole aligned words), writes the tables kept here.
        self._add(
            n,
            k[0],
            k[1],
            v[0],
            v[1],
            self._half_words,
            slot_mapping.data_ptr() if first else 0,
            self._slots_at,
            first,
            self.block_size,
            j,
            j + self._half_words,
            self._sums_at,
            self._probe_at + 8 * layer * self.probe_words,
            self.num_layers * self.probe_words,
            self.spec,
        )
        self.seen.add(layer)

    def digests(self, at: slice | np.ndarray) -> np.ndarray:
        """The digests of the written rows ``at`` (their places in the write op's order)."""
        return rowhash.finish(self.sums[at])

    def complete(self) -> bool:
        """Whether every layer's rows of this step are here."""
        return not (
            self.broken or self.slots is None or not len(self.slots) or len(self.seen) < self.num_layers
        )

    def find(
        self, blocks: np.ndarray, slots: np.ndarray, block_size: int
    ) -> tuple[np.ndarray, np.ndarray] | tuple[None, None] | None:
        """(positions, found): where each row (blocks[i], slots[i]) is among this step's written
        rows; (None, None): every row is, row i as written row i (the usual step); None where
        this step's rows are not all here."""
        if not self.complete() or self.slots is None:
            return None
        ids = blocks * block_size + slots
        if len(ids) == len(self.slots) and (ids == self.slots).all():
            # The usual case: the plan's rows in the order the model runner wrote them.
            return None, None
        order = np.argsort(self.slots, kind="stable")
        ordered = self.slots[order]
        at = np.minimum(np.searchsorted(ordered, ids), len(ordered) - 1)
        return order[at], ordered[at] == ids


def row_digests(
    config: KVGuardConfig,
    pages: KVPages,
    first: torch.Tensor,
    bs: int,
    observe: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> tuple[RowDigests | None, WrittenRows | None, str]:
    """The row digests (digest/rows.py) for this KV layout, the rows digested as written where
    vLLM's CPU write op can be observed (``observe`` is then its observer), and what the
    start-up line says about them. Never raises: the guard runs on without rows, and says why."""
    page_shape = tuple(first.shape[1:])
    if first.device.type == "cpu":
        patches.observe_cpu_kv_writes(None)  # an earlier engine's worker in this process
    if not config.rows:
        return None, None, "off: VLLM_KVGUARD_ROWS=0"
    written: WrittenRows | None = None
    try:
        if bs <= 0:
            raise ValueError("block size unknown")
        # vLLM's CPU attention packs a page as (heads, block_size, 2 x head_size); any other
        # page (GPU layouts, also where they sit in host memory: tests/compat) indexes slots
        # along one of its dimensions.
        packed = first.device.type == "cpu" and len(page_shape) == 3 and page_shape[1] == bs
        if packed:
            if not first.is_floating_point():
                raise ValueError(f"KV dtype {first.dtype} (quantised CPU cache)")
            isa = cpu_isa(pages.names[0], first.dtype, bs, page_shape[-1] // 2)
            elements = cpu_slot_elements(page_shape, first.dtype, bs, isa)
            tensors = pages.tensors
            try:
                host: HostRows | None = HostRows(tensors, elements)
                assert host is not None
                elements = host.elements  # the rows' byte order: every reader uses the same
                way = "strided views" if host.strided else "element map"
                how = f"on (CPU layout {isa}, probed, numpy gather through {way})"
            except ValueError:  # pages numpy cannot view: torch's indexing reads them
                host = None
                how = f"on (CPU layout {isa}, probed, torch gather)"
            gathers: list[RowAccess] = [PackedRows(t, elements) for t in tensors]
            if (
                host is not None
                and host.probe_spec is not None
                and written_order_matches(page_shape, first.dtype, bs, isa, elements)
            ):
                layer_of = {t.data_ptr(): i for i, t in enumerate(tensors)}
                try:
                    written = WrittenRows(
                        layer_of, len(tensors), host.width, first.dtype, bs, host.probe_spec
                    )
                except ValueError as exc:  # rows are read back out of their pages instead
                    how += f"; read back ({exc})"
                else:
                    if patches.observe_cpu_kv_writes(observe):
                        how += f"; digested as written ({written.nbytes() / (1 << 20):.0f} MiB)"
                    else:
                        written = None
        else:
            axis = slot_axis(page_shape, bs)
            if axis is None:
                raise ValueError(f"page shape {page_shape} does not show which dimension indexes slots")
            gathers = [AxisRows(t, axis) for t in pages.tensors]
            host = None
            how = f"on (slot axis {axis})"
            if pages.deferred:
                # Beside the device seals: recorded and compared there, read with the output.
                why = ""
                try:
                    geometry: RowGeometry | None = RowGeometry(pages.tensors, axis)
                except ValueError as exc:  # torch reads such rows: the same digests
                    geometry, why = None, str(exc)
                device = DeviceRowDigests(pages.tensors, gathers, pages.num_blocks, bs, geometry)
                if geometry is not None:
                    why = device.try_kernel() or ""
                how += ", kept on the device, " + (f"torch ({why})" if why else "one kernel launch a call")
                return device, None, f"{how}, {device.row_bytes} bytes a row"
        rows = RowDigests(pages.tensors, gathers, pages.num_blocks, bs, host)
    except Exception as exc:  # the guard runs on without them, and says why
        if written is not None:
            patches.observe_cpu_kv_writes(None)
        return None, None, f"off: {exc}"
    return rows, written, f"{how}, {rows.row_bytes} bytes a row"
