"""On-device page digests: KVG64, a Triton kernel and its numpy reference.

XXH3 is a sequential hash: one page is one dependent chain, which a GPU cannot
spread over its threads. KVG64 keeps XXH64's round and final mix but makes
every 8-byte word independent, so a page is hashed by many threads at once and
summed. Over a byte string ``s`` of ``n`` bytes:

    pad s with zero bytes to a multiple of 8; w_j = little-endian uint64 word j, j = 0 .. m-1
    t_j    = avalanche(round((j + 1) * P5, w_j))       round(a, x) = rotl64(a + x * P2, 31) * P1
    h      = (t_0 + t_1 + ... + t_{m-1}) mod 2**64
    digest = avalanche(h xor (n * P3))

``avalanche`` is XXH64's final mix (x ^= x >> 33; x *= P2; x ^= x >> 29; x *= P3;
x ^= x >> 32) and P1..P5 are XXH64's primes; all arithmetic is mod 2**64. For a
fixed position ``j`` every step from ``w_j`` to ``t_j`` is a bijection, so a change
confined to one 8-byte word (any bit flip, any overwritten element) always changes
the digest; wider changes collide with probability about 2**-64. A page made of
several runs (K and V apart) is hashed as the concatenation of its runs; every
run but the last must then be a multiple of 8 bytes (true of vLLM's layouts).

:func:`kvg64_reference` (numpy) defines the digest; :func:`kvg64_pages` runs the
kernel on the device the tensor lives on (or under ``TRITON_INTERPRET=1`` on the
CPU, which is how CI checks the kernel bit for bit against the reference).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from vllm_kvguard.digest.dtypes import EXPONENT_TESTS

P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F
P3 = 0x165667B19E3779F9
P5 = 0x27D4EB2F165667C5
_MASK = (1 << 64) - 1


# ------------------------------------------------------------------ reference


def _avalanche(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(P2)
    x = x ^ (x >> np.uint64(29))
    x = x * np.uint64(P3)
    return x ^ (x >> np.uint64(32))


def kvg64_reference(pages: Sequence[bytes] | np.ndarray) -> np.ndarray:
    """KVG64 of each byte string (or each row of a uint8 array), uint64. The definition."""
    rows = [bytes(p) for p in pages] if not isinstance(pages, np.ndarray) else [r.tobytes() for r in pages]
    out = np.empty(len(rows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i, raw in enumerate(rows):
            n = len(raw)
            padded = raw + b"\0" * (-n % 8)
            words = np.frombuffer(padded, dtype="<u8").astype(np.uint64)
            keys = (np.arange(1, len(words) + 1, dtype=np.uint64) * np.uint64(P5)).astype(np.uint64)
            a = keys + words * np.uint64(P2)
            a = (a << np.uint64(31)) | (a >> np.uint64(33))
            terms = _avalanche(a * np.uint64(P1))
            h = np.uint64(int(terms.sum(dtype=np.uint64)) & _MASK)
            total = np.array([h ^ np.uint64((n * P3) & _MASK)], dtype=np.uint64)
            out[i] = _avalanche(total)[0]
    return out


# --------------------------------------------------------------------- kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # the host path needs no Triton
    triton = None

if triton is not None:

    @triton.jit
    def _avalanche_tl(x):  # type: ignore[no-untyped-def]
        x = x ^ (x >> 33)
        x = x * 0xC2B2AE3D27D4EB4F
        x = x ^ (x >> 29)
        x = x * 0x165667B19E3779F9
        return x ^ (x >> 32)

    @triton.jit
    def _xor(a, b):  # type: ignore[no-untyped-def]
        return a ^ b

    @triton.jit
    def _xor_all(x, LOG_N: tl.constexpr, FOLD: tl.constexpr):  # type: ignore[no-untyped-def]
        """The XOR of the 2**LOG_N words of ``x``. Compiled: one reduction. Under Triton's
        interpreter (FOLD), which runs a custom combine function once per element in Python,
        the same XOR as LOG_N folds of halves, each one numpy operation."""
        if FOLD:
            for i in tl.static_range(LOG_N):
                low, high = tl.split(tl.reshape(x, [1 << (LOG_N - 1 - i), 2]))
                x = low ^ high
            return tl.sum(x, axis=0)  # one word left
        else:
            return tl.reduce(x, 0, _xor)

    @triton.jit
    def _kvg64_kernel(  # type: ignore[no-untyped-def]
        base_ptr,  # uint8: the first layer's whole storage; every layer is addressed from it
        layer_origins_ptr,  # int64 [layers]: byte offset of each layer's block 0 from base_ptr
        layer_cols_ptr,  # int64 [launched layers]: which layer (table column) each program takes
        block_ids_ptr,  # int64 [pages]
        run_offsets_ptr,  # int64 [runs]: byte offset of each run in a page
        run_lengths_ptr,  # int64 [runs]: bytes in each run
        table_ptr,  # uint64 [num_blocks, layers]: the seals (SEAL writes, VERIFY reads)
        out_ptr,  # uint64 [pages, layers]: the digests computed
        flags_ptr,  # int8 [pages, layers]: bit 0 digest != seal (VERIFY), bit 1 NaN/Inf
        syn_ptr,  # int64 [num_blocks, layers, syn_words]: the seals' syndromes (SYNDROMES)
        syn_words,  # syndrome words kept per page
        num_runs,
        page_bytes,
        page_stride,  # bytes between blocks
        num_layers,  # columns of the table
        exp_mask,  # int64: per-lane exponent mask (CHECK_FINITE)
        exp_low,  # int64: per-lane lowest exponent bit
        lane_sign,  # int64: per-lane sign bit
        MODE: tl.constexpr,  # 0 digest, 1 seal (store into table), 2 verify (compare with table)
        CHECK_FINITE: tl.constexpr,  # flag words holding NaN/Inf (whole-word pages only)
        ZERO_NONFINITE: tl.constexpr,  # and overwrite those elements with zero
        LANE_BITS: tl.constexpr,  # element width in bits (CHECK_FINITE)
        WORDS: tl.constexpr,  # every run starts and ends on an 8-byte boundary: load words
        SYNDROMES: tl.constexpr,  # SEAL also stores each page's syndrome (digest/syndrome.py)
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,  # log2(BLOCK); with SYNDROMES every run but the last is whole BLOCKs
        HIGH_BITS: tl.constexpr,  # a power of two >= the page's word-address bits above LOG_BLOCK
        FOLD_XOR: tl.constexpr,  # XOR reductions as folds (under the interpreter: see _xor_all)
    ):
        page = tl.program_id(0)
        slot = tl.program_id(1)
        launched = tl.num_programs(1)
        layer = tl.load(layer_cols_ptr + slot)
        block = tl.load(block_ids_ptr + page)
        start = tl.load(layer_origins_ptr + layer) + block * page_stride
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        bad = tl.zeros([BLOCK], dtype=tl.uint64)
        lanes = tl.arange(0, BLOCK)
        byte_lanes = tl.arange(0, 8)
        first_word = start * 0  # int64 zero: word index of the run's first word in the page
        if SYNDROMES:
            # Word j of the page is XORed into syndrome word 1 + b for each set bit b of j.
            # Chunks start on multiples of BLOCK, so j's low LOG_BLOCK bits are the lane's own:
            # a per-lane XOR, spread over the low bits at the end; the others are the chunk's:
            # the chunk's XOR goes to the high bits its start has set. (Per-lane accumulators
            # for the high bits instead: about 9 % slower on an H200, docs/performance.md.)
            low_acc = tl.zeros([BLOCK], dtype=tl.uint64)
            high_bits = tl.arange(0, HIGH_BITS)
            high_acc = tl.zeros([HIGH_BITS], dtype=tl.uint64)
        for r in range(num_runs):
            offset = tl.load(run_offsets_ptr + r)
            length = tl.load(run_lengths_ptr + r)
            num_words = (length + 7) // 8
            for w in range(0, num_words, BLOCK):
                index = w + lanes
                live = index < num_words
                if WORDS:
                    words_ptr = (base_ptr + start + offset).to(tl.pointer_type(tl.uint64))
                    x = tl.load(words_ptr + index, mask=live, other=0)
                else:
                    at = index[:, None] * 8 + byte_lanes[None, :]
                    raw = tl.load(base_ptr + start + offset + at, mask=at < length, other=0)
                    x = tl.sum(raw.to(tl.uint64) << (byte_lanes[None, :].to(tl.uint64) * 8), axis=1)
                key = (first_word + index + 1).to(tl.uint64) * 0x27D4EB2F165667C5
                a = key + x * 0xC2B2AE3D27D4EB4F
                a = (a << 31) | (a >> 33)
                a = _avalanche_tl(a * 0x9E3779B185EBCA87)
                acc += tl.where(live, a, 0)
                if SYNDROMES:
                    low_acc ^= x
                    chunk_start = first_word + w
                    high_set = ((chunk_start >> (LOG_BLOCK + high_bits)) & 1) != 0
                    high_acc ^= tl.where(high_set, _xor_all(x, LOG_BLOCK, FOLD_XOR), 0)
                if CHECK_FINITE:
                    # (x & mask) + low sets a lane's sign bit iff all its exponent bits are set.
                    hit = ((x & exp_mask.to(tl.uint64)) + exp_low.to(tl.uint64)) & lane_sign.to(tl.uint64)
                    bad |= tl.where(live, hit, 0)
                    if ZERO_NONFINITE:
                        # Spread each flagged lane's sign bit over the lane, clear those lanes.
                        fill = (hit >> (LANE_BITS - 1)) * ((1 << LANE_BITS) - 1)
                        words_ptr = (base_ptr + start + offset).to(tl.pointer_type(tl.uint64))
                        tl.store(words_ptr + index, x & ~fill, mask=live & (hit != 0))
            first_word += num_words
        h = tl.sum(acc, axis=0)
        h = h ^ (page_bytes.to(tl.uint64) * 0x165667B19E3779F9)
        digest = _avalanche_tl(h)
        tl.store(out_ptr + page * launched + slot, digest)
        flag = tl.zeros([1], dtype=tl.int8).sum(axis=0)
        if MODE == 1:
            tl.store(table_ptr + block * num_layers + layer, digest)
            if SYNDROMES:
                syn = syn_ptr + (block * num_layers + layer) * syn_words
                tl.store(syn, _xor_all(low_acc, LOG_BLOCK, FOLD_XOR).to(tl.int64, bitcast=True))
                for b in tl.static_range(LOG_BLOCK):
                    on = ((lanes >> b) & 1) != 0
                    word = _xor_all(tl.where(on, low_acc, 0), LOG_BLOCK, FOLD_XOR).to(tl.int64, bitcast=True)
                    tl.store(syn + 1 + b, word, mask=1 + b < syn_words)
                column = 1 + LOG_BLOCK + high_bits
                tl.store(syn + column, high_acc.to(tl.int64, bitcast=True), mask=column < syn_words)
        if MODE == 2:
            sealed = tl.load(table_ptr + block * num_layers + layer)
            flag = flag | (sealed != digest).to(tl.int8)
        if CHECK_FINITE:
            flag = flag | ((tl.max(bad, axis=0) != 0).to(tl.int8) * 2)
        tl.store(flags_ptr + page * launched + slot, flag)

    @triton.jit
    def _row_kernel(  # type: ignore[no-untyped-def]
        base_ptr,  # uint8: the first layer's whole storage (as in _kvg64_kernel)
        layer_origins_ptr,  # int64 [layers]: byte offset of each layer's block 0 from base_ptr
        block_ids_ptr,  # int64 [rows]
        slot_ids_ptr,  # int64 [rows]
        run_offsets_ptr,  # int64 [runs]: byte offset in a page of each run of a row, at slot 0
        table_ptr,  # uint64 [num_blocks x block_size]: the rows' digests (RECORD writes, CHECK reads)
        previous_ptr,  # uint64 [num_blocks x block_size]: the previous owner's (RECORD reads)
        out_ptr,  # uint64 [rows]: the digests computed
        other_ptr,  # uint64 [rows]: RECORD the previous owner's digest, CHECK the recorded one
        flags_ptr,  # uint8 [rows]: RECORD equal to a previous owner's row, CHECK changed
        num_layers,
        num_runs,
        run_words,  # 8-byte words in each run
        page_stride,  # bytes between blocks
        slot_stride,  # bytes between slots
        block_size,
        MODE: tl.constexpr,  # 0 digest, 1 record, 2 check
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        block = tl.load(block_ids_ptr + row)
        slot = tl.load(slot_ids_ptr + row)
        lanes = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        slot_key = slot.to(tl.uint64) * 0x165667B19E3779F9
        first_word = block * 0  # int64 zero: the row's word index of the run's first word
        for layer in range(num_layers):
            start = tl.load(layer_origins_ptr + layer) + block * page_stride + slot * slot_stride
            for r in range(num_runs):
                words_ptr = (base_ptr + start + tl.load(run_offsets_ptr + r)).to(tl.pointer_type(tl.uint64))
                for w in range(0, run_words, BLOCK):
                    index = w + lanes
                    live = index < run_words
                    x = tl.load(words_ptr + index, mask=live, other=0)
                    key = (first_word + index + 1).to(tl.uint64) * 0x27D4EB2F165667C5 + slot_key
                    a = key + x * 0xC2B2AE3D27D4EB4F
                    a = (a << 31) | (a >> 33)
                    a = _avalanche_tl(a * 0x9E3779B185EBCA87)
                    acc += tl.where(live, a, 0)
                first_word += run_words
        digest = _avalanche_tl(tl.sum(acc, axis=0))
        digest = tl.where(digest == 0, 1, digest).to(tl.uint64)  # 0 marks an unwritten slot
        entry = block * block_size + slot
        tl.store(out_ptr + row, digest)
        if MODE == 1:
            previous = tl.load(previous_ptr + entry)
            tl.store(table_ptr + entry, digest)
            tl.store(other_ptr + row, previous)
            tl.store(flags_ptr + row, ((digest == previous) & (previous != 0)).to(tl.uint8))
        if MODE == 2:
            recorded = tl.load(table_ptr + entry)
            tl.store(other_ptr + row, recorded)
            tl.store(flags_ptr + row, (digest != recorded).to(tl.uint8))


# Whether an interpreted launch folds its XOR reductions (``_xor_all``): the kernel's syndromes
# then cost a few numpy operations a chunk instead of a Python call a word. A compiled kernel
# always reduces (FOLD_XOR is a constexpr: its fold is never compiled). Tests set this False to
# run the compiled kernel's reduction under the interpreter too (tests/unit/digest/kernel_cases.py).
FOLD_XOR = True


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when they were built)."""
    return triton is not None and type(_kvg64_kernel).__name__ == "InterpretedFunction"


