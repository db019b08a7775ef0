"""Syndromes locate and mend every change confined to one 64-bit word; never a wider one."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_kvguard.digest.syndrome import locate, page_words, syndromes, width

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float64]


def _page(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=dtype, generator=g)
    return (torch.randn(shape, generator=g) * 1000).to(dtype)


def _bytes(page: torch.Tensor) -> np.ndarray:
    return page.contiguous().view(torch.uint8).reshape(-1).numpy().copy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 16, 8), (16, 2, 4, 8), (3, 5, 7)])  # K/V outer or inner; odd sizes
def test_every_single_bit_and_single_word_change_is_located(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    page = _page(dtype, shape, seed=len(shape))
    before = _bytes(page)
    sealed = syndromes(before[None])[0]
    rng = random.Random(hash((str(dtype), shape)) & 0xFFFF)
    words = len(page_words(before))
    for _ in range(60):
        after = before.copy()
        word = rng.randrange(words)
        lo, hi = 8 * word, min(8 * word + 8, len(after))
        if rng.random() < 0.5:  # one bit
            at = rng.randrange(lo, hi)
            after[at] ^= 1 << rng.randrange(8)
        else:  # any bytes of that word
            for at in range(lo, hi):
                if rng.random() < 0.6:
                    after[at] = rng.randrange(256)
        if (after == before).all():
            continue
        found = locate(sealed, syndromes(after[None])[0], page_words(after))
        assert found is not None and found.word == word
        assert found.old == int(page_words(before)[word]) and found.new == int(page_words(after)[word])
        assert found.flipped == found.old ^ found.new
        changed_bits = int(np.unpackbits(before[lo:hi] ^ after[lo:hi]).sum())
        assert found.single_bit == (changed_bits == 1)
        # Mending: writing the old word back restores the page byte for byte.
        mended = page_words(after).copy()
        mended[word] = np.uint64(found.old)
        assert (mended.view(np.uint8)[: len(before)] == before).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_wider_changes_are_never_located_as_one_word(dtype: torch.dtype) -> None:
    page = _page(dtype, (2, 4, 16, 8), seed=3)
    before = _bytes(page)
    sealed = syndromes(before[None])[0]
    words = page_words(before)
    rng = random.Random(7)
    for trial in range(300):
        after = before.copy()
        picks = rng.sample(range(len(words)), rng.choice([2, 2, 3, 5, 40]))
        for w in picks:
            after[8 * w + rng.randrange(8)] ^= 1 << rng.randrange(8)
        if trial % 3 == 0:
            after[:] = 0  # zeroed
        found = locate(sealed, syndromes(after[None])[0], page_words(after))
        if found is None:
            continue
        # A proposal is possible in principle (the sums can alias); mending it must then
        # not restore the page: callers check the digest, so it is never called repaired.
        mended = page_words(after).copy()
        mended[found.word] = np.uint64(found.old)
        assert not (mended.view(np.uint8)[: len(before)] == before).all()


def test_pages_of_any_size_up_to_the_address_width() -> None:
    for size in (1, 7, 8, 511, 512, 4096, 1 << 20):
        page = np.random.default_rng(size).integers(0, 256, (2, size), dtype=np.uint8)
        syn = syndromes(page)
        assert syn.shape == (2, 1 + 26)
        after = page.copy()
        after[1, size - 1] ^= 0x80  # the last byte: the highest word index
        kept = width(size)  # what a table keeps: the words beyond are zero for this size
        assert not syn[:, kept:].any()
        found = locate(syn[1][:kept], syndromes(after)[1][:kept], page_words(after[1]))
        assert found is not None and found.word == (size - 1) // 8 and found.single_bit
    assert width(65536) == 14


def test_unchanged_page_has_nothing_to_locate() -> None:
    page = _bytes(_page(torch.bfloat16, (2, 4, 16, 8), seed=1))
    s = syndromes(page[None])[0]
    assert locate(s, s, page_words(page)) is None


def test_device_syndromes_are_the_host_ones_bit_for_bit() -> None:
    from vllm_kvguard.digest.syndrome import syndromes_device

    for size in (8, 600, 4096, 65536, 70000):
        pages = torch.randint(0, 256, (3, size), dtype=torch.uint8)
        kept = width(size)
        host = syndromes(pages.numpy())[:, :kept]
        device = syndromes_device(pages, kept).numpy().view(np.uint64)
        assert (host == device).all(), size
    bf16 = torch.randn(4, 2, 64, 64).to(torch.bfloat16)
    kept = width(bf16[0].numel() * 2)
    assert (
        syndromes(bf16.reshape(4, -1).view(torch.uint8).numpy())[:, :kept]
        == syndromes_device(bf16, kept).numpy().view(np.uint64)
    ).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("words", [1, 63, 64, 65, 200, 8192])
def test_the_one_pass_kernel_gives_the_parities_and_the_nan_test_of_numpy(
    dtype: torch.dtype, words: int
) -> None:
    """rowhash.page_facts (the host seal's one compiled pass a page) gives the syndromes of
    numpy's two passes and finish (pages of one word to many 64-word rows, a partial last row)
    and flags exactly the pages holding a NaN or Inf, as the element test in numpy does."""
    from vllm_kvguard.digest import rowhash
    from vllm_kvguard.digest.dtypes import EXPONENT_TESTS

    elements = words * 8 // torch.empty(0, dtype=dtype).element_size()
    pages = torch.stack([_page(dtype, (elements,), seed) for seed in range(5)])
    if dtype.is_floating_point:
        pages[1, -1] = float("nan")
        pages[3, 0] = float("-inf")
        pages[4] = torch.finfo(dtype).max
    lanes = pages.view(getattr(torch, f"int{8 * pages.element_size()}")).numpy()
    test = EXPONENT_TESTS[dtype][:3] if dtype.is_floating_point else None
    facts = rowhash.page_facts(lanes, test)
    assert facts is not None
    syn, flags = facts
    assert np.array_equal(syn, syndromes(lanes.view(np.uint8))) and syn.any()
    want = (
        ~torch.isfinite(pages.float()).all(dim=1)
        if dtype.is_floating_point
        else torch.zeros(5, dtype=torch.bool)
    )
    assert flags.tolist() == want.tolist()
    # Pages that are not whole 64-bit words, or not contiguous: numpy's passes (None).
    assert rowhash.page_facts(lanes[:, 1:], test) is None
    assert rowhash.page_facts(lanes[:, ::2], test) is None
