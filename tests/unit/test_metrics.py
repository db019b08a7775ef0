from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_kvguard.core.counters import GuardCounters
from vllm_kvguard.metrics import SERIES, Recorder, build_metrics, exported_names


def test_counters_round_trip_and_merge() -> None:
    a = GuardCounters()
    a.add("sealed", 3)
    a.add("corruptions", label="checksum_mismatch")
    a.observe("verify_seconds", 0.01)
    a.set("quarantined", 2)
    b = GuardCounters.from_dict(a.to_dict())
    b.absorb(a.to_dict())
    assert b.counts == {"sealed": 6}
    assert b.labelled == {"corruptions": {"checksum_mismatch": 2}}
    assert b.observations == {"verify_seconds": [0.01, 0.01]}
    assert b.gauges == {"quarantined": 2}
    assert GuardCounters().empty() and not a.empty()


def test_labelled_gauges_travel_and_set_per_label() -> None:
    a = GuardCounters()
    a.set("state_entries", 3, label="requests")
    a.set("state_bytes", 1024, label="scheduler")
    assert not a.empty()
    b = GuardCounters.from_dict(a.to_dict())
    b.absorb({"labelled_gauges": {"state_entries": {"requests": 0, "affected": 1}}})
    assert b.labelled_gauges == {
        "state_entries": {"requests": 0, "affected": 1},  # a gauge: the latest value wins
        "state_bytes": {"scheduler": 1024},
    }
    registry = CollectorRegistry()
    metrics = build_metrics(Counter, Gauge, Histogram, ["model_name", "engine"], registry=registry)
    Recorder(metrics, {0: ["m", "0"]}).observe(b.to_dict())
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:kvguard_state_entries", {**labels, "table": "affected"}) == 1
    assert registry.get_sample_value("vllm:kvguard_state_entries", {**labels, "table": "requests"}) == 0
    assert registry.get_sample_value("vllm:kvguard_state_bytes", {**labels, "side": "scheduler"}) == 1024


def test_recorder_creates_zero_series_and_applies_deltas() -> None:
    registry = CollectorRegistry()
    metrics = build_metrics(Counter, Gauge, Histogram, ["model_name", "engine"], registry=registry)
    recorder = Recorder(metrics, {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0"}
    assert (
        registry.get_sample_value(
            "vllm:kvguard_corruptions_detected_total", {**labels, "kind": "checksum_mismatch"}
        )
        == 0
    )
    delta = GuardCounters()
    delta.add("corruptions", label="checksum_mismatch")
    delta.add("tokens_recomputed", 64)
    delta.set("quarantined", 1)
    delta.observe("verify_seconds", 0.002)
    recorder.observe(delta.to_dict())
    recorder.observe(delta.to_dict())
    assert (
        registry.get_sample_value(
            "vllm:kvguard_corruptions_detected_total", {**labels, "kind": "checksum_mismatch"}
        )
        == 2
    )
    assert registry.get_sample_value("vllm:kvguard_tokens_recomputed_total", labels) == 128
    assert registry.get_sample_value("vllm:kvguard_blocks_quarantined", labels) == 1
    assert registry.get_sample_value("vllm:kvguard_verification_latency_seconds_count", labels) == 2


def test_every_series_is_named_in_vllms_convention() -> None:
    for s in SERIES:
        assert s.name.startswith("vllm:kvguard_") and not s.name.endswith("_total")
    assert "vllm:kvguard_blocks_sealed_total" in exported_names()