def kernel_available(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on ``device`` (a GPU, or the interpreter)."""
    import os

    if triton is None:
        return False
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return device.type in ("cuda", "xpu")


# The launch's tuning: words per iteration of a program (a power of two) and warps per
# program (None: Triton's default, 4). Measured on a GPU with benchmarks/device_bench.py
# --sweep (docs/performance.md, "The device path on a GPU").
BLOCK_WORDS = 512
NUM_WARPS: int | None = 4
# The seal launch that also stores syndromes (more live registers per lane) has its own.
SEAL_BLOCK_WORDS = 512
SEAL_NUM_WARPS: int | None = 4

DIGEST, SEAL, VERIFY = 0, 1, 2
MISMATCH, NONFINITE = 1, 2


class PageGeometry:
    """Where a set of equally shaped KV tensors keep their pages, for one kernel launch.

    ``tensors`` have blocks on dim 0 and the same page layout (runs, block stride,
    dtype); ``runs`` are each page's contiguous byte runs (offset from the page
    start, length), as :func:`vllm_kvguard.digest.pages.page_runs` gives them. The
    layers are addressed from the first one's storage by byte offsets, so one
    launch covers every layer of a step's pages.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], runs: Sequence[tuple[int, int]]) -> None:
        if triton is None:
            raise RuntimeError("the KVG64 kernel needs Triton")
        for _, length in runs[:-1]:
            if length % 8:
                raise ValueError("KVG64 needs every run but the last to be a multiple of 8 bytes")
        first = tensors[0]
        self.device = first.device
        self.dtype = first.dtype
        self.base, origins, self.page_stride = _layers_from_one_base(tensors)
        self.num_layers = len(tensors)
        self.origins = torch.tensor(origins, dtype=torch.int64, device=self.device)
        self._cols: dict[tuple[int, ...] | None, torch.Tensor] = {
            None: torch.arange(self.num_layers, dtype=torch.int64, device=self.device)
        }
        self.offsets = torch.tensor([o for o, _ in runs], dtype=torch.int64, device=self.device)
        self.lengths = torch.tensor([n for _, n in runs], dtype=torch.int64, device=self.device)
        self.num_runs = len(runs)
        self.page_bytes = sum(n for _, n in runs)
        self.words = all(o % 8 == 0 for o in origins) and self.page_stride % 8 == 0
        self.words = self.words and all(o % 8 == 0 and n % 8 == 0 for o, n in runs)
        self.finite_test = EXPONENT_TESTS.get(self.dtype) if self.words else None
        self._run_words = [(n + 7) // 8 for _, n in runs]
        self._run_words_total = sum(self._run_words)

    def columns(self, layers: Sequence[int] | None) -> torch.Tensor:
        """The table columns of ``layers`` (None: all) as an int64 tensor on the device, built
        once per set of layers (building it copies from the host, which waits)."""
        key = tuple(layers) if layers is not None else None
        cols = self._cols.get(key)
        if cols is None:
            cols = self._cols[key] = torch.tensor(list(key or ()), dtype=torch.int64, device=self.device)
        return cols

    def syndrome_block(self, block: int) -> int | None:
        """The BLOCK a seal launch that also stores syndromes uses (``block`` or less), or None
        where the kernel cannot: it needs whole-word runs, each but the last a whole number of
        BLOCKs (true of vLLM's layouts: a K or V run is block_size x heads x head_size)."""
        if not self.words:
            return None
        while block >= 16:
            if all(n % block == 0 for n in self._run_words[:-1]):
                return block
            block //= 2
        return None

    def launch(
        self,
        block_ids: torch.Tensor,
        *,
        mode: int = DIGEST,
        table: torch.Tensor | None = None,
        check_finite: bool = False,
        zero_nonfinite: bool = False,
        layers: Sequence[int] | None = None,
        syndromes: torch.Tensor | None = None,
        block: int | None = None,
        num_warps: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch over ``block_ids`` (int64, on the device) x every layer (or ``layers``).

        Returns ``(digests, flags)``, uint64 and int8 tensors of shape
        (pages, launched layers) on the device, not synchronised: the caller decides when
        the host looks at them. ``mode`` SEAL also stores the digests into
        ``table`` (uint64 [num_blocks, layers]); VERIFY compares them with it and
        sets bit ``MISMATCH`` in ``flags``. ``check_finite`` sets bit
        ``NONFINITE`` for pages holding NaN/Inf (bf16, fp16, fp32 on whole-word
        pages) and ``zero_nonfinite`` overwrites those elements with zero (the digest, flags
        and syndrome are of the page as it was). With ``syndromes`` (int64 [num_blocks, layers,
        words], SEAL only) the launch also stores each page's syndrome (digest/syndrome.py) there,
        from the same pass over the bytes; :meth:`syndrome_block` must allow it.
        ``block`` (a power of two) words per iteration and ``num_warps`` tune the launch.
        """
        pages = int(block_ids.numel())
        cols = self.columns(layers)
        launched = int(cols.numel())
        out = torch.empty((pages, launched), dtype=torch.uint64, device=self.device)
        flags = torch.zeros((pages, launched), dtype=torch.int8, device=self.device)
        if mode != DIGEST and (table is None or table.shape[1] != self.num_layers):
            raise ValueError("seal and verify need a digest table of shape (num_blocks, layers)")
        if pages == 0 or launched == 0:
            return out, flags
        with_syndromes = syndromes is not None
        block = block or (SEAL_BLOCK_WORDS if with_syndromes else BLOCK_WORDS)
        num_warps = num_warps or (SEAL_NUM_WARPS if with_syndromes else NUM_WARPS)
        if block & (block - 1):
            raise ValueError("block must be a power of two")
        high_bits = 1
        if syndromes is not None:
            fused = self.syndrome_block(block)
            if mode != SEAL or fused is None or tuple(syndromes.shape[:2]) != tuple(table.shape):  # type: ignore[union-attr]
                raise ValueError(
                    "syndromes are stored by SEAL launches over whole-BLOCK runs, into a "
                    "(num_blocks, layers, words) table"
                )
            block = fused
            address_bits = (max(self._run_words_total, 1) - 1).bit_length()
            high_bits = 1 << max(0, address_bits - (block.bit_length() - 1) - 1).bit_length()
        test = self.finite_test if check_finite else None
        mask, low, sign, bits = test if test is not None else (0, 0, 0, 16)
        tuning = {"num_warps": num_warps} if num_warps else {}
        _kvg64_kernel[(pages, launched)](
            self.base,
            self.origins,
            cols,
            block_ids,
            self.offsets,
            self.lengths,
            table if table is not None else out,
            out,
            flags,
            syndromes if syndromes is not None else out,
            syndromes.shape[2] if syndromes is not None else 0,
            self.num_runs,
            self.page_bytes,
            self.page_stride,
            self.num_layers,
            mask,
            low,
            sign,
            MODE=mode,
            CHECK_FINITE=test is not None,
            ZERO_NONFINITE=test is not None and zero_nonfinite,
            LANE_BITS=bits,
            WORDS=self.words,
            SYNDROMES=with_syndromes,
            BLOCK=block,
            LOG_BLOCK=block.bit_length() - 1,
            HIGH_BITS=high_bits,
            FOLD_XOR=FOLD_XOR and interpreted(),
            **tuning,
        )
        return out, flags


def _layers_from_one_base(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int], int]:
    """(the first layer's whole storage as uint8, each layer's byte offset from it, bytes between
    blocks): how one launch addresses every layer. The layers must share dtype, block stride
    and device."""
    first = tensors[0]
    elsize = first.element_size()
    page_stride = first.stride(0) * elsize
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.stride(0) * elsize != page_stride or t.device != first.device:
            raise ValueError("one launch needs layers of one dtype, block stride and device")
    storage = first.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (storage.nbytes(),), (1,))
    return base, [t.data_ptr() - storage.data_ptr() for t in tensors], page_stride


RECORD, CHECK = 1, 2
ROW_BLOCK_WORDS = 256


class RowGeometry:
    """Where every layer keeps the row (block, slot) of its pages, for one row-digest launch
    (digest/rows.py's device digests, computed by :func:`_row_kernel` instead of ~20 torch ops
    and a gather per layer).

    ``tensors`` are block-first with the same page layout; page dimension ``axis`` indexes
    slots. A row is what ``AxisRows`` gathers: for each index of the page dimensions before
    ``axis`` (a run), the dimensions after it, which must be contiguous and whole 8-byte words.
    Raises ValueError where they are not (the torch path reads such rows)."""

    def __init__(self, tensors: Sequence[torch.Tensor], axis: int) -> None:
        if triton is None:
            raise RuntimeError("the row kernel needs Triton")
        first = tensors[0]
        elsize = first.element_size()
        shape, strides = tuple(first.shape[1:]), tuple(first.stride()[1:])
        inner = shape[axis + 1 :]
        expected = 1
        for n, stride in zip(reversed(inner), reversed(strides[axis + 1 :]), strict=True):
            if n > 1 and stride != expected:
                raise ValueError("the dimensions after the slot axis are not contiguous")
            expected *= n
        run_bytes = expected * elsize
        outer = [range(n) for n in shape[:axis]]
        offsets = [
            sum(i * st for i, st in zip(index, strides[:axis], strict=True)) * elsize
            for index in itertools.product(*outer)
        ]
        self.base, origins, self.page_stride = _layers_from_one_base(tensors)
        self.slot_stride = strides[axis] * elsize
        if any(v % 8 for v in (run_bytes, self.page_stride, self.slot_stride, *offsets, *origins)):
            raise ValueError("rows must be whole 8-byte words at 8-byte offsets")
        self.device = first.device
        self.num_layers = len(tensors)
        self.origins = torch.tensor(origins, dtype=torch.int64, device=self.device)
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=self.device)
        self.num_runs = len(offsets)
        self.run_words = run_bytes // 8
        self.block_size = shape[axis]

    def launch(
        self,
        blocks: torch.Tensor,
        slots: torch.Tensor,
        *,
        mode: int = DIGEST,
        table: torch.Tensor | None = None,
        previous: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One launch over the rows (blocks[i], slots[i]) (int64, on the device). Returns
        ``(digests, other, flags)`` on the device, not synchronised: int64 digests (bit for bit
        :func:`vllm_kvguard.digest.rows.row_digests_reference`), and for ``mode`` RECORD (stores
        the digests into ``table``, int64 [num_blocks x block_size]) the ``previous`` table's
        entries and whether each row equals it (and it is not 0); for CHECK the ``table``'s
        entries and whether each row differs from it."""
        n = int(blocks.numel())
        if (mode != DIGEST and table is None) or (mode == RECORD and previous is None):
            raise ValueError("record needs both tables, check the table")
        # RECORD and CHECK write every entry; a plain digest leaves other and flags zero.
        fill = torch.empty if mode != DIGEST else torch.zeros
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        other = fill(n, dtype=torch.int64, device=self.device)
        flags = fill(n, dtype=torch.uint8, device=self.device)
        if n == 0:
            return out, other, flags
        table_u = table.view(torch.uint64) if table is not None else out.view(torch.uint64)
        _row_kernel[(n,)](
            self.base,
            self.origins,
            blocks,
            slots,
            self.offsets,
            table_u,
            previous.view(torch.uint64) if previous is not None else table_u,
            out.view(torch.uint64),
            other.view(torch.uint64),
            flags,
            self.num_layers,
            self.num_runs,
            self.run_words,
            self.page_stride,
            self.slot_stride,
            self.block_size,
            MODE=mode,
            BLOCK=ROW_BLOCK_WORDS,
        )
        return out, other, flags


def kvg64_pages(
    tensor: torch.Tensor, block_ids: Sequence[int], runs: Sequence[tuple[int, int]], block: int | None = None
) -> torch.Tensor:
    """KVG64 of pages ``tensor[b]`` for ``b`` in ``block_ids``, one launch, on ``tensor``'s device.

    ``tensor`` has blocks on dim 0. Returns a uint64 tensor on the same device;
    the caller decides when to bring it to the host.
    """
    geometry = PageGeometry([tensor], runs)
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=tensor.device)
    return geometry.launch(ids, block=block)[0][:, 0]
