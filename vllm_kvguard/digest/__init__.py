"""Page digests over KV tensors: hashing in place, digest tables, the KVG64 kernel.

Knows torch, xxhash and Triton, never vLLM: the connector hands it the KV tensors.
Modules: :mod:`.dtypes` (a leaf: per-dtype tables), :mod:`.kernel` (KVG64 and its numpy
reference), :mod:`.pages` (pages addressed by block and layer), :mod:`.table` (seals),
:mod:`.checks` (device checks read back after the step).
"""

from __future__ import annotations

from vllm_kvguard.digest.checks import PendingCheck
from vllm_kvguard.digest.pages import KVPages, page_runs
from vllm_kvguard.digest.table import DeviceDigestTable, DigestTable, PageMismatch

__all__ = ["DeviceDigestTable", "DigestTable", "KVPages", "PageMismatch", "PendingCheck", "page_runs"]
