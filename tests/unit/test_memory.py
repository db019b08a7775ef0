"""What the guard keeps per KV block, against the formula docs/performance.md writes down.

Scheduler side (the ledger): 74 bytes per block. Worker side, per rank: per block and layer two
digests (this seal and the previous one) and the syndrome words of a page of that size, plus a
sealed flag; with row digests, two 64-bit digests per slot (on a GPU in a device table, plus a
one-byte host marker per slot and generation). The tables are sized at start-up and never grow with
traffic (the per-request block-table mirror is counted separately).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.digest.device_rows import DeviceRowDigests
from vllm_kvguard.digest.row_access import AxisRows
from vllm_kvguard.digest.rows import RowDigests
from vllm_kvguard.digest.syndrome import width
from vllm_kvguard.digest.table import DigestTable

LEDGER_BYTES = 1 + 4 + 8 + 8 + 8 + 4 + 8 + 8 + 8 + 8 + 8 + 1  # docs/performance.md, "Memory"


def worker_bytes(
    layers: int, page_bytes_per_layer: int, block_size: int, rows: bool = True, device: bool = False
) -> int:
    row_bytes = (16 + (2 if device else 0)) * block_size if rows else 0
    return (16 + 8 * width(page_bytes_per_layer)) * layers + 1 + row_bytes


def test_tables_are_the_formula_per_block() -> None:
    n, layers, bs = 1000, 3, 16
    assert BlockLedger(n, bs).nbytes() == LEDGER_BYTES * n == 74 * n
    page = 2 * 8 * 128 * bs * 2  # one layer's page: K and V, 8 heads of 128, bf16
    table = DigestTable(n, layers, width(page))
    cache = torch.zeros((n, 2, bs, 1, 4))
    rows = RowDigests([cache], [AxisRows(cache, 1)], n, bs)
    assert table.nbytes() + rows.nbytes() == worker_bytes(layers, page, bs) * n
    on_device = DeviceRowDigests([cache], [AxisRows(cache, 1)], n, bs)
    assert table.nbytes() + on_device.nbytes() == worker_bytes(layers, page, bs, device=True) * n


def test_the_documented_llama_3_8b_figures_follow_the_formula() -> None:
    # 32 layers, 8 KV heads of 128, bf16, block 16: a 64 KiB page per layer, 2 MiB per block, on a
    # GPU (the row digests in a device table).
    layers, bs, page = 32, 16, 2 * 8 * 128 * 16 * 2
    blocks = 80 * 2**30 // (layers * page)
    per_block = LEDGER_BYTES + worker_bytes(layers, page, bs, device=True)
    assert (blocks, width(page), per_block) == (40960, 14, 4459)
    doc = (Path(__file__).parents[2] / "docs" / "performance.md").read_text()
    total_mib = per_block * blocks / 2**20
    assert f"{per_block:,} B per block" in doc and f"{total_mib:.1f} MiB" in doc
    assert np.isclose(per_block / (layers * page), 0.00213, atol=5e-6)
