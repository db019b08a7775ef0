"""KV pages: the guarded KV tensors addressed by (block id, layer), hashed in place.

A *page* is one block of one layer's KV tensor. Its digest is XXH3-64 (or XXH64)
over the page's bytes in memory order, read straight from the tensor's storage
through a memoryview: no KV data is copied on the CPU. Pages that are not one
contiguous run (some GPU layouts keep K and V apart) are hashed as the
concatenation of their contiguous runs, in memory order. Pages off the host are
hashed where they live, by the KVG64 kernel (:mod:`.kernel`).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from vllm_kvguard.config import HashAlgorithm
from vllm_kvguard.digest import rowhash
from vllm_kvguard.digest.dtypes import EXPONENT_TESTS, nonfinite_rows
from vllm_kvguard.digest.kernel import PageGeometry, kernel_available, kvg64_pages, kvg64_reference
from vllm_kvguard.digest.syndrome import finish, parities, syndromes_device
from vllm_kvguard.digest.syndrome import width as syndrome_width

_ONE_SHOT = {
    HashAlgorithm.XXH3_64: xxhash.xxh3_64_intdigest,
    HashAlgorithm.XXH64: xxhash.xxh64_intdigest,
}
_STREAMING = {HashAlgorithm.XXH3_64: xxhash.xxh3_64, HashAlgorithm.XXH64: xxhash.xxh64}


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat memoryview over the tensor's whole CPU storage (no copy)."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return flat.numpy().data.cast("B")


def page_runs(page: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous byte runs (offset from page start, length) of one page, in memory order."""
    elsize = page.element_size()
    if page.is_contiguous():
        return [(0, page.numel() * elsize)]
    dims = sorted(range(page.dim()), key=lambda d: page.stride(d), reverse=True)
    shape = [page.shape[d] for d in dims]
    strides = [page.stride(d) for d in dims]
    # Merge the innermost dims that are densely packed into one run.
    run = 1
    k = len(dims)
    while k > 0 and strides[k - 1] == run:
        run *= shape[k - 1]
        k -= 1
    outer = shape[:k]
    runs = []
    for index in np.ndindex(*outer) if outer else [()]:
        offset = sum(i * s for i, s in zip(index, strides[:k], strict=True))
        runs.append((offset * elsize, run * elsize))
    return runs


def layer_step(tensors: Sequence[torch.Tensor]) -> int | None:
    """Bytes from one layer's KV tensor to the next where there are several and they lie evenly
    spaced in one buffer with one block stride, as vLLM allocates them (then one strided view
    reads every layer); None otherwise."""
    if len(tensors) < 2:
        return None
    first = tensors[0]
    ptrs = [t.data_ptr() for t in tensors]
    step = ptrs[1] - ptrs[0]
    even = (
        step > 0
        and step % first.element_size() == 0
        and len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        and all(b - a == step for a, b in itertools.pairwise(ptrs))
        and all(t.stride(0) == first.stride(0) for t in tensors)
    )
    return step if even else None


def _kernel_runs(device: torch.device, runs: list[list[tuple[int, int]]]) -> bool:
    # KVG64 hashes runs as one string only when every run but the last is whole words.
    return kernel_available(device) and all(n % 8 == 0 for layer in runs for _, n in layer[:-1])


