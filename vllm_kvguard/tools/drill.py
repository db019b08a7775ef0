"""``kvguard drill``: prove on a real engine that corrupted KV pages are caught.

In the spirit of ZFS's ``zinject``: the drill runs a prefix-sharing workload
twice through vLLM in child processes, once plain (the reference) and once with
the guard on and ``VLLM_KVGUARD_INJECT`` set, then reads the guard's own
structured log to account for every injected fault: read or not, detected or
escaped, and how long detection took. It exits non-zero if a fault that was read
escaped detection.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from vllm_kvguard.config import Mode
from vllm_kvguard.core.faults import FaultKind, parse_fault_spec
from vllm_kvguard.core.shapes import EXPECTED
from vllm_kvguard.tools.childrun import Progress, WorkFolder, check_model, engine_env, prepare, run_child
from vllm_kvguard.tools.workload import Workload

DEFAULT_SPEC = (
    "bitflip:count=3,seed=11;overwrite:count=1,seed=12;zero:count=1,seed=13;nan:count=1,seed=14;"
    "nan:at=write,count=1,seed=15;partial:count=2,seed=16;lost_write:count=1,seed=17;"
    "identity:count=1,seed=18"
)
# What each kind should be diagnosed as: the shape of the change, or the finding itself.
EXPECTED_FINDING = {
    **{kind: str(shape) for kind, shape in EXPECTED.items()},
    "identity": "identity_mismatch",
    "load": "external_load",
}
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "block_size": 32,
    "max_model_len": 1024,
    "max_num_seqs": 8,
    # A small pool, so that blocks change hands while the drill runs: a lost_write fault needs
    # a page whose previous owner computed something else.
    "num_gpu_blocks_override": 96,
}


@dataclass
class KindRow:
    injected: int = 0
    read: int = 0
    detected: int = 0
    escaped: int = 0
    not_read: int = 0
    no_change: int = 0
    # Detected faults whose diagnosed shape (kv_block_corrupted's ``shape``) is the one the
    # injected kind makes (core.shapes.EXPECTED): a memory bit flip is single_bit, ...
    diagnosed: int = 0


@dataclass
class DrillReport:
    mode: str
    spec: str
    requests: int
    by_kind: dict[str, KindRow] = field(default_factory=dict)
    quarantined: int = 0
    repaired: int = 0
    # What was done with each corrupted block (kv_block_corrupted's ``action``): the buckets that
    # add up to ``corrupted_blocks``.
    actions: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, int] = field(default_factory=dict)
    # Per fault: id, kind, block, outcome, and the shape diagnosed (None: not diagnosed).
    faults: list[dict[str, Any]] = field(default_factory=list)
    corrupted_blocks: int = 0
    nonfinite_blocks: int = 0
    identity_mismatches: int = 0
    writes_lost: int = 0
    # Corrupted blocks found when another connector loaded them (trigger external_load).
    bad_loads: int = 0
    requests_healed: int = 0
    requests_suspect: int = 0
    requests_failed: int = 0
    outputs_identical: int = 0
    # Outputs that differ from the clean run although the request neither failed nor was
    # flagged: the one thing the guard must never let happen.
    silently_wrong: int = 0
    detection_ms: list[float] = field(default_factory=list)
    internal_errors: int = 0

    @property
    def total(self) -> KindRow:
        total = KindRow()
        for row in self.by_kind.values():
            for name in asdict(total):
                setattr(total, name, getattr(total, name) + getattr(row, name))
        return total

    @property
    def ok(self) -> bool:
        return self.total.escaped == 0 and self.internal_errors == 0 and self.silently_wrong == 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["total"] = asdict(self.total)
        out["ok"] = self.ok
        out["detection_ms_median"] = statistics.median(self.detection_ms) if self.detection_ms else None
        out["detection_ms_max"] = max(self.detection_ms) if self.detection_ms else None
        return out


def loading_args(store: Path, loads: bool) -> dict[str, Any]:
    """Engine arguments for a drill with ``load`` faults: vLLM's ExampleConnector beside the
    guard (it saves each prompt's KV to ``store`` and loads it back), prefix caching off so that
    every repeated prefix is loaded rather than hit in the local cache. Empty otherwise."""
    if not loads:
        return {}
    return {
        "enable_prefix_caching": False,
        "kv_transfer_config": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
    }


def spec_summary(spec: str) -> str:
    """A fault spec in a few words for the progress line (the whole spec is in the report's
    JSON and the guard's log): ``bitflip x3, zero, partial at a rate`` ..."""
    parts = []
    for fault in parse_fault_spec(spec):
        name = row_key(str(fault.kind), str(fault.at))
        if fault.rate is not None:
            parts.append(f"{name} at rate {fault.rate:g}")
        else:
            count = fault.count or 1
            parts.append(name if count == 1 else f"{name} x{count}")
    return ", ".join(parts)


def row_key(kind: str, at: str) -> str:
    """The table's row for a fault: its kind, with ``@write`` for a fault at write time."""
    return f"{kind}@{at}" if at == "write" else kind


def _ts(line: dict[str, Any]) -> float:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def summarize(
    log_lines: list[dict[str, Any]],
    outputs: list[tuple[str | None, bool]],
    reference: list[str],
    *,
    mode: str,
    spec: str,
) -> DrillReport:
    """Account for every fault from the guard's log lines (pure: no engine here)."""
    report = DrillReport(mode=mode, spec=spec, requests=len(reference))
    for fault in parse_fault_spec(spec):
        report.by_kind.setdefault(row_key(str(fault.kind), str(fault.at)), KindRow())
    kinds: dict[int, str] = {}
    injected_at: dict[int, float] = {}
    outcome: dict[int, tuple[str, float]] = {}
    affected: Counter[str] = Counter()
    blocks: dict[int, int] = {}
    # Each block's diagnosed shapes, in log order (a block may go bad more than once).
    shapes_of: dict[int, list[tuple[float, str]]] = {}
    for line in log_lines:
        event = line.get("event")
        if event == "kv_fault_injected":
            kinds[line["fault_id"]] = row_key(line["kind"], line.get("at", "rest"))
            injected_at[line["fault_id"]] = _ts(line)
            blocks[line["fault_id"]] = line.get("block_id", -1)
        elif event == "kv_fault_outcome":
            outcome.setdefault(line["fault_id"], (line["outcome"], _ts(line)))
        elif event == "kv_block_corrupted" and line.get("role") == "scheduler":
            report.corrupted_blocks += 1
            shape = line.get("shape", "undiagnosed")
            if line.get("trigger") == "external_load":
                # A bad load is found as such (its expected finding); its shape is counted as the
                # log gives it (a loaded page keeps no syndrome: often undiagnosed), as report does.
                report.shapes[shape] = report.shapes.get(shape, 0) + 1
                report.bad_loads += 1
                shapes_of.setdefault(line.get("block_id", -1), []).append((_ts(line), "external_load"))
            elif shape != "undiagnosed":  # the device path's shape comes in kv_block_diagnosed
                report.shapes[shape] = report.shapes.get(shape, 0) + 1
                shapes_of.setdefault(line.get("block_id", -1), []).append((_ts(line), shape))
            action = str(line.get("action", "not recorded"))
            report.actions[action] = report.actions.get(action, 0) + 1
            if action == "repaired":
                report.repaired += 1
        elif event == "kv_block_diagnosed":
            shape = line.get("shape", "undiagnosed")
            report.shapes[shape] = report.shapes.get(shape, 0) + 1
            shapes_of.setdefault(line.get("block_id", -1), []).append((_ts(line), shape))
        elif event == "kv_block_nonfinite":
            report.nonfinite_blocks += 1
            shapes_of.setdefault(line.get("block_id", -1), []).append((_ts(line), "nonfinite"))
        elif event == "kv_block_identity_mismatch":
            report.identity_mismatches += 1
            shapes_of.setdefault(line.get("block_id", -1), []).append((_ts(line), "identity_mismatch"))
        elif event == "kv_block_write_lost":
            report.writes_lost += 1
            shapes_of.setdefault(line.get("block_id", -1), []).append((_ts(line), "stale"))
        elif event == "kv_block_quarantined" and line.get("pinned"):
            report.quarantined += 1
        elif event == "kv_request_affected":
            affected[line["outcome"]] += 1
        elif event in ("kvguard_internal_error", "kvguard_worker_internal_error"):
            report.internal_errors += 1
    for fid, kind in kinds.items():
        row = report.by_kind.setdefault(kind, KindRow())
        row.injected += 1
        result, when = outcome.get(fid, ("not_read", 0.0))
        seen = [shape for t, shape in shapes_of.get(blocks[fid], []) if t >= injected_at[fid]]
        report.faults.append(
            {
                "fault_id": fid,
                "kind": kind,
                "block_id": blocks[fid],
                "outcome": result,
                "expected_shape": EXPECTED_FINDING.get(kind),
                "shape": seen[0] if result == "detected" and seen else None,
            }
        )
        if result == "no_change":
            row.no_change += 1
        elif result == "not_read":
            row.not_read += 1
        else:
            row.read += 1
            if result == "detected":
                row.detected += 1
                report.detection_ms.append(round((when - injected_at[fid]) * 1000.0, 1))
                found = [shape for t, shape in shapes_of.get(blocks[fid], []) if t >= injected_at[fid]]
                if found and found[0] == EXPECTED_FINDING.get(kind):
                    row.diagnosed += 1
            else:
                row.escaped += 1
    report.requests_healed = affected["healed"]
    report.requests_suspect = affected["suspect"]
    report.requests_failed = affected["failed"]
    pairs = list(zip(outputs, reference, strict=True))
    report.outputs_identical = sum(1 for (text, _), ref in pairs if text == ref)
    report.silently_wrong = sum(
        1 for (text, flagged), ref in pairs if text is not None and not flagged and text != ref
    )
    return report


def render(report: DrillReport) -> str:
    rows: list[tuple[str, ...]] = [
        ("fault kind", "injected", "read", "detected", "escaped", "not read", "no change", "diagnosed")
    ]
    for kind, row in sorted(report.by_kind.items()):
        rows.append((kind, *map(str, asdict(row).values())))
    rows.append(("total", *map(str, asdict(report.total).values())))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    med = f"{statistics.median(report.detection_ms):.0f} ms" if report.detection_ms else "-"
    worst = f"{max(report.detection_ms):.0f} ms" if report.detection_ms else "-"
    lines += [
        "",
        f"mode                          {report.mode}",
        f"corrupted blocks detected     {report.corrupted_blocks}"
        + (
            ": " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(report.actions.items()))
            if report.actions
            else ""
        ),
        f"non-finite pages at write     {report.nonfinite_blocks}",
        f"identity mismatches           {report.identity_mismatches}",
        f"writes lost                   {report.writes_lost}",
        *(
            [f"bad loads (found at load)     {report.bad_loads}: their shapes are in the next line"]
            if report.bad_loads
            else []
        ),
        f"blocks held in quarantine     {report.quarantined}",
        "shapes diagnosed              "
        + (", ".join(f"{k} {v}" for k, v in sorted(report.shapes.items())) or "-"),
        f"healed / failed / suspect     "
        f"{report.requests_healed} / {report.requests_failed} / {report.requests_suspect}",
        f"outputs identical to clean    {report.outputs_identical} / {report.requests}",
        f"silently wrong outputs        {report.silently_wrong}",
        f"injection -> detection        median {med}, max {worst}",
        f"guard internal errors         {report.internal_errors}",
        "",
        "PASS: every fault that was read was detected; no output differs from the clean run unless "
        "its request failed or was flagged"
        if report.ok
        else "FAIL: a fault that was read escaped detection, an output was silently wrong, or the guard "
        "hit an internal error",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- parent side


def run_drill(
    *,
    model: str | None,
    requests: int,
    spec: str,
    mode: Mode,
    workdir: Path | None = None,
    keep: bool = False,
    progress: TextIO = sys.stderr,
) -> DrillReport:
    parse_fault_spec(spec, variable="--inject")
    check_model(model)
    show = Progress(progress)
    folder = WorkFolder(workdir, "kvguard-drill-", keep)
    ok = False
    try:
        report = _drill(folder, model, requests, spec, mode, show)
        ok = True
        return report
    finally:
        folder.finish(progress, ok)


def _drill(
    folder: WorkFolder, model: str | None, requests: int, spec: str, mode: Mode, show: Progress
) -> DrillReport:
    work = folder.path
    model = prepare(folder, model, show, "[1/3] building a tiny random-weight model")
    per_prefix = max(2, requests // 4)
    workload = asdict(Workload(prefixes=4, per_prefix=per_prefix))
    base = {"model": model, "workload": workload}
    loads = any(f.kind == FaultKind.LOAD for f in parse_fault_spec(spec))
    reference = show.run(
        "[2/3] clean run (plain vLLM, guard off)",
        lambda: run_child(
            "drill",
            {
                **base,
                "out": str(work / "reference.json"),
                "engine_args": loading_args(work / "store-clean", loads),
            },
            engine_env({}),
            work / "reference.log",
        ),
    )
    guard_log = work / "kvguard.jsonl"
    guard_log.unlink(missing_ok=True)
    env = engine_env(
        {
            "VLLM_KVGUARD": "1",
            "VLLM_KVGUARD_MODE": str(mode),
            "VLLM_KVGUARD_INJECT": spec,
            "VLLM_KVGUARD_LOG_FILE": str(guard_log),
            # The drill's pool is small (ENGINE_ARGS): room in the quarantine for every fault's page.
            "VLLM_KVGUARD_QUARANTINE_MAX_FRACTION": "0.1",
        }
    )
    outputs = show.run(
        f"[3/3] guarded run with faults injected ({spec_summary(spec)})",
        lambda: run_child(
            "drill",
            {
                **base,
                "out": str(work / "guarded.json"),
                "engine_args": loading_args(work / "store-guarded", loads),
            },
            env,
            work / "guarded.log",
        ),
    )
    lines = [json.loads(line) for line in guard_log.read_text().splitlines() if line.strip()]
    clean = [text for text, _ in reference]
    return summarize(lines, [(text, flagged) for text, flagged in outputs], clean, mode=str(mode), spec=spec)
