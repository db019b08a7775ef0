"""The guard's metric deltas as plain data: what every layer counts, none of how it is exported.

Both connector roles fold their events into a :class:`GuardCounters`; the worker's
travel pickled in its step metadata, the scheduler merges them and hands the delta to
vLLM's KV-connector stats path (and to :mod:`vllm_kvguard.metrics`, which turns it
into Prometheus series).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

# The guard's tables that grow with requests and events (``vllm:kvguard_state_entries``):
# the soak watches them return to 0 when traffic stops.
STATE_TABLES = (
    "requests",
    "blocks_given",
    "tables",
    "stop_messages",
    "affected",
    "recompute_counts",
    "pending_failures",
    "recent_steps",
    "faults",
    "identities",
)


@dataclass
class GuardCounters:
    """A delta of the guard's series since the last time it was taken.

    Plain dicts only: it travels pickled from workers to the engine process.
    """

    counts: dict[str, float] = field(default_factory=dict)
    labelled: dict[str, dict[str, float]] = field(default_factory=dict)
    observations: dict[str, list[float]] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    labelled_gauges: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, key: str, n: float = 1, label: str | None = None) -> None:
        if label is None:
            self.counts[key] = self.counts.get(key, 0) + n
        else:
            labels = self.labelled.setdefault(key, {})
            labels[label] = labels.get(label, 0) + n

    def observe(self, key: str, value: float) -> None:
        self.observations.setdefault(key, []).append(value)

    def set(self, key: str, value: float, label: str | None = None) -> None:
        if label is None:
            self.gauges[key] = value
        else:
            self.labelled_gauges.setdefault(key, {})[label] = value

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(vars(self))

    def take(self) -> dict[str, Any]:
        """:meth:`to_dict` and start again from empty, without copying: the dicts are handed
        over (this runs every engine step on both sides)."""
        out = dict(vars(self))
        for key in out:  # every field is a dict
            setattr(self, key, {})
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GuardCounters:
        out = cls()
        out.absorb(data)
        return out

    def absorb(self, data: dict[str, Any]) -> None:
        """Add a delta (as :meth:`to_dict` wrote it) to this one."""
        counts = self.counts
        for k, v in data.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + v
        for k, labels in data.get("labelled", {}).items():
            mine = self.labelled.setdefault(k, {})
            for label, v in labels.items():
                mine[label] = mine.get(label, 0) + v
        for k, values in data.get("observations", {}).items():
            self.observations.setdefault(k, []).extend(values)
        self.gauges.update(data.get("gauges", {}))
        for k, labels in data.get("labelled_gauges", {}).items():
            self.labelled_gauges.setdefault(k, {}).update(labels)

    def empty(self) -> bool:
        return GuardCounters.empty_data(vars(self))

    @staticmethod
    def empty_data(data: dict[str, Any]) -> bool:
        """:meth:`empty` of a delta as :meth:`to_dict` wrote it, without rebuilding it."""
        return not (
            any(data.get("counts", {}).values())
            or any(any(v.values()) for v in data.get("labelled", {}).values())
            or any(data.get("observations", {}).values())
            or data.get("gauges")
            or data.get("labelled_gauges")
        )