class KVPages:
    """The guarded KV tensors, seen as pages addressable by (block id, layer).

    ``layers`` maps layer names to tensors; ``block_dim`` is the dimension that
    indexes blocks. Layers that share one tensor are hashed once and reported
    under the first name.
    """

    def __init__(
        self,
        layers: dict[str, torch.Tensor],
        *,
        block_dim: int = 0,
        algorithm: HashAlgorithm = HashAlgorithm.XXH3_64,
        use_kernel: bool | None = None,
    ) -> None:
        seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        for name, tensor in layers.items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if key in seen:
                continue
            seen[key] = name
            self.names.append(name)
            self.tensors.append(tensor.movedim(block_dim, 0))
        if not self.tensors:
            raise ValueError("no KV tensors to guard")
        self.num_blocks = min(t.shape[0] for t in self.tensors)
        self.algorithm = algorithm
        self._hash = _ONE_SHOT[algorithm]
        self._stream = _STREAMING[algorithm]
        self.on_host = all(t.device.type == "cpu" for t in self.tensors)
        self._runs = [page_runs(t[0]) for t in self.tensors]
        # Pages off the host are hashed where they live, by the KVG64 kernel (kernel.py), with
        # no copy; ``use_kernel`` forces the choice (tests run the kernel on CPU tensors under
        # TRITON_INTERPRET=1). Where it cannot run, pages are copied to the host (slow path).
        if use_kernel is None:
            use_kernel = not self.on_host and _kernel_runs(self.tensors[0].device, self._runs)
        self.use_kernel = use_kernel
        self.digest_name = "kvg64" if use_kernel else str(algorithm)
        if not self.on_host and not use_kernel:
            warnings.warn(
                "vllm-kvguard: KV cache is not in host memory and the page-digest kernel cannot "
                "run here; pages are copied to the host to be hashed (slow path).",
                RuntimeWarning,
                stacklevel=2,
            )
        self._views = [_byte_view(t) if self.on_host and not use_kernel else None for t in self.tensors]
        elsize = [t.element_size() for t in self.tensors]
        self._base = [t.storage_offset() * e for t, e in zip(self.tensors, elsize, strict=True)]
        self._stride = [t.stride(0) * e for t, e in zip(self.tensors, elsize, strict=True)]
        self.page_bytes = [sum(n for _, n in r) for r in self._runs]
        # Syndrome words kept per page (digest/syndrome.py): enough to address the largest page.
        self.syndrome_words = max(syndrome_width(n) for n in self.page_bytes)
        # Every layer in one launch, seals and comparisons on the device, results read
        # later (DeviceDigestTable): when the layers share one page geometry, as the
        # layers of one vLLM KV cache group do.
        self.geometry = self._one_geometry() if use_kernel else None
        self._host_pages = self._host_pool()
        self._scratch: np.ndarray | None = None
        # Where each layer's page of block 0 lies (the seal reads pages there: _host_facts);
        # None where the layers' pages are not evenly spaced alike or not 8-byte aligned.
        self._page_at: np.ndarray | None = None
        if self._host_pages is not None and len(set(self._stride)) == 1 and not self._stride[0] % 8:
            at = np.asarray(
                [v.ctypes.data + i * v.strides[0] for v in self._host_pages[0] for i in range(len(v))],
                dtype=np.int64,
            )
            if not (at % 8).any() and not self.page_bytes[0] % 8:
                self._page_at = at
        self._word_test: tuple[int, int, int] | None = None
        if self._host_pages is not None:
            if self._host_pages[1] is not None:
                self._word_test = EXPONENT_TESTS[self.tensors[0].dtype][:3]
            # The seal's one-pass kernel compiled (or loaded) now, not in the first step that seals,
            # and its checks of this pool's pages taken once (not in every seal).
            rowhash.compiled()
        self._facts: rowhash.PoolFacts | None = None
        if self._page_at is not None:
            self._facts = rowhash.pool_facts_plan(
                self._page_at, self._stride[0], self.page_bytes[0], self._word_test
            )

    def _host_pool(self) -> tuple[list[np.ndarray], tuple[int, int] | None] | None:
        """Every layer's pages as numpy element lanes, for :meth:`seal_facts` on the host:
        ((layers, blocks, elements) views: one for all the layers where they lie evenly spaced
        in one buffer, as vLLM allocates them, else one per layer; the NaN/Inf test: (mask of
        all bits but the sign, exponent mask), None for integer caches). None where the pages
        are not contiguous pages of one shape and dtype, or are floats this test does not know
        (the torch path then)."""
        first = self.tensors[0]
        size = first.element_size()
        if not self.on_host or self.use_kernel or size not in (1, 2, 4):
            return None
        if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in self.tensors):
            return None
        if any(r != [(0, self.page_bytes[0])] for r in self._runs):
            return None
        test: tuple[int, int] | None = None
        if first.is_floating_point():
            if first.dtype not in EXPONENT_TESTS:
                return None
            bits = EXPONENT_TESTS[first.dtype][3]
            test = ((1 << (bits - 1)) - 1, EXPONENT_TESTS[first.dtype][0] & ((1 << bits) - 1))
        lane = getattr(torch, f"int{8 * size}")
        elements = self.page_bytes[0] // size

        def lanes_at(t: torch.Tensor, count: int, step: int) -> np.ndarray:
            # One element of the tensor's own memory (a view, never a copy), widened by strides.
            one = torch.as_strided(t.view(lane), (1,), (1,)).numpy()
            return np.lib.stride_tricks.as_strided(
                one, shape=(count, self.num_blocks, elements), strides=(step, t.stride(0) * size, size)
            )

        step = layer_step(self.tensors)
        if step is not None:
            return [lanes_at(first, len(self.tensors), step)], test
        return [lanes_at(t, 1, 0) for t in self.tensors], test

    def _one_geometry(self) -> Any:
        if any(r != self._runs[0] for r in self._runs):
            return None
        try:
            return PageGeometry(self.tensors, self._runs[0])
        except ValueError:
            return None

    @property
    def deferred(self) -> bool:
        """Whether seals and verifications stay on the device (see DeviceDigestTable)."""
        return self.geometry is not None

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    @property
    def bytes_per_block(self) -> int:
        return sum(self.page_bytes)

    def digest(self, block_ids: Sequence[int]) -> np.ndarray:
        """Digests of the given blocks, shape (len(block_ids), num_layers), uint64."""
        out = np.empty((len(block_ids), self.num_layers), dtype=np.uint64)
        if not len(block_ids):
            return out
        if self.geometry is not None:
            # Every layer in one launch; .cpu() waits for it (the synchronous API).
            ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.geometry.device)
            return self.geometry.launch(ids)[0].cpu().view(torch.int64).numpy().view(np.uint64)
        for layer in range(self.num_layers):
            out[:, layer] = self.digest_layer(layer, block_ids)
        return out

    def digest_layer(self, layer: int, block_ids: Sequence[int]) -> list[int]:
        """Digests of the given blocks for one layer, as Python ints: a step's reads are
        compared with their seals in Python (no numpy call per layer between two attention
        layers)."""
        if not len(block_ids):
            return []
        runs = self._runs[layer]
        if self.use_kernel:
            # One launch per layer for all the step's pages; .cpu() waits for it.
            on_device = kvg64_pages(self.tensors[layer], block_ids, runs).cpu()
            return on_device.view(torch.int64).numpy().view(np.uint64).tolist()
        if not self.on_host:
            pages = self.tensors[layer][torch.as_tensor(block_ids, device=self.tensors[layer].device)]
            host = pages.contiguous().cpu()
            host_view = host.view(torch.uint8).numpy().data.cast("B")
            size = self.page_bytes[layer]
            return [self._hash(host_view[i * size : (i + 1) * size]) for i in range(len(block_ids))]
        view, base, stride = self._views[layer], self._base[layer], self._stride[layer]
        assert view is not None
        if len(runs) == 1:
            size = runs[0][1]
            h = self._hash
            return [h(view[base + b * stride : base + b * stride + size]) for b in block_ids]
        digests = []
        for b in block_ids:
            state = self._stream()
            start = base + b * stride
            for off, n in runs:
                state.update(view[start + off : start + off + n])
            digests.append(state.intdigest())
        return digests

    def seal_facts(
        self, block_ids: Sequence[int], *, check_finite: bool, with_syndromes: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """What sealing records besides the digest, from one gather per layer of the pages being
        sealed: which hold NaN/Inf (``check_finite``; else all False), shape (pages, layers), and
        their syndromes (:mod:`.syndrome`; ``with_syndromes``, else zeros), shape (pages, layers,
        syndrome_words) uint64.

        The NaN/Inf test is an exponent test on 64-bit words (``nonfinite_rows``), 3-4x faster
        than ``torch.isfinite`` on bf16 here; integer KV dtypes (quantised caches) cannot hold
        NaN and are reported finite.
        """
        n = len(block_ids)
        flags = np.zeros((n, self.num_layers), dtype=bool)
        syn = np.zeros((n, self.num_layers, self.syndrome_words), dtype=np.uint64)
        if not n:
            return flags, syn
        if self._host_pages is not None:
            self._host_facts(block_ids, check_finite, with_syndromes, flags, syn)
            return flags, syn
        index = torch.as_tensor(list(block_ids), device=self.tensors[0].device)
        finite_layers, finite_flags, cols, rows = [], [], [], []
        for i, tensor in enumerate(self.tensors):
            gathered = tensor.index_select(0, index).reshape(n, -1)
            if check_finite and tensor.is_floating_point():
                finite_layers.append(i)
                finite_flags.append(nonfinite_rows(gathered))
            if with_syndromes:
                c, r = parities(gathered.cpu().view(torch.uint8).numpy())
                cols.append(c)
                rows.append(r)
        if rows and len({r.shape[1] for r in rows}) == 1:
            # Every layer's pages finished in one go: (layers x pages) rows.
            done = finish(np.concatenate(cols), np.concatenate(rows))[:, : self.syndrome_words]
            syn[:] = done.reshape(self.num_layers, n, -1).swapaxes(0, 1)
        else:  # layers of different page sizes (none when with_syndromes is off: no rows)
            for i, (c, r) in enumerate(zip(cols, rows, strict=True)):
                syn[:, i] = finish(c, r)[:, : self.syndrome_words]
        if finite_layers:
            # One transfer for all layers' flags.
            flags[:, finite_layers] = torch.stack(finite_flags, dim=1).cpu().numpy()
        return flags, syn

    @property
    def seals_host_pages(self) -> bool:
        """Whether :meth:`seal_host_pages` can seal these pages (host pages of one shape and
        dtype, each one contiguous run)."""
        return self._host_pages is not None

    @property
    def reads_in_place(self) -> bool:
        """Whether the host seal reads the pages where they lie in the pool (rowhash's compiled
        passes, every address aligned), rather than from a copy of them."""
        return self._page_at is not None and rowhash.compiled() is not None

    def seal_host_pages(
        self,
        block_ids: Sequence[int],
        *,
        check_finite: bool,
        visit: Callable[[int, np.ndarray, np.ndarray | None], None] | None = None,
        copy: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Everything a seal records, each page's bytes read out of the pool once, a chunk at a
        time: :meth:`seal_facts`' NaN/Inf flags and syndromes, and the digests (what
        :meth:`digest` returns). ``visit(lo, ids, pages)`` is handed each chunk after its pages
        are hashed (while they are in the CPU's cache), ``ids`` the blocks
        ``block_ids[lo:lo + len(ids)]``; ``pages`` is None where the pages are read in place
        (:attr:`reads_in_place`), else the chunk's copy, (layers, pages, elements) in the
        pool's lanes, which it must not keep or change (the seal's fill check digests the
        earlier rows there: :meth:`RowDigests.check_pages`).
        ``copy``: copy the pages out even where they could be read in place (tests, benchmarks).
        Only where :attr:`seals_host_pages`."""
        n = len(block_ids)
        flags = np.zeros((n, self.num_layers), dtype=bool)
        syn = np.zeros((n, self.num_layers, self.syndrome_words), dtype=np.uint64)
        digests = np.empty((n, self.num_layers), dtype=np.uint64)
        if n:
            self._host_facts(block_ids, check_finite, True, flags, syn, digests, visit, copy=copy)
        return flags, syn, digests

    # Host memory kept for :meth:`_host_facts`' copy of the pages being sealed (at least one
    # block's pages, every layer): reused, so a step's seal allocates nothing. A fresh large
    # numpy array per call was 3-5x slower than the whole computation (every call faulted its
    # pages in again: glibc hands large blocks back to the OS when they are freed).
    SCRATCH_BYTES = 4 << 20
    # Pages read in place a chunk at a time: every pass of the seal over a chunk after the first
    # finds it in the CPU's cache (a 32 MiB seal, bench model at block 32: chunks of 0.5, 1, 2,
    # 4 MiB took 6.6, 6.1, 5.8, 5.9 ms; benchmarks/seal_micro.py has the copy beside it).
    CHUNK_BYTES = 4 << 20

    def _host_facts(
        self,
        block_ids: Sequence[int],
        check_finite: bool,
        with_syndromes: bool,
        flags: np.ndarray,
        syn: np.ndarray,
        digests: np.ndarray | None = None,
        visit: Callable[[int, np.ndarray, np.ndarray | None], None] | None = None,
        *,
        copy: bool = False,
    ) -> None:
        """:meth:`seal_facts` on host pages, a chunk of blocks at a time, every layer at once
        (a few calls a chunk, not a few per page or layer): where :attr:`reads_in_place`, the
        pages are hashed where they lie (``digests``, where given), then handed to ``visit``
        (:meth:`seal_host_pages`), then rowhash's ``pool_facts`` takes the syndromes and the
        NaN/Inf test in one pass a page, from the cache. Otherwise the pages are copied into a
        kept scratch buffer and the same is done over the copy (numpy's passes without numba)."""
        assert self._host_pages is not None
        views, test = self._host_pages
        ids = np.asarray(block_ids, dtype=np.int64)
        # (a step's few pages tested in Python: two numpy reductions cost more after a forward)
        if len(ids):
            lo_id, hi_id = (min(block_ids), max(block_ids)) if len(ids) <= 8 else (ids.min(), ids.max())
            if lo_id < 0 or hi_id >= self.num_blocks:
                raise IndexError(f"block ids outside the pool's {self.num_blocks} blocks")
        check = check_finite and test is not None
        layers = self.num_layers
        elements = views[0].shape[2]
        per_block = layers * elements
        if self.reads_in_place and not copy:
            assert self._page_at is not None
            chunk = max(1, self.CHUNK_BYTES // (per_block * views[0].itemsize))
            for lo in range(0, len(ids), chunk):
                part = ids[lo : lo + chunk]
                k = len(part)
                if digests is not None:
                    listed = part.tolist()
                    for layer in range(layers):
                        digests[lo : lo + k, layer] = self.digest_layer(layer, listed)
                if visit is not None:
                    visit(lo, part, None)
                if not (with_syndromes or check):
                    continue
                # (compiled, every address aligned: checked when the pool was made; a page too
                # large for the syndromes to address fails numpy's passes as well)
                assert self._facts is not None
                self._take_facts(self._facts(part, check), lo, k, with_syndromes, check, flags, syn)
            return
        if self._scratch is None:
            chunk = max(1, self.SCRATCH_BYTES // (per_block * views[0].itemsize))
            self._scratch = np.empty(chunk * per_block, dtype=views[0].dtype)
            self._scratch.fill(0)  # its pages touched once, now
        chunk = len(self._scratch) // per_block
        for lo in range(0, len(ids), chunk):
            part = ids[lo : lo + chunk]
            k = len(part)
            pages = self._scratch[: k * per_block].reshape(layers, k, elements)
            # "clip": no bounds pass (every id is a block of this pool) and no buffered copy.
            if len(views) == 1:
                np.take(views[0], part, axis=1, out=pages, mode="clip")
            else:
                for i, view in enumerate(views):
                    np.take(view[0], part, axis=0, out=pages[i], mode="clip")
            words = pages.reshape(layers * k, elements)
            if digests is not None:
                # Each page is one run (_host_pool): its bytes in memory order are its row here.
                h = self._hash
                got = np.fromiter(map(h, words.view(np.uint8)), dtype=np.uint64, count=layers * k)
                digests[lo : lo + k] = got.reshape(layers, k).T
            if visit is not None:
                visit(lo, part, pages)
            facts = (
                rowhash.page_facts(words, self._word_test if check else None)
                if with_syndromes or check
                else None
            )
            if facts is not None:
                # One compiled pass a page for both (numpy's: three passes over the copy).
                self._take_facts(facts, lo, k, with_syndromes, check, flags, syn)
                continue
            if with_syndromes:
                done = finish(*parities(words.view(np.uint8)))[:, : self.syndrome_words]
                syn[lo : lo + k] = done.reshape(layers, k, -1).swapaxes(0, 1)
            if check:
                assert test is not None
                magnitude, exponent = test
                # In place (the copy is not needed after this): with the sign bit cleared, a NaN
                # or Inf lane is one at or above the exponent mask.
                np.bitwise_and(words, words.dtype.type(magnitude), out=words)
                flags[lo : lo + k] = (words.max(axis=1) >= exponent).reshape(layers, k).T

    def _take_facts(
        self,
        facts: tuple[np.ndarray, np.ndarray],
        lo: int,
        k: int,
        with_syndromes: bool,
        check: bool,
        flags: np.ndarray,
        syn: np.ndarray,
    ) -> None:
        """rowhash's facts of a chunk (rows layer x k + page) into the (pages, layers) tables."""
        layers = self.num_layers
        done, bad = facts
        if with_syndromes:
            syn[lo : lo + k] = done[:, : self.syndrome_words].reshape(layers, k, -1).swapaxes(0, 1)
        if check:
            flags[lo : lo + k] = bad.reshape(layers, k).T

    def syndromes_on_device(self, index: torch.Tensor) -> torch.Tensor:
        """Syndromes of the pages ``index`` (block ids on the pages' device) where they live:
        (pages, layers, syndrome_words) int64, left on the device (the device path's seals)."""
        n = index.shape[0]
        return torch.stack(
            [
                syndromes_device(t.index_select(0, index).reshape(n, -1), self.syndrome_words)
                for t in self.tensors
            ],
            dim=1,
        )

    def host_page(self, block_id: int, layer: int) -> torch.Tensor:
        """A host copy of one page, in the page's logical order (the rare path: diagnosis)."""
        # A copy even on the host (contiguous().cpu() would return the live page itself).
        return self.tensors[layer][block_id].to("cpu", copy=True).contiguous()

    def digest_of(self, layer: int, page: torch.Tensor) -> int:
        """The digest this layer's page would have if it held ``page`` (a host tensor in logical
        order): laid out as the page is in memory, hashed over its runs, with this table's
        algorithm (KVG64 on the device path)."""
        live = self.tensors[layer][0]
        span = 1 + sum((size - 1) * stride for size, stride in zip(live.shape, live.stride(), strict=True))
        buffer = torch.zeros(span, dtype=page.dtype)
        torch.as_strided(buffer, live.shape, live.stride()).copy_(page.reshape(live.shape))
        raw = buffer.view(torch.uint8).numpy()
        data = b"".join(raw[off : off + n].tobytes() for off, n in self._runs[layer])
        if self.use_kernel:
            return int(kvg64_reference([data])[0])
        return int(self._hash(data))

    def write_word(self, block_id: int, layer: int, word: int, value: int) -> None:
        """Write one 64-bit word (the page's bytes in logical order) into the live page."""
        live = self.tensors[layer][block_id]
        size = live.element_size()
        first = 8 * word // size
        values = np.frombuffer(value.to_bytes(8, "little"), dtype=np.uint8)
        elements = torch.from_numpy(values.copy()).view(live.dtype)
        for k in range(min(len(elements), live.numel() - first)):
            live[tuple(int(i) for i in np.unravel_index(first + k, tuple(live.shape)))] = elements[k]

    def nonfinite(self, block_ids: Sequence[int]) -> np.ndarray:
        """Which pages hold NaN or Inf, shape (len(block_ids), num_layers), bool (see seal_facts)."""
        return self.seal_facts(block_ids, check_finite=True, with_syndromes=False)[0]

    def zero(self, block_ids: Sequence[int]) -> None:
        """Zero the given blocks in every layer (one indexed fill per layer)."""
        index = torch.as_tensor(list(block_ids), dtype=torch.int64, device=self.tensors[0].device)
        for tensor in self.tensors:
            tensor.index_fill_(0, index, 0)

    def page(self, block_id: int, layer: int) -> torch.Tensor:
        """The page as a tensor view (for fault injection and tests)."""
        return self.tensors[layer][block_id]
