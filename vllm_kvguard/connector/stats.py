"""The guard's metrics on vLLM's KV-connector stats path (engine core -> front end).

The scheduler side hands vLLM a :class:`KVGuardStats` delta each step; vLLM merges it
across engines and, in the front-end process, feeds it to :class:`KVGuardPromMetrics`,
which turns it into ``vllm:kvguard_*`` series on ``vllm serve``'s own ``/metrics``
(the series themselves are defined once, in :mod:`vllm_kvguard.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.metrics import Recorder, build_metrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class KVGuardStats(KVConnectorStats):
    """A :class:`GuardCounters` delta as vLLM's stats object."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = GuardCounters.from_dict(self.data)
        merged.absorb(other.data)
        return KVGuardStats(data=merged.take())

    def reduce(self) -> dict[str, int | float]:
        delta = GuardCounters.from_dict(self.data)
        out: dict[str, int | float] = {**delta.counts, **delta.gauges}
        for key, labels in [*delta.labelled.items(), *delta.labelled_gauges.items()]:
            for label, n in labels.items():
                out[f"{key}_{label}"] = n
        return out

    def is_empty(self) -> bool:
        return GuardCounters.empty_data(self.data)


class KVGuardPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvguard_*`` series on the front end's /metrics, with vLLM's labels."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[arg-type]
        metrics = build_metrics(self._counter_cls, self._gauge_cls, self._histogram_cls, labelnames)
        self._recorder = Recorder(metrics, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._recorder.observe(transfer_stats_data, engine_idx)
