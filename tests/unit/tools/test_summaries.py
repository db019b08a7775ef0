from vllm_kvguard.tools.drill import render, summarize


def _line(event, t, **kw):
    return {"event": event, "timestamp": f"2026-01-01T00:00:{t:06.3f}Z", "role": "scheduler", **kw}


def test_summary_accounts_for_every_fault() -> None:
    lines = [
        _line("kv_fault_injected", 1.0, fault_id=1, kind="bitflip"),
        _line("kv_fault_injected", 2.0, fault_id=2, kind="zero"),
        _line("kv_fault_injected", 3.0, fault_id=3, kind="zero"),
        _line("kv_fault_injected", 4.0, fault_id=4, kind="nan"),
        _line("kv_block_corrupted", 1.5, block_id=9),
        _line("kv_block_quarantined", 1.5, block_id=9, pinned=True),
        _line("kv_request_affected", 1.5, outcome="healed"),
        _line("kv_fault_outcome", 1.5, fault_id=1, outcome="detected"),
        _line("kv_fault_outcome", 2.5, fault_id=2, outcome="escaped"),
        _line("kv_fault_outcome", 3.5, fault_id=4, outcome="no_change"),
    ]
    outputs = [("a", False), (None, False), ("c", True)]
    report = summarize(lines, outputs, ["a", "b", "x"], mode="quarantine", spec="bitflip;zero;nan")
    assert report.by_kind["bitflip"].detected == 1 and report.by_kind["bitflip"].read == 1
    assert report.by_kind["zero"].escaped == 1 and report.by_kind["zero"].not_read == 1
    assert report.by_kind["nan"].no_change == 1
    assert report.total.injected == 4 and report.total.read == 2
    assert report.detection_ms == [500.0]
    assert report.quarantined == 1 and report.requests_healed == 1
    # "c" differs from the clean "x" but was flagged; the failed one has no text: nothing silent.
    assert report.outputs_identical == 1 and report.silently_wrong == 0
    assert not report.ok
    assert "FAIL" in render(report)


def test_write_time_faults_have_their_own_row() -> None:
    lines = [
        _line("kv_fault_injected", 1.0, fault_id=1, kind="nan", at="rest"),
        _line("kv_fault_injected", 2.0, fault_id=2, kind="nan", at="write"),
        _line("kv_block_nonfinite", 2.0, block_id=4),
        _line("kv_fault_outcome", 2.0, fault_id=2, outcome="detected"),
    ]
    report = summarize(lines, [("a", False)], ["a"], mode="quarantine", spec="nan;nan:at=write")
    assert report.by_kind["nan@write"].detected == 1 and report.by_kind["nan"].not_read == 1
    assert report.nonfinite_blocks == 1 and report.ok
    assert "nan@write" in render(report) and "non-finite pages at write     1" in render(report)


def test_clean_summary_passes() -> None:
    report = summarize([], [("a", False)], ["a"], mode="log", spec="zero")
    assert report.ok and report.by_kind["zero"].injected == 0
    assert "PASS" in render(report)


def test_bench_summary_medians_and_ratios() -> None:
    from vllm_kvguard.tools.bench import render, summarize

    def run(tps, ttft, itl, share):
        return {
            "tokens_per_s": tps,
            "output_tokens_per_s": tps / 2,
            "ttft_s": ttft,
            "itl_s": itl,
            "guard_share": share,
        }

    report = summarize(
        {
            "off": [run(100, 0.2, 0.01, None), run(110, 0.1, 0.02, None), run(90, 0.3, 0.03, None)],
            "default": [run(99, 0.2, 0.01, 0.005), run(101, 0.2, 0.02, 0.007), run(200, 0.2, 0.02, 0.006)],
        },
        model="m",
        repeats=3,
    )
    assert report["medians"]["off"]["tokens_per_s"] == 100
    assert report["ratio_to_off"]["default"]["tokens_per_s"] == 1.01
    assert report["medians"]["default"]["guard_share"] == 0.006
    assert report["medians"]["off"]["guard_share"] is None
    # Spread: (max - min) / median of tokens/s; guard-off's is the machine's noise.
    assert report["tokens_per_s_spread"] == {"off": 0.2, "default": 101 / 101}
    text = render(report)
    assert "default" in text and "1.010" in text and "0.60 %" in text
    assert "   20 %" in text and "  100 %" in text
    single = summarize({"off": [run(100, 0.2, 0.01, None)]}, model="m", repeats=1)
    assert single["tokens_per_s_spread"] == {"off": None}


def test_an_output_that_differs_without_failing_or_flag_fails_the_drill() -> None:
    lines = [
        _line("kv_fault_injected", 1.0, fault_id=1, kind="bitflip"),
        _line("kv_fault_outcome", 1.5, fault_id=1, outcome="detected"),
    ]
    report = summarize(lines, [("a", False), ("wrong", False)], ["a", "b"], mode="quarantine", spec="bitflip")
    assert report.total.escaped == 0 and report.silently_wrong == 1
    assert not report.ok and "silently wrong outputs        1" in render(report)


