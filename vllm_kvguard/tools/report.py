"""``kvguard report LOGFILE``: what a guard log says broke, for the on-call engineer.

Reads the guard's lines from any log they reach: the guard's JSON-lines file
(``VLLM_KVGUARD_LOG_FILE``), vLLM's log with JSON guard lines in it
(``VLLM_KVGUARD_LOG_FORMAT=json``), or vLLM's ordinary console log, where the guard
writes ``event key=value ...`` after vLLM's own prefix. It counts the bad pages by shape,
rank, device, layer, hour and action (every table adds up to the same total), and says what
the pattern points at (core/shapes.py: :func:`~vllm_kvguard.core.shapes.diagnose`) and which
runbook section to follow. A log that holds no guard line is said to be one, never "all
clear"; a fire drill's log (faults injected) is said to be a drill, never a diagnosis.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvguard.core.shapes import Diagnosis, diagnose

# Every guard line carries its role (scheduler | worker): what tells it from a vLLM line that
# happens to start with a ``kv_`` word.
_EVENT = re.compile(r"(?:^|\s)((?:kv|kvguard)_[a-z0-9_]+)\s+(?=[A-Za-z_][A-Za-z0-9_]*=)")
_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
_ROLE = re.compile(r"\srole=(?:scheduler|worker)(?:\s|$)")
# vLLM's console prefix: ``(EngineCore pid=1) ERROR 12-06 20:25:04 [logs.py:137] ...``.
_PREFIX_TIME = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(\d\d-\d\d) (\d\d):\d\d:\d\d\b")
_OPEN = {"(": ")", "[": "]", "{": "}"}
HOW_TO_GET_LINES = (
    "the guard writes its lines to vLLM's log when it runs (VLLM_KVGUARD=1); for a file of JSON lines "
    "set VLLM_KVGUARD_LOG_FILE=/path/kvguard.jsonl (or VLLM_KVGUARD_LOG_FORMAT=json for JSON in vLLM's log)"
)


@dataclass
class GuardLines:
    """The guard's events found in a log, and what could not be read."""

    events: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0
    json_lines: int = 0
    console_lines: int = 0
    unreadable: int = 0  # named a guard event but could not be parsed


def _value_end(text: str, start: int) -> int:
    """Where a console value starting at ``start`` ends: a quoted string, a bracketed literal
    (quotes inside respected), or a bare word."""
    if start >= len(text):
        return start
    first = text[start]
    if first in "'\"":
        i = start + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == first:
                return i + 1
            i += 1
        raise ValueError("unterminated string")
    if first in _OPEN:
        depth, i, quote = 0, start, ""
        while i < len(text):
            c = text[i]
            if quote:
                if c == "\\":
                    i += 2
                    continue
                if c == quote:
                    quote = ""
            elif c in "'\"":
                quote = c
            elif c in _OPEN:
                depth += 1
            elif c in _OPEN.values():
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        raise ValueError("unbalanced brackets")
    end = text.find(" ", start)
    return len(text) if end < 0 else end


