"""Page digests: hash KV pages in place, keep the digests apart from the data.

A *page* is one block of one layer's KV tensor. Its digest is XXH3-64 (or XXH64)
over the page's bytes in memory order, read straight from the tensor's storage
through a memoryview: no KV data is copied on the CPU. Pages that are not one
contiguous run (some GPU layouts keep K and V apart) are hashed as the
concatenation of their contiguous runs, in memory order.

The digests live in a :class:`DigestTable` (blocks x layers, ``uint64``) beside
the data, never in it, as ZFS keeps checksums in the parent pointer.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from vllm_kvguard.config import HashAlgorithm

_ONE_SHOT = {
    HashAlgorithm.XXH3_64: xxhash.xxh3_64_intdigest,
    HashAlgorithm.XXH64: xxhash.xxh64_intdigest,
}
_STREAMING = {HashAlgorithm.XXH3_64: xxhash.xxh3_64, HashAlgorithm.XXH64: xxhash.xxh64}


@dataclass(frozen=True)
class PageMismatch:
    """A page whose bytes no longer match its seal."""

    block_id: int
    layer: str
    expected: int
    actual: int


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat memoryview over the tensor's whole CPU storage (no copy)."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return flat.numpy().data.cast("B")


def _page_runs(page: torch.Tensor) -> list[tuple[int, int]]:
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


def _lanes(pattern: int, bits: int) -> int:
    """``pattern`` repeated in every ``bits``-wide lane of a 64-bit word, as a signed int64."""
    word = 0
    for shift in range(0, 64, bits):
        word |= pattern << shift
    return word - (1 << 64) if word >= 1 << 63 else word


# dtype -> (exponent mask, lowest exponent bit, sign bit, element bits), the first three
# replicated over a 64-bit word. (x & mask) + low sets a lane's sign bit exactly when every
# exponent bit is set (NaN or Inf), and never carries into the next lane. Used by the host
# check below and by the page-digest kernel (kernel.py). Integer and fp8 caches are not
# tested (quantised caches hold no NaN; fp8 e4m3 has no Inf).
EXPONENT_TESTS = {
    dtype: (_lanes(mask, bits), _lanes(low, bits), _lanes(1 << (bits - 1), bits), bits)
    for dtype, bits, mask, low in (
        (torch.bfloat16, 16, 0x7F80, 0x0080),
        (torch.float16, 16, 0x7C00, 0x0400),
        (torch.float32, 32, 0x7F800000, 0x00800000),
    )
}


def _nonfinite_rows(rows: torch.Tensor) -> torch.Tensor:
    """Per row of a contiguous 2-D float tensor: does it hold NaN or Inf?"""
    test = EXPONENT_TESTS.get(rows.dtype)
    if test is None or (rows.shape[1] * rows.element_size()) % 8:
        return ~torch.isfinite(rows).all(dim=1)
    mask, low, sign, _ = test
    words = torch.bitwise_and(rows.view(torch.int64), mask)
    return words.add_(low).bitwise_and_(sign).any(dim=1)


def _kernel_runs(device: torch.device, runs: list[list[tuple[int, int]]]) -> bool:
    from vllm_kvguard.kernel import kernel_available

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
        self._runs = [_page_runs(t[0]) for t in self.tensors]
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
        # Every layer in one launch, seals and comparisons on the device, results read
        # later (DeviceDigestTable): when the layers share one page geometry, as the
        # layers of one vLLM KV cache group do.
        self.geometry = self._one_geometry() if use_kernel else None

    def _one_geometry(self) -> Any:
        from vllm_kvguard.kernel import PageGeometry

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
            out[:, layer] = self._digest_layer(layer, block_ids)
        return out

    def digest_layer(self, layer: int, block_ids: Sequence[int]) -> np.ndarray:
        """Digests of the given blocks for one layer, shape (len(block_ids),), uint64."""
        return np.asarray(self._digest_layer(layer, block_ids) if len(block_ids) else [], dtype=np.uint64)

    def _digest_layer(self, layer: int, block_ids: Sequence[int]) -> list[int]:
        runs = self._runs[layer]
        if self.use_kernel:
            from vllm_kvguard.kernel import kvg64_pages

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

    def nonfinite(self, block_ids: Sequence[int]) -> np.ndarray:
        """Which pages hold NaN or Inf, shape (len(block_ids), num_layers), bool.

        One gather per layer for the whole batch (the pages being sealed this step),
        then an exponent test on 64-bit words (:func:`_nonfinite_rows`), 3-4x faster
        than ``torch.isfinite`` on bf16 here. Integer KV dtypes (quantised caches)
        cannot hold NaN and are reported finite.
        """
        out = np.zeros((len(block_ids), self.num_layers), dtype=bool)
        if not block_ids:
            return out
        # The index is built once, and the flags come back in one transfer (not one per layer).
        index = torch.as_tensor(block_ids, device=self.tensors[0].device)
        layers = [i for i, t in enumerate(self.tensors) if t.is_floating_point()]
        if layers:
            flags = [
                _nonfinite_rows(self.tensors[i].index_select(0, index).reshape(len(block_ids), -1))
                for i in layers
            ]
            out[:, layers] = torch.stack(flags, dim=1).cpu().numpy()
        return out

    def page(self, block_id: int, layer: int) -> torch.Tensor:
        """The page as a tensor view (for fault injection and tests)."""
        return self.tensors[layer][block_id]


class DigestTable:
    """Sealed digests by block: a dense (blocks x layers) table plus a sealed mask."""

    def __init__(self, num_blocks: int, num_layers: int) -> None:
        self.digests = np.zeros((num_blocks, num_layers), dtype=np.uint64)
        self.sealed = np.zeros(num_blocks, dtype=bool)

    def seal(self, block_ids: Sequence[int], digests: np.ndarray) -> None:
        if len(block_ids):
            self.digests[block_ids] = digests
            self.sealed[block_ids] = True

    def forget(self, block_ids: Sequence[int]) -> None:
        if len(block_ids):
            self.sealed[block_ids] = False

    def host_digests(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The seals of the given blocks, (blocks x layers) uint64 on the host (tests, tools)."""
        return self.digests[np.asarray(block_ids, dtype=np.int64)]

    def sealed_only(self, block_ids: Sequence[int]) -> list[int]:
        if not len(block_ids):
            return []
        ids = np.asarray(block_ids, dtype=np.int64)
        return ids[self.sealed[ids]].tolist()

    def compare(
        self, block_ids: Sequence[int], actual: np.ndarray, names: Sequence[str]
    ) -> list[PageMismatch]:
        """Mismatches between ``actual`` (from :meth:`KVPages.digest`) and the seals."""
        if not len(block_ids):
            return []
        expected = self.digests[block_ids]
        rows, cols = np.nonzero(expected != actual)
        return [
            PageMismatch(int(block_ids[r]), names[c], int(expected[r, c]), int(actual[r, c]))
            for r, c in zip(rows.tolist(), cols.tolist(), strict=True)
        ]


