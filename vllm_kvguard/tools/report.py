"""``kvguard report LOGFILE``: what a guard log says broke, for the on-call engineer.

Reads the guard's JSON-lines log (``VLLM_KVGUARD_LOG_FILE``, or vLLM's log with
``VLLM_KVGUARD_LOG_FORMAT=json`` lines in it), counts the corrupted pages by shape, rank,
device, layer and hour, and says what the pattern points at (core/shapes.py:
:func:`~vllm_kvguard.core.shapes.diagnose`) and which runbook section to follow.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from vllm_kvguard.core.shapes import diagnose


def read_events(path: Path) -> list[dict[str, Any]]:
    """The guard's events in a log file; lines that are not guard JSON are skipped (a vLLM log
    mixes its own lines in)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            event = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
    return events


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    corrupted = [e for e in events if e["event"] == "kv_block_corrupted" and e.get("role") != "worker"]
    nonfinite = [e for e in events if e["event"] == "kv_block_nonfinite"]
    violations = [e for e in events if e["event"] == "kv_block_lifecycle_violation"]
    diagnosed = [e for e in events if e["event"] == "kv_block_diagnosed"]
    # A device-path finding says "undiagnosed" and is diagnosed a step later, in its own line.
    shaped = [e for e in corrupted if e.get("shape", "undiagnosed") != "undiagnosed"] + diagnosed
    findings = [
        (e.get("shape", "undiagnosed"), int(e.get("rank", 0)), str(e.get("device", ""))) for e in shaped
    ]
    findings += [("nonfinite", int((e.get("ranks") or [0])[0]), "") for e in nonfinite]
    diagnosable = [f for f in findings if f[0] != "undiagnosed"]
    verdict = diagnose(diagnosable)
    if violations:
        verdict.why += f"; {len(violations)} lifecycle violation(s): scheduler bugs, software by definition"
    by = {
        "shape": Counter(f[0] for f in findings),
        "rank": Counter(str(f[1]) for f in findings),
        "device": Counter(f[2] or "?" for f in findings),
        "layer": Counter(str(e.get("layer", "?")) for e in corrupted),
        "hour": Counter(str(e.get("timestamp", "?"))[:13] for e in corrupted + nonfinite),
        "action": Counter(str(e.get("action", "?")) for e in corrupted),
    }
    affected = Counter(e.get("outcome", "?") for e in events if e["event"] == "kv_request_affected")
    return {
        "corrupted_pages": len(corrupted),
        "nonfinite_pages": len(nonfinite),
        "lifecycle_violations": len(violations),
        "by": {k: dict(v.most_common()) for k, v in by.items()},
        "requests": dict(affected),
        "diagnosis": {
            "verdict": verdict.verdict,
            "why": verdict.why,
            "next_steps": verdict.next_steps,
            "runbook": verdict.runbook,
        },
    }


def render(summary: dict[str, Any]) -> str:
    lines = [
        f"corrupted pages {summary['corrupted_pages']}, non-finite at write {summary['nonfinite_pages']}, "
        f"lifecycle violations {summary['lifecycle_violations']}",
        "requests: " + (", ".join(f"{k} {v}" for k, v in summary["requests"].items()) or "none affected"),
        "",
    ]
    for key, counts in summary["by"].items():
        if counts:
            lines.append(f"by {key:7s} " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    d = summary["diagnosis"]
    lines += ["", f"diagnosis: {d['verdict']}", f"  {d['why']}"]
    lines += [f"  - {step}" for step in d["next_steps"]]
    if d["runbook"]:
        lines.append(f"runbook: {d['runbook']}")
    return "\n".join(lines)
