"""Prometheus metrics: one table of series, two ways out.

The scheduler half of the connector folds every guard event (its own and the
workers', which arrive in the worker metadata) into a :class:`GuardCounters`
delta. Once per step vLLM asks for it (``get_kv_connector_stats``) and carries it
through its KV-connector stats path to the front-end process, where
:class:`KVGuardPromMetrics` turns it into ``vllm:kvguard_*`` series on the
``/metrics`` endpoint that ``vllm serve`` already serves. For the ``LLM`` class,
which has no HTTP server, ``VLLM_KVGUARD_METRICS_PORT`` starts a standalone
exporter (:class:`StandaloneExporter`) in the engine process with the same series.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from vllm_kvguard.core.counters import STATE_TABLES, GuardCounters
from vllm_kvguard.core.faults import FaultKind
from vllm_kvguard.core.shapes import SHAPES

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)
# Relative L2 distances between two computations of one page (digest/sketch.py: the sketch's
# tolerance is 0.1).
DISTANCE_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


@dataclass(frozen=True)
class Series:
    key: str
    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    label: str | None = None
    # Label values created at zero up front: Prometheus' increase() needs a sample
    # before the first event, or a counter born at 1 never shows an increase.
    values: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS  # histograms


SERIES = (
    Series(
        "sealed", "vllm:kvguard_blocks_sealed", "counter", "KV blocks sealed (checksummed after the write)."
    ),
    Series(
        "verified",
        "vllm:kvguard_verifications",
        "counter",
        "KV blocks verified against their seal, by trigger (reuse: a prefix-cache hit; sampled, "
        "paranoid: pages running requests read; scrub: sealed pages walked in the background; "
        "external_load: pages another KV connector loaded, against the digests sealed here for "
        "the same inputs; finish: pages a finished request read, before its final output left).",
        "trigger",
        ("reuse", "sampled", "paranoid", "scrub", "external_load", "finish"),
    ),
    Series(
        "bytes_hashed",
        "vllm:kvguard_bytes_hashed",
        "counter",
        "Bytes of KV pages hashed, by op.",
        "op",
        ("seal", "verify"),
    ),
    Series(
        "corruptions",
        "vllm:kvguard_corruptions_detected",
        "counter",
        "Corrupted KV blocks detected, by kind (checksum_mismatch: changed after it was written; "
        "nonfinite: NaN/Inf in a page as it was sealed; identity_mismatch: a prefix-cache hit on a "
        "page sealed for other inputs; write_lost: slots still holding the previous owner's KV "
        "after a forward wrote them).",
        "kind",
        ("checksum_mismatch", "nonfinite", "identity_mismatch", "write_lost"),
    ),
    Series(
        "lifecycle_violations",
        "vllm:kvguard_lifecycle_violations",
        "counter",
        "KV blocks used in a way only a scheduler bug explains, by what happened.",
        "what",
        (
            "allocated_while_held",
            "quarantined_block_allocated",
            "quarantined_block_reused",
            "free_block_in_block_table",
        ),
    ),
    Series(
        "oldest_unverified_age",
        "vllm:kvguard_oldest_unverified_page_age_seconds",
        "gauge",
        "Seconds since the least recently checked sealed page was sealed or verified (scrubbing "
        "keeps it under VLLM_KVGUARD_SCRUB_INTERVAL).",
    ),
    Series("quarantined", "vllm:kvguard_blocks_quarantined", "gauge", "KV blocks held out of circulation."),
    Series(
        "state_entries",
        "vllm:kvguard_state_entries",
        "gauge",
        "Entries in the guard's tables that grow with requests and events, by table (requests, "
        "blocks_given, stop_messages, affected, recompute_counts, pending_failures: "
        "per live request, back to 0 when requests end; recent_steps: at most 3; faults: drills "
        "only). Sampled once a second.",
        "table",
        STATE_TABLES,
    ),
    Series(
        "state_bytes",
        "vllm:kvguard_state_bytes",
        "gauge",
        "Bytes of the guard's fixed tables, by side (scheduler: the block ledger's arrays; worker: "
        "the digest tables of one worker). Sized at start from the KV pool; sampled once a second.",
        "side",
        ("scheduler", "worker"),
    ),
    Series(
        "requests_affected",
        "vllm:kvguard_requests_affected",
        "counter",
        "Requests that held a bad KV page, once per request when it finishes, by outcome (healed: "
        "recomputed before any token from the page left the engine; failed: ended with an error; "
        "suspect: finished, flagged, its text may include tokens computed from the page).",
        "outcome",
        ("healed", "failed", "suspect"),
    ),
    Series(
        "shapes",
        "vllm:kvguard_corruption_shapes",
        "counter",
        "Corrupted KV blocks by the shape of the change (single_bit, single_word: one 64-bit word, "
        "located by the page's syndrome; multi_word; zeroed; nonfinite; copy_of_block: equals another "
        "sealed page; stale: equals this block's previous seal, or rows that still hold the previous "
        "owner's after a forward wrote them; unfilled_rows: rows of a page not yet sealed changed; "
        "undiagnosed: device path).",
        "shape",
        SHAPES,
    ),
    Series(
        "pages_loaded",
        "vllm:kvguard_pages_loaded",
        "counter",
        "KV pages another KV connector (LMCache, NIXL, offloading, ...) loaded into this engine, "
        "by how they were verified before attention read them: exact (equal to a computation of "
        "the same inputs sealed here or published by the producer), approx (equal to none kept, "
        "within the sketch tolerance of the first computation: vLLM is not batch-invariant), no "
        "(never sealed here, or evicted from VLLM_KVGUARD_LOAD_DIGESTS), bad (neither exact nor "
        "approx: a kv_block_corrupted, trigger external_load, never sealed). Loads verified or "
        "not are sealed as loaded and guarded from then on.",
        "verified",
        ("exact", "approx", "bad", "no"),
    ),
    Series(
        "load_audits",
        "vllm:kvguard_load_audits",
        "counter",
        "Loaded pages nothing here could check (never computed here, no digest published), audited: "
        "reported unreadable so vLLM computed them again, then compared with the recomputation "
        "(match: within the sketch tolerance; mismatch: the connector served wrong KV, a "
        "kv_load_audit_failed, and its unverifiable loads are refused from then on). Sampled by "
        "VLLM_KVGUARD_LOAD_AUDIT.",
        "result",
        ("match", "mismatch"),
    ),
    Series(
        "recompute_distance",
        "vllm:kvguard_recomputation_distance",
        "histogram",
        "Relative L2 distance between a page and the first computation of the same inputs, "
        "estimated from their sketches, observed when a page is sealed with bytes other than "
        "every earlier computation of its inputs (beside another KV connector: vLLM is not "
        "batch-invariant). The spread of clean recomputations on this hardware: the sketch "
        "tolerance (0.1) must stay well above it.",
        buckets=DISTANCE_BUCKETS,
    ),
    Series(
        "finish_held",
        "vllm:kvguard_requests_held",
        "counter",
        "Finished requests whose final output the finish check held for one engine step (sampled "
        "mode), until the pages they read since those were last verified were verified again.",
    ),
    Series(
        "finish_ahead",
        "vllm:kvguard_requests_checked_ahead",
        "counter",
        "Requests reaching their length (max_tokens) whose last step verified the pages they read "
        "since those were last verified, before its forward (sampled mode): checked as the finish "
        "check requires, with no hold.",
    ),
    Series(
        "repaired",
        "vllm:kvguard_blocks_repaired",
        "counter",
        "Corrupted KV blocks mended in place from their syndrome and verified against their seal "
        "(one-word changes, quarantine mode): nothing recomputed.",
    ),
    Series(
        "tokens_recomputed",
        "vllm:kvguard_tokens_recomputed",
        "counter",
        "Tokens recomputed after corruption.",
    ),
    Series(
        "verify_seconds",
        "vllm:kvguard_verification_latency_seconds",
        "histogram",
        "Time one worker spent verifying pages in one step: prefix-cache hits and scrubbed pages before "
        "the forward, and pages read on the attention path (sampled, paranoid), each observed once per "
        "step and kind.",
    ),
    Series(
        "faults_injected",
        "vllm:kvguard_faults_injected",
        "counter",
        "Fire-drill faults injected, by kind.",
        "kind",
        tuple(k.value for k in FaultKind),
    ),
    Series(
        "internal_errors", "vllm:kvguard_internal_errors", "counter", "Errors inside the guard (fail-open)."
    ),
    Series(
        "guard_seconds",
        "vllm:kvguard_overhead_seconds",
        "counter",
        "Time spent inside the guard's hooks, by side (scheduler; worker, summed over workers).",
        "side",
        ("scheduler", "worker"),
    ),
    Series(
        "step_seconds",
        "vllm:kvguard_worker_step_seconds",
        "counter",
        "Worker step time from the guard's first to last hook, summed over workers: the denominator "
        "of the guard's overhead share.",
    ),
)


def exported_names() -> set[str]:
    """Every sample name the guard exports (counters with ``_total``, histograms' parts)."""
    out: set[str] = set()
    for s in SERIES:
        if s.kind == "counter":
            out.add(s.name + "_total")
        elif s.kind == "histogram":
            out.update(s.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            out.add(s.name)
    return out


class Recorder:
    """Applies deltas to one set of prometheus_client metrics (per engine label values)."""

    def __init__(self, metrics: dict[str, Any], per_engine: dict[int, list[object]]) -> None:
        self.metrics = metrics
        self.per_engine = per_engine
        for values in per_engine.values():
            for s in SERIES:
                if s.kind == "histogram":
                    continue
                for label in s.values or ((None,) if s.label is None else ()):
                    metric = metrics[s.key]
                    metric.labels(*values) if label is None else metric.labels(*values, label)

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine.get(engine_idx, self.per_engine.get(0, []))
        delta = GuardCounters.from_dict(data)
        for key, n in delta.counts.items():
            if n and key in self.metrics:
                self.metrics[key].labels(*values).inc(n)
        for key, labels in delta.labelled.items():
            for label, n in labels.items():
                if n and key in self.metrics:
                    self.metrics[key].labels(*values, label).inc(n)
        for key, obs in delta.observations.items():
            for v in obs:
                self.metrics[key].labels(*values).observe(v)
        for key, v in delta.gauges.items():
            self.metrics[key].labels(*values).set(v)
        for key, labels in delta.labelled_gauges.items():
            for label, v in labels.items():
                self.metrics[key].labels(*values, label).set(v)


def build_metrics(
    counter_cls: Any, gauge_cls: Any, histogram_cls: Any, labelnames: list[str], **kw: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in SERIES:
        labels = [*labelnames, s.label] if s.label else list(labelnames)
        if s.kind == "counter":
            out[s.key] = counter_cls(name=s.name, documentation=s.doc, labelnames=labels, **kw)
        elif s.kind == "gauge":
            out[s.key] = gauge_cls(name=s.name, documentation=s.doc, labelnames=labels, **kw)
        else:
            out[s.key] = histogram_cls(
                name=s.name, documentation=s.doc, labelnames=labels, buckets=s.buckets, **kw
            )
    return out


class StandaloneExporter:
    """The same series on their own HTTP port, for the ``LLM`` class (no API server)."""

    def __init__(self, port: int, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        metrics = build_metrics(Counter, Gauge, Histogram, ["model_name", "engine"], registry=self.registry)
        self.recorder = Recorder(metrics, {0: [model_name, engine]})
        self.server, self.thread = start_http_server(port, registry=self.registry)

    def observe(self, data: dict[str, Any]) -> None:
        self.recorder.observe(data)

    def close(self) -> None:
        self.server.shutdown()
