"""Page sketches (digest/sketch.py): a clean recomputation within the tolerance, each bug class
far outside it, on pages shaped like vLLM's (blocks first)."""

from __future__ import annotations

import pytest
import torch

from vllm_kvguard.digest.sketch import (
    DEEP_TOLERANCE,
    PROJECTIONS,
    TOLERANCE,
    WIDTH,
    PageSketches,
    distance,
    matches,
    sketched_layers,
)

# 6 blocks of [2 (K, V), 16 slots, 4 heads, 32 dims] in bf16, as a pool's layer.
SHAPE = (6, 2, 16, 4, 32)


def _pool(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(torch.bfloat16)


def _distance_after(change: object) -> float:
    pool = _pool()
    sketches = PageSketches([pool])
    before = sketches.compute([2])
    change(pool)  # type: ignore[operator]
    return float(distance(sketches.compute([2]), before)[0, 0])


def test_a_sketch_covers_the_first_and_last_layer_and_is_the_same_in_every_engine() -> None:
    assert sketched_layers(1) == [0] and sketched_layers(2) == [0, 1] and sketched_layers(32) == [0, 31]
    pools = [_pool(seed) for seed in range(3)]
    a, b = PageSketches(pools), PageSketches([p.clone() for p in pools])
    got = a.compute([0, 3])
    assert got.shape == (2, 2, WIDTH) and got.dtype == torch.float32 and a.nbytes() == 2 * 4 * WIDTH
    assert torch.equal(got, b.compute([0, 3]))  # fixed signs: comparable across engines
    norms = [p[[0, 3]].float().reshape(2, -1).norm(dim=1) for p in (pools[0], pools[2])]
    assert torch.allclose(got[:, :, PROJECTIONS], torch.stack(norms, dim=1))


def test_the_last_layer_is_held_to_the_deep_tolerance() -> None:
    kept = torch.zeros(1, 2, WIDTH)
    kept[..., PROJECTIONS] = 1.0
    loaded = kept.clone()
    loaded[..., PROJECTIONS] = 0.7  # 0.3 away in both layers (norms alone)
    assert matches(loaded, kept).tolist() == [[False, True]]
    assert TOLERANCE < 0.3 < DEEP_TOLERANCE


def test_a_recomputation_with_rounding_differences_is_within_the_tolerance() -> None:
    """Each value off by up to 1 % (far more than bf16 batch variance moves KV): still a match."""
    g = torch.Generator().manual_seed(5)

    def jitter(pool: torch.Tensor) -> None:
        noise = 1 + 0.02 * (torch.rand(pool[2].shape, generator=g) - 0.5)
        pool[2] = (pool[2].float() * noise).to(pool.dtype)

    d = _distance_after(jitter)
    assert 0 < d < TOLERANCE / 5


def _reverse(pool: torch.Tensor) -> None:
    pool[2] = pool[2].flip(-1)


def _swap_heads(pool: torch.Tensor) -> None:
    pool[2, :, :, [0, 1]] = pool[2, :, :, [1, 0]]


def _block_off(pool: torch.Tensor) -> None:
    pool[2] = pool[1]


def _zero(pool: torch.Tensor) -> None:
    pool[2] = 0


def _scale_twice(pool: torch.Tensor) -> None:
    pool[2] = pool[2] * 1.5


def _nan(pool: torch.Tensor) -> None:
    pool[2, 0, 3, 1, 7] = float("nan")


@pytest.mark.parametrize(
    "change", [_reverse, _swap_heads, _block_off, _zero, _scale_twice], ids=lambda f: f.__name__[1:]
)
def test_each_bug_class_lands_far_outside_the_tolerance(change: object) -> None:
    assert _distance_after(change) > 2 * TOLERANCE


def test_other_weights_give_a_page_far_outside_the_tolerance() -> None:
    ours, theirs = PageSketches([_pool(0)]), PageSketches([_pool(1)])
    assert float(distance(theirs.compute([2]), ours.compute([2]))[0, 0]) > 2 * TOLERANCE


def test_nan_never_matches() -> None:
    pool = _pool()
    sketches = PageSketches([pool])
    before = sketches.compute([2])
    _nan(pool)
    assert not bool(matches(sketches.compute([2]), before)[0, 0])
    assert bool(matches(before, before)[0, 0])