def test_diagnosed_counts_faults_whose_shape_matches_the_injected_kind() -> None:
    lines = [
        _line("kv_fault_injected", 1.0, fault_id=1, kind="bitflip", block_id=9),
        _line("kv_fault_injected", 2.0, fault_id=2, kind="overwrite", block_id=4),
        _line("kv_block_corrupted", 1.5, block_id=9, shape="single_bit", action="repaired"),
        _line("kv_block_corrupted", 2.5, block_id=4, shape="multi_word", action="quarantined_and_recomputed"),
        _line("kv_fault_outcome", 1.5, fault_id=1, outcome="detected"),
        _line("kv_fault_outcome", 2.5, fault_id=2, outcome="detected"),
    ]
    report = summarize(lines, [("a", False)], ["a"], mode="quarantine", spec="bitflip;overwrite")
    assert report.by_kind["bitflip"].diagnosed == 1 and report.by_kind["overwrite"].diagnosed == 0
    assert report.repaired == 1 and report.shapes == {"single_bit": 1, "multi_word": 1}
    text = render(report)
    assert "multi_word 1, single_bit 1" in text
    # Every corrupted block is in a named bucket, and the buckets add up to the total.
    assert "corrupted blocks detected     2: quarantined and recomputed 1, repaired 1" in text
    assert sum(report.actions.values()) == report.corrupted_blocks


def test_a_block_recomputed_without_quarantine_has_its_own_bucket() -> None:
    """The drill once said "detected 7" beside "quarantined 2" and "repaired 4": the page found
    bad while still being written (recomputed, not quarantined) was in no bucket."""
    lines = [
        _line("kv_block_corrupted", 1.0, block_id=1, shape="single_bit", action="repaired"),
        _line("kv_block_corrupted", 1.1, block_id=2, shape="zeroed", action="quarantined_and_recomputed"),
        _line("kv_block_quarantined", 1.1, block_id=2, pinned=True),
        _line("kv_block_corrupted", 1.2, block_id=3, shape="unfilled_rows", action="recomputed"),
    ]
    text = render(summarize(lines, [("a", False)], ["a"], mode="quarantine", spec="zero"))
    assert "corrupted blocks detected     3: quarantined and recomputed 1, recomputed 1, repaired 1" in text
    assert "blocks held in quarantine     1" in text


def test_progress_line_names_the_faults_in_a_few_words_not_the_whole_spec() -> None:
    from vllm_kvguard.tools.drill import DEFAULT_SPEC, spec_summary

    short = spec_summary(DEFAULT_SPEC)
    assert short == "bitflip x3, overwrite, zero, nan, nan@write, partial x2, lost_write, identity"
    assert "seed" not in short and len(short) < len(DEFAULT_SPEC) / 2
    assert spec_summary("zero:rate=0.05,after=10") == "zero at rate 0.05"


def test_load_faults_read_the_same_in_the_table_the_shapes_and_the_report() -> None:
    """A drill with load faults once said `diagnosed 2` beside `shapes diagnosed -` while
    `kvguard report` said `undiagnosed: 2`: a bad load is found as such (its expected finding),
    and its shape is counted as the log gives it, as the report counts it."""
    from vllm_kvguard.tools.report import summarize as report_summary

    lines = [
        _line("kv_fault_injected", 1.0, fault_id=1, kind="load", at="load", block_id=7),
        _line("kv_fault_injected", 2.0, fault_id=2, kind="load", at="load", block_id=8),
        _line(
            "kv_block_corrupted",
            1.5,
            block_id=7,
            shape="undiagnosed",
            trigger="external_load",
            action="recomputed",
        ),
        _line(
            "kv_block_corrupted",
            2.5,
            block_id=8,
            shape="undiagnosed",
            trigger="external_load",
            action="recomputed",
        ),
        _line("kv_fault_outcome", 1.5, fault_id=1, outcome="detected"),
        _line("kv_fault_outcome", 2.5, fault_id=2, outcome="detected"),
    ]
    report = summarize(lines, [("a", False)], ["a"], mode="quarantine", spec="load:count=2")
    row = next(iter(report.by_kind.values()))
    assert row.detected == 2 and row.diagnosed == 2 and report.bad_loads == 2
    text = render(report)
    assert "bad loads (found at load)     2" in text
    assert "shapes diagnosed              undiagnosed 2" in text
    assert report_summary(lines)["by"]["shape"] == {"undiagnosed": 2}


def test_a_failed_load_audit_is_a_finding_the_report_diagnoses_as_a_connector() -> None:
    """kv_load_audit_failed (a load nobody here computed differed from its recomputation) counts
    among the report's findings (so --fail-on-corruption fails on it) and reads as a connector."""
    from vllm_kvguard.tools.report import findings
    from vllm_kvguard.tools.report import summarize as report_summary

    lines = [
        _line("kv_load_audit_failed", 1.0, block_id=3, connector="LMCacheMPConnector", sketch_distance=0.9),
        _line("kv_request_affected", 2.0, request_id="r", outcome="healed"),
    ]
    summary = report_summary(lines)
    assert summary["other_findings"]["load audits failed"] == 1 and findings(summary) == 1
    assert summary["diagnosis"]["verdict"] == "software: a KV connector loaded wrong KV"
    assert "LMCacheMPConnector 1" in summary["diagnosis"]["why"]
    assert findings(report_summary(lines[1:])) == 0
