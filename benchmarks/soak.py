"""Soak: one guard-on OpenAI server under steady traffic, its memory sampled over time.

    python benchmarks/soak.py --minutes 30                      # the long run (a benchmark)
    python benchmarks/soak.py --minutes 1 --sample-seconds 6 --json   # the tests' short run

Steady traffic on loopback (``--concurrency`` clients, half streaming, every 4th streaming
client hanging up after two chunks, i.e. a client disconnect mid-stream that vLLM aborts),
optionally with drill faults (``--faults``). Every ``--sample-seconds``: the guard's own state
from ``/metrics`` (``vllm:kvguard_state_entries`` by table, ``vllm:kvguard_state_bytes`` by
side), the number of ``vllm:kvguard_*`` series (the metrics' label sets), and the resident
memory of the server and its engine process. At the end, with traffic stopped and one probe
request served, every per-request table must be back to 0.

The report (``--json``: one JSON object on stdout) is written to ``<workdir>/soak.json``, the
samples to ``soak_samples.csv``, and a plot to ``soak.png`` (``--plot``, needs matplotlib).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import loadgen
import psutil
from load import guard_events

from vllm_kvguard.tools.server import Server, get, serve

# Tables that hold one entry per live request (or event awaiting its request's end): 0 when idle.
# (``faults``, a drill's injected faults, wait for a reader of their page, request or not: at most
# one per sealed page; ``recent_steps`` is at most 3.)
PER_REQUEST = (
    "requests", "blocks_given", "tables", "stop_messages", "affected",
    "recompute_counts", "pending_failures",
)  # fmt: skip
_SAMPLE = re.compile(r"^(vllm:kvguard_[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$")


def guard_series(text: str) -> tuple[dict[str, float], dict[str, float], int]:
    """(state entries by table, state bytes by side, number of vllm:kvguard series)."""
    entries: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    series = 0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        series += 1
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        if name == "vllm:kvguard_state_entries":
            entries[re.search(r'table="([^"]+)"', labels).group(1)] = value  # type: ignore[union-attr]
        elif name == "vllm:kvguard_state_bytes":
            nbytes[re.search(r'side="([^"]+)"', labels).group(1)] = value  # type: ignore[union-attr]
    return entries, nbytes, series


def rss_mib(pid: int) -> dict[str, float]:
    """Resident MiB of the API server and of its engine-core child(ren)."""
    proc = psutil.Process(pid)
    out = {"server_rss_mib": proc.memory_info().rss / 2**20, "engine_rss_mib": 0.0}
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out["engine_rss_mib"] += child.memory_info().rss / 2**20
    return {k: round(v, 1) for k, v in out.items()}


def sample(server: Server, t0: float) -> dict[str, Any]:
    entries, nbytes, series = guard_series(get(server.base + "/metrics"))
    return {
        "t_s": round(time.monotonic() - t0, 1),
        **rss_mib(server.proc.pid),
        "series": series,
        **{f"bytes_{k}": v for k, v in sorted(nbytes.items())},
        **{f"entries_{k}": v for k, v in sorted(entries.items())},
    }


def guard_failures(log: Path) -> list[dict[str, Any]]:
    """Each request the guard failed or flagged, with the findings about its blocks: what an
    errored response in the report is explained by (or, if it is not here, is not)."""
    if not log.exists():
        return []
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    findings = [e for e in lines if str(e.get("event", "")).startswith("kv_block_") and "block_id" in e]
    out = []
    for e in lines:
        if e.get("event") != "kv_request_affected" or e.get("outcome") == "healed":
            continue
        blocks = set(e.get("block_ids") or [e.get("block_id")])
        out.append(
            {
                "request_id": e.get("request_id"),
                "outcome": e.get("outcome"),
                "blocks": sorted(blocks),
                "findings": [
                    {k: f.get(k) for k in ("event", "block_id", "step", "trigger", "action", "request_ids",
                                           "last_good_step", "shape", "what", "reason") if k in f}
                    for f in findings if f["block_id"] in blocks
                ],
            }
        )  # fmt: skip
    return out


def drift(samples: list[dict[str, Any]], key: str) -> float:
    """Growth of ``key`` from the first quarter's mean to the last quarter's (after warm-up)."""
    values = [s[key] for s in samples if key in s]
    q = max(1, len(values) // 4)
    first, last = values[q : 2 * q] or values[:q], values[-q:]
    return round(sum(last) / len(last) - sum(first) / len(first), 2)


def plot(samples: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in samples]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(t, [s["server_rss_mib"] for s in samples], label="API server RSS")
    a.plot(t, [s["engine_rss_mib"] for s in samples], label="engine core RSS")
    a.set_ylabel("MiB")
    a.legend()
    for key in sorted(k for k in samples[-1] if k.startswith("entries_")):
        b.plot(t, [s.get(key, 0) for s in samples], label=key.removeprefix("entries_"))
    b.plot(t, [s["series"] for s in samples], label="kvguard series", linestyle="--")
    b.set_ylabel("entries")
    b.set_xlabel("minutes")
    b.legend(fontsize=7, ncol=3)
    fig.suptitle("vllm-kvguard soak: memory and guard state over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = loadgen.parser(__doc__ or "")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--sample-seconds", type=float, default=30.0)
    p.add_argument("--faults", default="", help="drill spec (VLLM_KVGUARD_INJECT); default none")
    p.add_argument("--plot", action="store_true", help="write soak.png (needs matplotlib)")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.sample_seconds <= 0 or not 1 <= args.concurrency <= 256:
        p.error("--minutes and --sample-seconds must be > 0, --concurrency 1..256")
    model, server_args = loadgen.prepare(p, args, args.faults)
    prompts = loadgen.prompt_mix(prefixes=12, per_prefix=16, seed=3)
    guard = {"VLLM_KVGUARD": "1", **({"VLLM_KVGUARD_INJECT": args.faults} if args.faults else {})}
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        work.mkdir(parents=True, exist_ok=True)
        with serve(model, work, guard, args=server_args, name="soak") as server:
            t0 = time.monotonic()
            samples = [sample(server, t0)]
            responses: list[loadgen.Response] = []
            traffic = threading.Thread(
                target=lambda: responses.extend(
                    asyncio.run(
                        loadgen.drive(
                            server.base, prompts, concurrency=args.concurrency, seconds=args.minutes * 60,
                            max_requests=10_000_000, seed=11, disconnect_every=4,
                        )
                    )
                ),
                daemon=True,
            )  # fmt: skip
            traffic.start()
            while traffic.is_alive():
                traffic.join(timeout=args.sample_seconds)
                samples.append(sample(server, t0))
            # Quiet: one probe request steps the engine, whose last step reports the tables emptied.
            time.sleep(2)
            probe = loadgen.run(server.base, prompts, concurrency=1, seconds=60, max_requests=1, order=[0])
            time.sleep(1.5)
            final = sample(server, t0)
        idle = {k: final.get(f"entries_{k}") for k in PER_REQUEST}
        causes: dict[str, int] = {}
        for r in responses:
            if r.cause:
                causes[r.cause] = causes.get(r.cause, 0) + 1
        report = {
            "minutes": args.minutes,
            "concurrency": args.concurrency,
            "faults": args.faults or None,
            "requests": len(responses),
            "completed": sum(r.ok for r in responses),
            "disconnected_mid_stream": causes.pop("disconnected", 0),
            "errors_by_cause": causes,
            "probe_ok": bool(probe and probe[0].ok),
            "samples": len(samples),
            "idle_entries": idle,
            "idle_faults_awaiting_reader": final.get("entries_faults"),
            "state_bytes": {k.removeprefix("bytes_"): v for k, v in final.items() if k.startswith("bytes_")},
            "series_first_last": [samples[1]["series"] if len(samples) > 1 else None, final["series"]],
            "drift": {
                k: drift(samples, k)
                for k in ("server_rss_mib", "engine_rss_mib", "series", "bytes_scheduler", "bytes_worker")
                if k in final
            },
            "first": samples[1] if len(samples) > 1 else samples[0],
            "last": final,
            "guard": dict(guard_events(server.log)),
            "guard_failures": guard_failures(server.log),
        }
        with (work / "soak_samples.csv").open("w", newline="") as f:
            keys = sorted({k for s in [*samples, final] for k in s})
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows([*samples, final])
        if args.plot:
            plot([*samples, final], work / "soak.png")
            report["plot"] = str(work / "soak.png")
        (work / "soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