class PendingCheck:
    """One launch's results, still on the device: read them when the step is over.

    The flags (one byte per page and layer) are copied to pinned host memory in
    the launch's stream order and an event is recorded after the copy; nothing
    waits for them until :meth:`settle`, which the guard calls once vLLM itself
    has waited for the step's output (or, non-blocking, when :meth:`ready`).
    Digests are fetched only for flagged pages (the rare path).
    """

    def __init__(
        self,
        block_ids: Sequence[int],
        flags: torch.Tensor,
        actual: torch.Tensor,
        expected: torch.Tensor | None,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.block_ids = list(block_ids)
        # The layer of each column, when the launch covered only some layers.
        self._layers = list(layers) if layers is not None else None
        self._flags, self._actual, self._expected = flags, actual, expected
        self._event: Any = None
        if flags.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._host_flags = host
        else:
            self._host_flags = flags
        self._result: list[tuple[int, int, int, int, int]] | None = None
        # The output thread (pickling the worker's output) and the worker's next step may
        # both settle the same check.
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether :meth:`settle` would not wait."""
        return self._result is not None or self._event is None or bool(self._event.query())

    @property
    def settled(self) -> bool:
        return self._result is not None

    def settle(self) -> list[tuple[int, int, int, int, int]]:
        """Flagged pages as (block id, layer index, flags, actual digest, sealed digest); idempotent."""
        with self._lock:
            return self._settle()

    def _settle(self) -> list[tuple[int, int, int, int, int]]:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            flags = self._host_flags.numpy()
            rows, cols = np.nonzero(flags)
            result = []
            if len(rows):
                actual = self._actual.cpu().view(torch.int64).numpy().view(np.uint64)
                expected = (
                    self._expected.cpu().view(torch.int64).numpy().view(np.uint64)
                    if self._expected is not None
                    else None
                )
                for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
                    sealed = int(expected[r, c]) if expected is not None else 0
                    layer = self._layers[c] if self._layers is not None else c
                    result.append((self.block_ids[r], layer, int(flags[r, c]), int(actual[r, c]), sealed))
            self._result = result
            self._flags = self._actual = self._expected = self._host_flags = None  # type: ignore[assignment]
            self._event = None
        return self._result


class DeviceDigestTable(DigestTable):
    """The seals on the device beside the KV cache; the sealed mask stays on the host.

    Sealing stores the kernel's digests straight into the table and verifying
    compares against it in the same launch (kernel.py), so neither moves a digest
    to the host or waits: each returns a :class:`PendingCheck`.
    """

    def __init__(self, pages: KVPages) -> None:
        assert pages.geometry is not None
        super().__init__(0, pages.num_layers)
        self.pages = pages
        self.sealed = np.zeros(pages.num_blocks, dtype=bool)
        self.device_digests = torch.zeros(
            (pages.num_blocks, pages.num_layers), dtype=torch.uint64, device=pages.geometry.device
        )

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        device = self.device_digests.device
        return ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids

    def seal_async(
        self, block_ids: Sequence[int], *, check_finite: bool = False, zero_nonfinite: bool = False
    ) -> PendingCheck | None:
        """Seal the pages; flags NaN/Inf when ``check_finite`` (else nothing to read back)."""
        if not len(block_ids):
            return None
        from vllm_kvguard.kernel import SEAL

        geometry = self.pages.geometry
        assert geometry is not None
        digests, flags = geometry.launch(
            self._ids(block_ids),
            mode=SEAL,
            table=self.device_digests,
            check_finite=check_finite,
            zero_nonfinite=zero_nonfinite,
        )
        self.sealed[list(block_ids)] = True
        return PendingCheck(block_ids, flags, digests, None) if check_finite else None

    def verify_async(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> PendingCheck:
        """Compare the pages with their seals on the device (all layers, or ``layers``)."""
        from vllm_kvguard.kernel import VERIFY

        ids = self._ids(block_ids)
        assert self.pages.geometry is not None
        actual, flags = self.pages.geometry.launch(ids, mode=VERIFY, table=self.device_digests, layers=layers)
        expected = self.device_digests.index_select(0, ids)
        if layers is not None:
            expected = expected[:, list(layers)]
        return PendingCheck(block_ids, flags, actual, expected, layers)

    def host_digests(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=self.device_digests.device)
        return self.device_digests.index_select(0, ids).cpu().view(torch.int64).numpy().view(np.uint64)

    def seal(self, block_ids: Sequence[int], digests: np.ndarray) -> None:
        """Host digests into the table (the synchronous path)."""
        if len(block_ids):
            self.device_digests[list(block_ids)] = (
                torch.from_numpy(digests.view(np.int64)).to(self.device_digests.device).view(torch.uint64)
            )
            self.sealed[list(block_ids)] = True
