"""The vLLM adapter: the only package (with :mod:`vllm_kvguard.plugin` and
:mod:`vllm_kvguard.testing`) that imports vLLM.

Split by role like vLLM's NIXL connector: :mod:`.facade` (the connector class vLLM
loads, delegating only), :mod:`.scheduler` and :mod:`.worker` (one per role),
:mod:`.metadata` (what crosses between them each step), :mod:`.stats` (metrics on
vLLM's stats path) and :mod:`.patches` (every patch of vLLM internals).
``kv_connector_module_path="vllm_kvguard.connector"`` keeps working.
"""

from vllm_kvguard.connector.facade import KVGuardConnector, KVGuardHMAConnector, find_guard
from vllm_kvguard.connector.metadata import KVGuardMetadata, KVGuardWorkerMetadata

__all__ = [
    "KVGuardConnector",
    "KVGuardHMAConnector",
    "KVGuardMetadata",
    "KVGuardWorkerMetadata",
    "find_guard",
]
