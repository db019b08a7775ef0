"""Page sketches: what a page holds, up to batch-variant numerics.

vLLM is not batch-invariant: the same tokens computed in another batch give KV whose values
differ by a few parts in a thousand (rounding in other reduction orders), so a page's exact
digest matches only the computation it was taken from. A connector's copy of a page can be one
whose exact digest is no longer kept (an identity computed more often than the digest sets
kept for it). Its sketch, kept beside the digests, still tells a clean copy from a wrong one.

A page's sketch, in its first and last layer (:func:`sketched_layers`): ``PROJECTIONS`` fixed
random projections of the page's values (all of them, K and V, every head and slot, in the page's
logical order, accumulated in float32), and the page's L2 norm. Projection ``r`` sums the values
at positions ``i = r (mod PROJECTIONS)``, each times a fixed random sign (times
``sqrt(PROJECTIONS)``): for two pages ``x`` and ``y`` of one layout, each projection of ``x - y`` is
a random-signed sum of many terms with mean square about ``|x - y|^2``, so the root mean square of
the sketches' difference estimates ``|x - y|``; :func:`distance`
divides it by the larger norm: the relative L2 distance between the two pages, within about 40 %
(16 projections: a chi distribution with 16 degrees of freedom, 1st to 99th percentile), and
never below the norms' own relative difference (exact: a zeroed or rescaled page is told by it).

Tolerances (docs/design/loaded.md, "Sketches", states the measured margin and how it was
measured): the first layer's KV is computed from the tokens alone, so batch variance leaves it
almost where it was, and every bug class a connector or transfer has (last axis reversed, two
heads swapped, a page one block off, zeroed, rescaled, computed by other weights) moves the page
in every layer by a sizeable fraction of its norm: :data:`TOLERANCE` there. The last layer
carries the differences of the layers before it, amplified (far more in random-weight models than
in trained ones): :data:`DEEP_TOLERANCE`, which still tells a layer that holds another page (a
transfer cut short before its last layers), zeros or garbage. Layers in between are not
sketched: a page whose exact digest is not kept is verified that far (``verified="approx"``). A
page with NaN or Inf in a sketched layer never matches.
What a sketch cannot see: a change far below the tolerance (one flipped low mantissa bit, a
few values off by little): a page verified by its sketch alone is verified only that far, and
counted apart (``verified="approx"``).

Sketches are computed where the pages live (torch on the pool's device, no page copied to the
host): a gather, a signed multiply and two reductions per sketched layer, at seal time (beside
another connector only) and for loads that match no digest set kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

PROJECTIONS = 16
# Width of one layer's sketch: the projections, then the page's norm.
WIDTH = PROJECTIONS + 1
# Relative L2 distance above which a page is not the page its sketch was taken from: first layer,
# then the others (see the module docstring and docs/design/loaded.md for the calibration).
TOLERANCE = 0.1
DEEP_TOLERANCE = 0.5
_SEED = 0x4B5647  # "KVG": the same weights in every engine, so that published sketches compare


def sketched_layers(num_layers: int) -> list[int]:
    """The layers a page's sketch covers: the first and the last."""
    return sorted({0, num_layers - 1})


class PageSketches:
    """Sketches of pages of the guarded KV tensors (``tensors[layer]``: blocks first), in
    :func:`sketched_layers`."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.layers = sketched_layers(len(self.tensors))
        self._signs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def nbytes(self) -> int:
        """Bytes of one page's sketch."""
        return 4 * WIDTH * len(self.layers)

    def signs(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The fixed signs (times sqrt(PROJECTIONS)) for pages of ``numel`` values, as
        (numel // PROJECTIONS, PROJECTIONS): position i's in row i // P, column i % P."""
        key = (numel, dtype, device)
        signs = self._signs.get(key)
        if signs is None:
            generator = torch.Generator().manual_seed(_SEED + numel)
            bits = torch.randint(0, 2, (numel // PROJECTIONS, PROJECTIONS), generator=generator)
            signs = ((2 * bits - 1) * PROJECTIONS**0.5).to(dtype=dtype, device=device)
            self._signs[key] = signs
        return signs

    def compute(self, blocks: Sequence[int] | np.ndarray) -> torch.Tensor:
        """The sketches of ``blocks``: float32 (pages, sketched layers, WIDTH), on the pool's
        device. (Values past the last whole row of PROJECTIONS, if any, count in the norm only.)"""
        device = self.tensors[0].device
        index = torch.as_tensor(np.asarray(blocks, dtype=np.int64), device=device)
        out = []
        for layer in self.layers:
            pages = self.tensors[layer].index_select(0, index).reshape(len(index), -1)
            if not pages.is_floating_point() or pages.element_size() < 2:
                pages = pages.float()
            rows = pages.shape[1] // PROJECTIONS
            signs = self.signs(pages.shape[1], pages.dtype, device)
            signed = pages[:, : rows * PROJECTIONS].reshape(len(index), rows, PROJECTIONS) * signs
            projections = signed.sum(dim=1, dtype=torch.float32)
            norm = torch.linalg.vector_norm(pages, dim=1, keepdim=True, dtype=torch.float32)
            out.append(torch.cat([projections, norm], dim=1))
        return torch.stack(out, dim=1)


def distance(loaded: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Relative L2 distance between pages and the pages their sketches ``kept`` were taken from,
    estimated from their sketches (any shape ending in WIDTH): NaN where either holds NaN/Inf."""
    difference = loaded[..., :PROJECTIONS] - kept[..., :PROJECTIONS]
    estimate = difference.pow(2).mean(dim=-1).sqrt()
    norms = loaded[..., PROJECTIONS], kept[..., PROJECTIONS]
    scale = torch.maximum(*norms).clamp_min(1e-30)
    # |x - y| >= | |x| - |y| |: exact, where the estimate is not.
    return torch.maximum(estimate, (norms[0] - norms[1]).abs()) / scale


def tolerances(sketched: int, device: torch.device | None = None) -> torch.Tensor:
    """Each sketched layer's tolerance (:data:`TOLERANCE` for the first, the deep one after)."""
    out = torch.full((sketched,), DEEP_TOLERANCE, dtype=torch.float32, device=device)
    out[0] = TOLERANCE
    return out


def matches(loaded: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Whether each page is within each sketched layer's tolerance of the page its kept sketch
    was taken from (``(..., sketched layers, WIDTH)`` sketches, per layer; False where either
    holds NaN or Inf)."""
    return distance(loaded, kept) <= tolerances(kept.shape[-2], kept.device)
