"""Per-dtype tables shared by the host check and the KVG64 kernel (a leaf: imports only torch, numpy).

Factored out so that :mod:`.pages` and :mod:`.kernel` both use them without
importing each other.
"""

from __future__ import annotations

import torch


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


def nonfinite_rows(rows: torch.Tensor) -> torch.Tensor:
    """Per row of a contiguous 2-D float tensor: does it hold NaN or Inf?"""
    test = EXPONENT_TESTS.get(rows.dtype)
    if test is None or (rows.shape[1] * rows.element_size()) % 8:
        return ~torch.isfinite(rows).all(dim=1)
    mask, low, sign, _ = test
    words = torch.bitwise_and(rows.view(torch.int64), mask)
    return words.add_(low).bitwise_and_(sign).any(dim=1)
