import itertools

import numpy as np
import pytest
import torch
import xxhash

from vllm_kvguard.config import HashAlgorithm
from vllm_kvguard.digest import DigestTable, KVPages


def _kv(num_blocks=8, heads=2, bs=32, hd=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, heads, bs, hd, generator=g).to(dtype)


def test_digest_is_xxh3_over_the_page_bytes() -> None:
    kv = _kv()
    pages = KVPages({"l0": kv})
    got = pages.digest([3, 5])
    for row, b in enumerate([3, 5]):
        assert int(got[row, 0]) == xxhash.xxh3_64_intdigest(
            kv[b].contiguous().view(torch.uint8).numpy().tobytes()
        )


def test_xxh64_option() -> None:
    kv = _kv()
    pages = KVPages({"l0": kv}, algorithm=HashAlgorithm.XXH64)
    assert int(pages.digest([1])[0, 0]) == xxhash.xxh64_intdigest(kv[1].view(torch.uint8).numpy().tobytes())


def test_views_share_memory_no_copy() -> None:
    kv = _kv()
    pages = KVPages({"l0": kv})
    before = pages.digest([2])
    kv[2, 0, 0, 0] += 1.0
    assert pages.digest([2])[0, 0] != before[0, 0]
    assert pages.page(2, 0).data_ptr() == kv[2].data_ptr()


def test_layers_sharing_a_tensor_are_hashed_once() -> None:
    kv = _kv()
    other = _kv(seed=1)
    pages = KVPages({"a": kv, "b": kv, "c": other})
    assert pages.names == ["a", "c"] and pages.num_layers == 2


