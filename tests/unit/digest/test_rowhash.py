"""The host row digest's compiled loops (digest/rowhash.py): the same digests as the device
path's reference, whole rows or summed a layer at a time as vLLM's write op hands rows over."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_kvguard.digest import rowhash
from vllm_kvguard.digest.rows import row_digests_reference


def test_compiled_rows_match_the_reference_and_numpy() -> None:
    assert rowhash.backend() == "numba"
    rng = np.random.default_rng(3)
    for width in (8, 64, 8192):
        raw = rng.integers(0, 256, size=(11, width), dtype=np.uint8)
        raw[4] = 0
        slots = rng.integers(0, 16, size=11)
        want = row_digests_reference(raw, slots)
        assert np.array_equal(rowhash.digest_rows(raw, slots), want)
        words = raw.view(np.uint64)
        assert np.array_equal(rowhash._finish_numpy(rowhash._sums_numpy(words, slots)), want)
        assert (want != 0).all()
    # Keyed by slot: one row in two slots, two digests.
    one = np.ones((2, 16), dtype=np.uint8)
    a, b = rowhash.digest_rows(one, np.array([0, 1]))
    assert a != b


def test_summed_a_layer_at_a_time_in_any_order_is_the_whole_rows_digest() -> None:
    """What the write op's wrapper does: per layer, K and V as strided views of one QKV output
    (as vLLM hands them over), added to a per-row sum; the layers may come in any order."""
    from vllm_kvguard.digest import _rowkernels

    n, heads, head, layers = 6, 2, 8, 3
    flat = np.array([0, 17, 33, 47, 50, 63], dtype=np.int64)  # blocks x 16 + slots
    slots_seen = np.zeros(n, dtype=np.int64)  # add_layer's copy of the slot mapping
    spec = np.array([[1, 0, 0, 2]])  # probe: V words 0..1
    rows = np.zeros((n, layers, 2 * heads * head), dtype=np.int16)
    sums = np.zeros(n, dtype=np.uint64)
    probe = np.zeros((n, layers, 2), dtype=np.uint64)
    layer_words = 2 * heads * head * 2 // 8
    for i, layer in enumerate((2, 0, 1)):
        qkv = torch.randn(n, 3 * heads * head).to(torch.bfloat16).view(torch.int16).numpy()
        k, v = qkv[:, heads * head : 2 * heads * head], qkv[:, 2 * heads * head :]
        rows[:, layer] = np.concatenate([k, v], axis=1)
        j = layer * layer_words
        _rowkernels.add_layer(
            n,
            k.ctypes.data,
            qkv.strides[0],
            v.ctypes.data,
            qkv.strides[0],
            layer_words // 2,
            flat.ctypes.data,
            slots_seen.ctypes.data,
            i == 0,
            16,
            j,
            j + layer_words // 2,
            sums.ctypes.data,
            probe.ctypes.data + 8 * 2 * layer,
            layers * 2,
            spec,
        )
    raw = rows.reshape(n, -1).view(np.uint8)
    assert np.array_equal(slots_seen, flat)
    assert np.array_equal(rowhash.finish(sums), row_digests_reference(raw, flat % 16))
    assert np.array_equal(probe, rows.view(np.uint64).reshape(n, layers, -1)[:, :, 4:6])


def test_without_numba_numpy_computes_the_same_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(7, 96), dtype=np.uint8)
    slots = rng.integers(0, 16, size=7)
    compiled = rowhash.digest_rows(raw, slots)
    monkeypatch.setattr(rowhash, "_compiled", None)
    monkeypatch.setattr(rowhash, "_why_not", "ImportError: No module named 'numba'")
    assert rowhash.backend() == "numpy (ImportError: No module named 'numba')"
    assert np.array_equal(rowhash.digest_rows(raw, slots), compiled)
    sums = rowhash._sums_numpy(raw.view(np.uint64), slots)
    assert np.array_equal(rowhash.finish(sums), compiled)