def _console_value(raw: str) -> Any:
    if not raw:
        return ""
    if raw[0] in "'\"([{" or raw in ("None", "True", "False"):
        return ast.literal_eval(raw)
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _console_fields(line: str, i: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    while i < len(line):
        while i < len(line) and line[i] == " ":
            i += 1
        if i >= len(line):
            break
        key = _KEY.match(line, i)
        if key is None:
            raise ValueError(f"not key=value at {line[i : i + 20]!r}")
        start = key.end()
        end = _value_end(line, start)
        fields[key.group(1)] = _console_value(line[start:end])
        i = end
    return fields


def parse_console_line(line: str) -> dict[str, Any] | None:
    """One guard console line (``event key=value ...``, as logs.py renders it) as the event
    dict its JSON line would hold, or None when the line is not a guard line. Raises
    ValueError for a guard line that cannot be read."""
    match = _EVENT.search(line)
    if match is None:
        return None
    try:
        fields = {"event": match.group(1), **_console_fields(line, match.end())}
    except (ValueError, SyntaxError):
        if _ROLE.search(line):
            raise ValueError(f"a guard line that cannot be read: {line[:120]!r}") from None
        return None
    if "role" not in fields:
        return None
    stamp = _PREFIX_TIME.search(line, 0, match.start() + 1)
    if stamp is not None:
        fields.setdefault("hour", f"{stamp.group(1)} {stamp.group(2)}")
    return fields


def read_lines(path: Path) -> GuardLines:
    """The guard's events in a log file, JSON or console, with vLLM's own lines skipped."""
    found = GuardLines()
    for line in path.read_text(errors="replace").splitlines():
        found.lines += 1
        start = line.find("{")
        if start >= 0:
            try:
                event = json.loads(line[start:])
            except json.JSONDecodeError:
                event = None
            if isinstance(event, dict) and isinstance(event.get("event"), str):
                found.events.append(event)
                found.json_lines += 1
                continue
        try:
            parsed = parse_console_line(line)
        except ValueError:
            found.unreadable += 1
            continue
        if parsed is not None:
            found.events.append(parsed)
            found.console_lines += 1
    return found


def read_events(path: Path) -> list[dict[str, Any]]:
    return read_lines(path).events


def _hour(e: dict[str, Any]) -> str:
    stamp = e.get("timestamp")
    return str(stamp)[:13] if stamp else str(e.get("hour", "unknown"))


def _memory_checks(device: str) -> list[str]:
    """What to check for failing memory on this kind of device."""
    if device.startswith("cuda"):
        return [
            f"check device {device}'s ECC counters (nvidia-smi -q -d ECC) and Xid errors in the kernel log "
            "(dmesg | grep -i xid)",
            "run DCGM diagnostics (dcgmi diag -r 3) and drain the node if they confirm",
        ]
    if device.startswith(("rocm", "hip")):
        return [
            f"check device {device}'s RAS/ECC counters (amd-smi metric --ecc, or rocm-smi --showrasinfo all)",
            "run the vendor's memory diagnostics (rvs) and drain the node if they confirm",
        ]
    if device.startswith("cpu"):
        return [
            "the KV cache is in host memory (device cpu): check the host's corrected/uncorrected memory "
            "errors (ras-mc-ctl --errors, or dmesg | grep -i -e mce -e edac)",
            "run a memory test (memtester) in a maintenance window and drain the node if it confirms",
        ]
    return [
        f"device {device or 'not recorded'}: check that device's ECC/RAS counters and kernel log for memory "
        "errors, and drain the node if they confirm",
    ]


def _drill(injected: list[dict[str, Any]], armed: bool) -> Diagnosis:
    kinds = Counter(str(e.get("kind", "?")) for e in injected)
    made = ", ".join(f"{k} {n}" for k, n in kinds.most_common()) or "none logged yet"
    return Diagnosis(
        "fire drill (faults injected)",
        f"this log is a fire drill's: VLLM_KVGUARD_INJECT was set and {len(injected)} fault(s) were injected "
        f"({made}); its findings are the injected faults, not a diagnosis of this machine",
        [
            "kvguard drill's own table says whether each injected fault was caught",
            "for a diagnosis, run the report on a log of serving without VLLM_KVGUARD_INJECT",
        ],
        "docs/runbook.md#first-ten-minutes",
    )


def _bad_loads(lines: list[dict[str, Any]]) -> Diagnosis:
    connectors = Counter(str(e.get("connector", "another connector")) for e in lines)
    names = ", ".join(f"{k} {n}" for k, n in connectors.most_common())
    return Diagnosis(
        "software: a KV connector loaded wrong KV",
        f"{len(lines)} page(s) loaded by another KV connector ({names}) differ from what this engine "
        "computed for the same inputs (checked at load, or audited by recomputation): the connector "
        "restored the bytes wrongly (a layout or dtype mismatch after an upgrade, a truncated "
        "transfer) or serves KV of other weights (a redeploy behind a shared cache), not a memory fault",
        [
            "compare the connector's version with vLLM's KV layout of this release (the LMCache class: KV "
            "restored permuted after vLLM changed its layout); roll back whichever changed last",
            "the pages were caught before attention read them: in quarantine mode their readers recomputed",
        ],
        "docs/runbook.md#pages-loaded-by-another-connector",
    )


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Bad pages (corrupted after their seal, or non-finite when written) by every key, each
    table adding up to ``bad_pages``; the other findings; the requests' outcomes; a diagnosis."""
    corrupted = [e for e in events if e["event"] == "kv_block_corrupted" and e.get("role") != "worker"]
    nonfinite = [e for e in events if e["event"] == "kv_block_nonfinite"]
    diagnosed: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e["event"] == "kv_block_diagnosed":
            diagnosed.setdefault(e.get("block_id"), []).append(e)
    # A rank's device, from any line that names both: fills lines that do not.
    device_of = {
        int(e["rank"]): str(e["device"]) for e in events if e.get("device") and isinstance(e.get("rank"), int)
    }
    pages: list[dict[str, Any]] = []
    for e in corrupted:
        shape = str(e.get("shape", "undiagnosed"))
        if shape == "undiagnosed":
            # The device path's shape comes a step later, in its own line.
            later = diagnosed.get(e.get("block_id"))
            shape = str(later.pop(0).get("shape", shape)) if later else shape
        rank = int(e.get("rank", 0))
        loaded = e.get("trigger") == "external_load"
        pages.append(
            {
                "kind": f"loaded wrong by {e.get('connector', 'another connector')}"
                if loaded
                else "corrupted after its seal",
                "shape": shape,
                "rank": rank,
                "device": str(e.get("device") or device_of.get(rank, "not recorded")),
                "layer": str(e.get("layer", "not recorded")),
                "hour": _hour(e),
                "action": str(e.get("action", "not recorded")),
            }
        )
    for e in nonfinite:
        rank = int((e.get("ranks") or [0])[0])
        pages.append(
            {
                "kind": "non-finite when written",
                "shape": "nonfinite",
                "rank": rank,
                "device": device_of.get(rank, "not recorded"),
                "layer": str((e.get("layers") or ["not recorded"])[0]),
                "hour": _hour(e),
                "action": str(e.get("action", "not recorded")),
            }
        )
    injected = [e for e in events if e["event"] == "kv_fault_injected"]
    armed = any(e["event"] == "kvguard_fault_injection_armed" for e in events)
    others = {
        "identity mismatches": sum(e["event"] == "kv_block_identity_mismatch" for e in events),
        "writes lost": sum(e["event"] == "kv_block_write_lost" for e in events),
        "lifecycle violations": sum(e["event"] == "kv_block_lifecycle_violation" for e in events),
        "load audits failed": sum(e["event"] == "kv_load_audit_failed" for e in events),
    }
    # Loads found wrong: at load (checked by digests or sketches), or by an audit's recomputation.
    bad_loads = [e for e in corrupted if e.get("trigger") == "external_load"]
    bad_loads += [e for e in events if e["event"] == "kv_load_audit_failed"]
    if injected or armed:
        verdict = _drill(injected, armed)
    elif bad_loads:
        verdict = _bad_loads(bad_loads)
    else:
        findings = [(p["shape"], p["rank"], p["device"]) for p in pages if p["shape"] != "undiagnosed"]
        verdict = diagnose(findings)
        if verdict.verdict == "memory hardware":
            device = Counter(f[2] for f in findings).most_common(1)[0][0]
            verdict.next_steps = _memory_checks(device)
        software = {k: n for k, n in others.items() if n and k != "writes lost"}
        if software:
            verdict.why += (
                "; " + ", ".join(f"{n} {k}" for k, n in software.items()) + ": software by definition"
            )
    keys = ("kind", "shape", "action", "rank", "device", "layer", "hour")
    by = {key: dict(Counter(str(p[key]) for p in pages).most_common()) for key in keys}
    affected = Counter(e.get("outcome", "?") for e in events if e["event"] == "kv_request_affected")
    return {
        "guard_lines": len(events),
        "bad_pages": len(pages),
        "corrupted_pages": len(corrupted),
        "nonfinite_pages": len(nonfinite),
        "other_findings": others,
        "faults_injected": len(injected),
        "by": by,
        "requests": dict(affected),
        "diagnosis": {
            "verdict": verdict.verdict,
            "why": verdict.why,
            "next_steps": verdict.next_steps,
            "runbook": verdict.runbook,
        },
    }


def render(summary: dict[str, Any]) -> str:
    kinds = summary["by"]["kind"]
    lines = [
        f"bad pages {summary['bad_pages']}"
        + (": " + ", ".join(f"{k} {v}" for k, v in kinds.items()) if kinds else ""),
        "other findings: " + ", ".join(f"{k} {v}" for k, v in summary["other_findings"].items()),
        "requests affected: " + (", ".join(f"{k} {v}" for k, v in summary["requests"].items()) or "none"),
    ]
    if summary["bad_pages"]:
        lines.append(f"each 'by' row below adds up to the {summary['bad_pages']} bad pages")
    lines.append("")
    for key, counts in summary["by"].items():
        if counts and key != "kind":
            lines.append(f"by {key:7s} " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    d = summary["diagnosis"]
    lines += ["", f"diagnosis: {d['verdict']}", f"  {d['why']}"]
    lines += [f"  - {step}" for step in d["next_steps"]]
    if d["runbook"]:
        lines.append(f"runbook: {d['runbook']}")
    return "\n".join(lines)


def no_guard_lines(path: Path, found: GuardLines) -> str:
    """Why a report on ``path`` says nothing about corruption: it holds no guard line."""
    unread = (
        f"; {found.unreadable} line(s) named a guard event but could not be read" if found.unreadable else ""
    )
    return (
        f"kvguard report: {path} holds no vllm-kvguard line ({found.lines} lines read{unread}), so it says "
        f"nothing about KV-cache corruption, neither found nor ruled out: {HOW_TO_GET_LINES}"
    )


def findings(summary: dict[str, Any]) -> int:
    """How many findings a summary holds: bad pages and the other findings (what
    ``kvguard report --fail-on-corruption`` fails on)."""
    return int(summary["bad_pages"]) + sum(int(n) for n in summary["other_findings"].values())