def test_views_into_one_backing_buffer() -> None:
    backing = torch.randn(2 * 8 * 2 * 32 * 64).to(torch.bfloat16)
    l0 = backing[: backing.numel() // 2].view(8, 2, 32, 64)
    l1 = backing[backing.numel() // 2 :].view(8, 2, 32, 64)
    pages = KVPages({"l0": l0, "l1": l1})
    got = pages.digest([4])
    assert int(got[0, 1]) == xxhash.xxh3_64_intdigest(l1[4].contiguous().view(torch.uint8).numpy().tobytes())


def test_non_contiguous_gpu_style_layout_hashes_runs_in_memory_order() -> None:
    # (2, num_blocks, block_size, heads, head_dim): K and V of a block are apart.
    kv = torch.randn(2, 6, 16, 2, 8).to(torch.float16)
    pages = KVPages({"l0": kv}, block_dim=1)
    expected = xxhash.xxh3_64(kv[0, 3].numpy().tobytes() + kv[1, 3].numpy().tobytes()).intdigest()
    assert int(pages.digest([3])[0, 0]) == expected
    assert pages.bytes_per_block == 2 * 16 * 2 * 8 * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_every_kv_dtype(dtype: torch.dtype) -> None:
    kv = _kv(dtype=dtype)
    pages = KVPages({"l0": kv})
    table = DigestTable(pages.num_blocks, pages.num_layers)
    table.seal([0, 1, 2], pages.digest([0, 1, 2]))
    assert table.compare([0, 1, 2], pages.digest([0, 1, 2]), pages.names) == []
    kv.view(torch.uint8)[1, 0, 0, 0] ^= 0x10
    bad = table.compare([0, 1, 2], pages.digest([0, 1, 2]), pages.names)
    assert [(m.block_id, m.layer) for m in bad] == [(1, "l0")]
    assert bad[0].expected != bad[0].actual


def test_table_seal_forget_and_sealed_only() -> None:
    table = DigestTable(8, 2)
    table.seal([1, 2], np.array([[1, 2], [3, 4]], dtype=np.uint64))
    assert table.sealed_only([0, 1, 2, 3]) == [1, 2]
    table.forget([1])
    assert table.sealed_only([1, 2]) == [2]
    assert table.sealed_only([]) == []


@pytest.mark.parametrize("few", [True, False])
def test_read_seals_are_the_sealed_pages_and_their_seals_by_layer(few: bool) -> None:
    """A step's reads: the sealed ones, in order, and their seals per layer as Python ints,
    looked up in Python for a few pages and with numpy for more, alike."""
    table = DigestTable(40, 3)
    rng = np.random.default_rng(2)
    sealed = list(range(0, 40, 3))
    table.seal(sealed, rng.integers(1, 2**63, (len(sealed), 3), dtype=np.int64).view(np.uint64))
    ids = [3, 4, 0, 9, 7] if few else [3, 4, 0, 9, 7, 12, 13, 15, 21, 22, 30]
    assert (len(ids) <= table.FEW_READS) == few
    blocks, seals = table.read_seals(ids)
    assert blocks == [b for b in ids if b % 3 == 0]
    assert seals == table.digests[blocks].T.tolist() and all(type(d) is int for d in seals[2])
    assert table.read_seals([1, 2] if few else list(range(1, 40, 3))) == ([], [[], [], []])


def test_empty_batches() -> None:
    pages = KVPages({"l0": _kv()})
    assert pages.digest([]).shape == (0, 1)
    assert DigestTable(8, 1).compare([], pages.digest([]), pages.names) == []


def test_copy_to_host_path_gives_the_same_digest() -> None:
    # The slow path for KV not in host memory must agree with the in-place path.
    kv = torch.randn(2, 6, 16, 2, 8).to(torch.float16)
    pages = KVPages({"l0": kv}, block_dim=1)
    in_place = pages.digest([1, 3])
    pages.on_host = False
    assert (pages.digest([1, 3]) == in_place).all()


def test_per_layer_digest() -> None:
    l0, l1 = _kv(), _kv(seed=1)
    pages = KVPages({"l0": l0, "l1": l1})
    before = pages.digest([2, 3])
    # Python ints (a step's reads are compared in Python), equal to digest()'s columns.
    assert pages.digest_layer(1, [2, 3]) == before[:, 1].tolist()
    l1.view(torch.uint8)[3, 0, 0, 5] ^= 1
    assert pages.digest_layer(0, [2, 3]) == before[:, 0].tolist()
    after = pages.digest_layer(1, [2, 3])
    assert [a != b for a, b in zip(after, before[:, 1].tolist(), strict=True)] == [False, True]
    assert pages.digest_layer(0, []) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_finds_exactly_the_pages_with_nan_or_inf(dtype: torch.dtype, bad: float) -> None:
    kv = (torch.randn(6, 2, 4, 8) * 100).to(dtype)
    kv[1, 1, 3, 7] = bad  # last element of a page
    kv[4, 0, 0, 0] = bad  # first element
    kv[2] = torch.finfo(dtype).max  # largest finite values are finite
    kv[3] = -0.0
    pages = (
        KVPages({"a": kv, "b": kv[:, :, :, :5]}, block_dim=0)
        if dtype == torch.float64
        else KVPages({"a": kv})
    )
    found = pages.nonfinite([0, 1, 2, 3, 4, 5])
    assert found[:, 0].tolist() == [False, True, False, False, True, False]
    assert pages.nonfinite([]).shape == (0, pages.num_layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64])
@pytest.mark.parametrize("one_buffer", [True, False])
@pytest.mark.parametrize("chunk", [KVPages.SCRATCH_BYTES, 1, 3 * 256])
@pytest.mark.parametrize("path", ["in place", "copy", "numpy"])
def test_seal_facts_on_host_pages_equal_the_per_layer_path(
    dtype: torch.dtype, one_buffer: bool, chunk: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host pages' path (every layer at once, a chunk of whole blocks at a time, here also
    1 and 2 blocks at a time; the pages read in place in the pool by rowhash's compiled pass,
    or copied into a kept scratch buffer, one view where the layers share a buffer as vLLM
    allocates them, and passed over by the compiled pass or, without numba, numpy's passes)
    finds the same NaN/Inf pages and syndromes as the per-layer torch path, twice in a row
    (the scratch reused); float64, which the exponent test does not cover, takes the torch
    path."""
    from vllm_kvguard.digest import rowhash

    if path == "numpy":
        monkeypatch.setattr(rowhash, "_compiled", None)
        monkeypatch.setattr(rowhash, "_why_not", "ImportError: No module named 'numba'")
    buffer = (torch.randn(3, 12, 2, 4, 16) * 100).to(dtype)
    layers = {f"l{i}": buffer[i] if one_buffer else buffer[i].clone() for i in range(3)}
    pages = KVPages(layers)
    pages.SCRATCH_BYTES = pages.CHUNK_BYTES = chunk * buffer.element_size()  # blocks of 3 x 128 elements
    fast = pages._host_pages
    if dtype == torch.float64:
        assert fast is None and not pages.reads_in_place
        return
    assert fast is not None and len(fast[0]) == (1 if one_buffer else 3)
    if path == "copy":
        pages._page_at = None  # (as where the pages are not 8-byte aligned)
    assert pages.reads_in_place == (path == "in place")
    if dtype.is_floating_point:
        layers["l1"][5, 1, 3, 15] = float("nan")
        layers["l2"][7, 0, 0, 0] = float("-inf")
        layers["l0"][9, 0, 2, 1] = float("inf")
        layers["l0"][3] = torch.finfo(dtype).max  # finite
    ids = [5, 7, 9, 3, 0]
    pages.seal_facts([11, 10], check_finite=True)  # the scratch holds other pages first
    flags, syn = pages.seal_facts(ids, check_finite=True)
    if path == "in place":
        assert pages._scratch is None  # no copy made
    else:
        assert pages._scratch is not None
        assert len(pages._scratch) == max(1, chunk // 384) * 384
    pages._host_pages = None  # the per-layer torch path, on the same pages
    want_flags, want_syn = pages.seal_facts(ids, check_finite=True)
    assert (syn == want_syn).all() and syn.any()
    assert flags.tolist() == want_flags.tolist()
    expected = [[False, True, False], [False, False, True], [True, False, False], [False] * 3, [False] * 3]
    assert flags.tolist() == (expected if dtype.is_floating_point else [[False] * 3] * 5)
    pages._host_pages = fast
    # Outside the pool either way, a step's few pages (tested in Python) or more (in numpy).
    for outside in ([3, 12], [-1, 3], [3] * 8 + [12], [-1] + [3] * 8):
        with pytest.raises(IndexError, match="outside the pool's 12 blocks"):
            pages.seal_facts(outside, check_finite=True)


def test_nonfinite_ignores_integer_caches() -> None:
    pages = KVPages({"a": torch.full((3, 16), 255, dtype=torch.uint8)})
    assert not pages.nonfinite([0, 1, 2]).any()


@pytest.mark.parametrize("split", [False, True])
def test_diagnosis_primitives_hold_for_contiguous_and_split_pages(split: bool) -> None:
    """What diagnosis relies on: a host copy of a page (logical order) hashes as the live page
    (also for pages in two runs, K and V apart), a word written through write_word lands where
    the syndrome then locates it, and writing the old word back restores the seal."""
    from vllm_kvguard.digest.syndrome import locate, page_words, syndromes

    if split:  # (2, blocks, heads, bs, hd): K and V apart, blocks on dim 1
        kv = torch.randn(2, 8, 2, 32, 64).to(torch.bfloat16)
        pages = KVPages({"l0": kv}, block_dim=1)
        assert len(pages._runs[0]) == 2
    else:
        pages = KVPages({"l0": _kv()})

    def page_bytes() -> np.ndarray:
        return pages.host_page(3, 0).view(torch.uint8).reshape(-1).numpy()

    before = pages.host_page(3, 0)
    sealed_digest = int(pages.digest([3])[0, 0])
    assert pages.digest_of(0, before) == sealed_digest
    sealed = syndromes(page_bytes()[None])[0]
    word = int(page_words(page_bytes())[777])
    pages.write_word(3, 0, 777, word ^ (1 << 13))
    assert int(pages.digest([3])[0, 0]) != sealed_digest
    now = page_bytes()
    found = locate(sealed, syndromes(now[None])[0], page_words(now))
    assert found is not None and found.word == 777 and found.flipped == 1 << 13 and found.old == word
    pages.write_word(3, 0, found.word, found.old)
    assert int(pages.digest([3])[0, 0]) == sealed_digest
    assert torch.equal(pages.host_page(3, 0).view(torch.int16), before.view(torch.int16))


def test_the_seal_scratch_is_the_documented_size() -> None:
    """docs/performance.md, "Memory": no copy where the seal reads pages in place; else 4 MiB, or
    one block of every layer where that is larger."""
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "performance.md").read_text()
    assert "`KVPages.SCRATCH_BYTES`: 4 MiB, or one block of every layer where that is" in doc
    assert "The seal reads pages in place in the pool and keeps no copy" in doc
    small = KVPages({f"l{i}": torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16) for i in range(4)})
    assert small.reads_in_place
    small.seal_facts([1], check_finite=True)
    assert small._scratch is None
    small._page_at = None  # (as where the pages are not 8-byte aligned)
    small.seal_facts([1], check_finite=True)
    assert small._scratch is not None and small._scratch.nbytes == 4 << 20  # 128 blocks of 32 KiB
    # Pages 2 bytes past a 64-bit word are not read by address: copied.
    shifted = torch.zeros(4 * 8 * 16 * 8 * 128 + 1, dtype=torch.bfloat16)[1:].view(4, 8, 16, 8, 128)
    odd = KVPages({f"l{i}": shifted[i] for i in range(4)})
    assert odd.seals_host_pages and not odd.reads_in_place
    odd.seal_facts([1], check_finite=True)
    assert odd._scratch is not None
    large = KVPages({f"l{i}": torch.zeros(2, 16, 8, 128, dtype=torch.bfloat16) for i in range(160)})
    large._page_at = None
    large.seal_facts([1], check_finite=True)
    assert large._scratch is not None and large._scratch.nbytes == 160 * 32 << 10  # one 5 MiB block


@pytest.mark.parametrize("algorithm", [HashAlgorithm.XXH3_64, HashAlgorithm.XXH64])
@pytest.mark.parametrize("chunk", [KVPages.SCRATCH_BYTES, 1, 2 * 384])
@pytest.mark.parametrize("copy", [False, True])
def test_seal_host_pages_records_what_seal_facts_and_digest_do(
    algorithm: HashAlgorithm, chunk: int, copy: bool
) -> None:
    """One read of the pages being sealed (in place in the pool, or one copy of them) gives the
    flags, syndromes and digests that the separate calls read out of the pool, chunk after
    chunk; each chunk is handed to ``visit`` at its offset with its block ids, and with its copy
    where there is one (before the NaN/Inf test clears sign bits), else None."""
    buffer = (torch.randn(3, 12, 2, 4, 16) * 100).to(torch.bfloat16)
    layers = {f"l{i}": buffer[i] for i in range(3)}
    pages = KVPages(layers, algorithm=algorithm)
    pages.SCRATCH_BYTES = pages.CHUNK_BYTES = chunk * buffer.element_size()
    assert pages.seals_host_pages and pages.reads_in_place
    layers["l1"][5, 1, 3, 15] = float("nan")
    ids = [5, 7, 9, 3, 0]
    seen: list[tuple[int, int]] = []

    def visit(lo: int, part: np.ndarray, pages_copy: np.ndarray | None) -> None:
        k = len(part)
        assert part.tolist() == ids[lo : lo + k]
        if not copy:
            assert pages_copy is None
        else:
            assert pages_copy is not None and pages_copy.shape == (3, k, 128)
            for j, block in enumerate(part.tolist()):
                for layer in range(3):
                    want = layers[f"l{layer}"][block].view(torch.uint8).numpy().tobytes()
                    assert pages_copy[layer, j].tobytes() == want
        seen.append((lo, k))

    flags, syn, digests = pages.seal_host_pages(ids, check_finite=True, visit=visit, copy=copy)
    assert (pages._scratch is not None) == copy
    want_flags, want_syn = pages.seal_facts(ids, check_finite=True)
    assert (digests == pages.digest(ids)).all()
    assert (syn == want_syn).all() and flags.tolist() == want_flags.tolist() and flags[0, 1]
    assert [lo for lo, _ in seen] == list(itertools.accumulate([0, *[k for _, k in seen][:-1]]))
    assert sum(k for _, k in seen) == len(ids) and (len(seen) > 1) == (chunk < 5 * 384)
    assert [a.shape for a in pages.seal_host_pages([], check_finite=True)] == [
        (0, 3),
        (0, 3, pages.syndrome_words),
        (0, 3),
    ]
    assert not KVPages({"a": buffer[0].to(torch.float64)}).seals_host_pages
