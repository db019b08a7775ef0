"""Load under faults, with a real client against the real OpenAI server.

    python benchmarks/load.py                          # ~10 minutes: 2-minute phases
    python benchmarks/load.py --phase-seconds 12 --round-seconds 6 --json # about the tests' run

What it does, on loopback only (every server on 127.0.0.1, every loop bounded in time and count):

1. Two servers, guard off and guard on (default settings, no faults). The clean reference: every
   prompt of the prefix-sharing mix once on the guard-off server (greedy, fixed length).
2. Rounds, interleaved: a round on the guard-off server, a round on the guard-on server, ... at
   ``--concurrency`` clients (half streaming), for ``--phase-seconds`` each side. Every response
   is compared with the reference; the guard-on side must detect nothing and serve identical text;
   TTFT and inter-token latency p50/p99 side by side.
3. For each ``--modes`` entry, a guard-on server with drill faults injected at a steady rate
   (``--faults``, per step), driven for ``--phase-seconds``: requests served, faults injected and
   what became of them, responses that differ from clean and were neither errored nor flagged
   (the contract: 0), errors by cause. ``log`` mode is the control: it heals nothing, so differing
   (flagged) responses there show the faults do change the text.

With ``--timing`` both servers time vLLM's step calls (``server_floor/step_timing.py``: wall
and CPU per call of ``schedule``, ``update_from_output`` and the worker's ``execute_model``).

With ``--floor empty`` (or ``facade``) the guard-on server of steps 1-2 runs the guard's connector
with empty hooks (or its facade with idle sides, as ``profile_hooks.py --floor``): what vLLM's
calls to a KV connector cost a user of the server, under the guard's own cost.

With ``--before PATH`` a third server runs the guard from PATH (a checkout of an earlier commit:
``git worktree add /tmp/before <commit>``) in the same rounds: a change's effect on the server,
side by side in one sitting (the machine's sittings differ more than most changes).

Each server's steps in the rounds (vLLM's ``/metrics``): how many, tokens a step, and the guard's
own time a step by side (``vllm:kvguard_overhead_seconds_total``).

The report (``--json``: one JSON object on stdout) is written to ``<workdir>/load.json`` too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import loadgen
from server_floor import step_timing

from vllm_kvguard.tools.server import Server, serve

FAULTS = "bitflip:rate=0.01,seed=1;zero:rate=0.01,seed=2;overwrite:rate=0.01,seed=3"


def guard_events(log: Path) -> Counter[str]:
    """Counts from a guard log: faults by outcome, corruptions by action, requests by outcome."""
    c: Counter[str] = Counter({"faults_injected": 0, "corruptions_detected": 0, "internal_errors": 0})
    if not log.exists():
        return c
    for line in log.read_text().splitlines():
        e = json.loads(line)
        name = e.get("event", "")
        if name == "kv_fault_injected":
            c["faults_injected"] += 1
        elif name == "kv_fault_outcome":
            c[f"fault_{e['outcome']}"] += 1
        elif name == "kv_block_corrupted":
            c["corruptions_detected"] += 1
            c[f"corrupted_{e.get('action', '')}"] += 1
        elif name == "kv_request_affected":
            c[f"requests_{e['outcome']}"] += 1
        elif name in ("kvguard_internal_error", "kvguard_worker_internal_error"):
            c["internal_errors"] += 1
    ended = sum(v for k, v in c.items() if k.startswith("fault_"))
    c["faults_pending"] = c["faults_injected"] - ended  # injected into pages nobody read since
    return c


def _reference(server: Server, prompts: list[str], concurrency: int) -> dict[int, str]:
    order = list(range(len(prompts)))
    responses = loadgen.run(
        server.base, prompts, concurrency=concurrency, seconds=600, max_requests=len(order), order=order
    )
    # Both halves of each prompt: the reference itself is taken twice (streaming and not) and
    # must agree, or the engine is not deterministic here and no comparison means anything.
    again = loadgen.run(
        server.base, prompts, concurrency=concurrency, seconds=600, max_requests=len(order),
        order=order[1:] + order[:1],
    )  # fmt: skip
    ref = {r.prompt: r.text for r in responses if r.ok}
    if len(ref) != len(prompts):
        raise SystemExit(f"reference run: {len(prompts) - len(ref)} prompts failed on the guard-off server")
    unstable = [r.prompt for r in again if not r.ok or r.text != ref[r.prompt]]
    if unstable:
        raise SystemExit(f"reference run: guard-off server not deterministic for prompts {unstable[:10]}")
    return ref


def step_metrics(server: Server) -> dict[str, float]:
    """vLLM's step count and tokens, and the guard's own seconds by side, from ``/metrics``."""
    out: dict[str, float] = {}
    for line in server.metrics().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("vllm:iteration_tokens_total_count"):
            key = "steps"
        elif name.startswith("vllm:iteration_tokens_total_sum"):
            key = "tokens"
        elif name.startswith("vllm:kvguard_overhead_seconds_total") and 'side="' in name:
            key = "guard_" + name.split('side="', 1)[1].split('"', 1)[0]
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _per_step(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("steps", 0.0)
    if steps <= 0:
        return {"steps": 0}
    return {
        "steps": int(steps),
        "tokens_per_step": round(d.get("tokens", 0.0) / steps, 1),
        "guard_ms_per_step": {
            k[6:]: round(v / steps * 1e3, 3) for k, v in d.items() if k.startswith("guard_")
        },
    }


def interleaved(
    servers: dict[str, Server], prompts: list[str], ref: dict[int, str], args: argparse.Namespace
) -> dict[str, Any]:
    sides: dict[str, list[loadgen.Response]] = {name: [] for name in servers}
    spent = dict.fromkeys(servers, 0.0)
    at_start = {name: step_metrics(server) for name, server in servers.items()}
    round_no = 0
    names = list(servers)
    while min(spent.values()) < args.phase_seconds:
        turn = round_no % len(names)
        for name in names[turn:] + names[:turn]:  # off-on, on-off, ... (each first in turn)
            server = servers[name]
            start = time.monotonic()
            sides[name] += loadgen.run(
                server.base, prompts, concurrency=args.concurrency, seconds=args.round_seconds,
                max_requests=10_000, seed=round_no,
            )  # fmt: skip
            spent[name] += time.monotonic() - start
        round_no += 1
    out: dict[str, Any] = {"rounds": round_no}
    for name, server in servers.items():
        out[name] = {
            **loadgen.verdicts(sides[name], ref),
            **loadgen.latency(sides[name]),
            "requests_per_s": round(len(sides[name]) / spent[name], 2),
            **_per_step(at_start[name], step_metrics(server)),
        }
        if name != "off":
            out[name]["guard"] = dict(guard_events(server.log))
    pairs = [("on", "off"), ("before", "off"), ("on", "before")]
    for a, b in pairs:
        if a in out and b in out:
            out[f"ratio_{a}_to_{b}"] = {
                k: round(out[a][k] / out[b][k], 3)
                for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "requests_per_s")
                if out[a].get(k) and out[b].get(k)
            }
    return out


def faulted(
    model: str, work: Path, mode: str, prompts: list[str], ref: dict[int, str], args: argparse.Namespace
) -> dict[str, Any]:
    guard = {"VLLM_KVGUARD": "1", "VLLM_KVGUARD_MODE": mode, "VLLM_KVGUARD_INJECT": args.faults}
    with serve(model, work, guard, args=args.server_args, name=f"faults-{mode}") as server:
        start = time.monotonic()
        responses = loadgen.run(
            server.base, prompts, concurrency=args.concurrency, seconds=args.phase_seconds,
            max_requests=100_000, seed=7,
        )  # fmt: skip
        seconds = time.monotonic() - start
        time.sleep(1.5)  # the last outcomes reach the log
        guard_counts = guard_events(server.log)
    return {
        "mode": mode,
        "faults": args.faults,
        **loadgen.verdicts(responses, ref),
        **loadgen.latency(responses),
        "requests_per_s": round(len(responses) / seconds, 2),
        "guard": dict(guard_counts),
    }


def _env(guard: bool, floor: str | None, timing: Path | None, code: str | None = None) -> dict[str, str]:
    """A server's environment: the guard off, or on (from the checkout ``code``, where given), or
    with ``floor`` that floor in its place;
    with ``timing`` its step calls timed (both installed in every server process by
    ``server_floor/sitecustomize.py``)."""
    env = {"VLLM_KVGUARD": "1" if guard else "0"}
    if guard and floor is not None:
        env["KVGUARD_BENCH_FLOOR"] = floor
    if timing is not None:
        env["KVGUARD_BENCH_TIMING"] = str(timing)
    if len(env) > 1 or code is not None:
        site = str(Path(__file__).resolve().parent / "server_floor") if len(env) > 1 else None
        env["PYTHONPATH"] = os.pathsep.join(p for p in (code, site, os.environ.get("PYTHONPATH")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    p = loadgen.parser(__doc__ or "")
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--phase-seconds", type=float, default=120.0)
    p.add_argument("--round-seconds", type=float, default=10.0)
    p.add_argument("--faults", default=FAULTS, help=f"drill spec (VLLM_KVGUARD_INJECT), default {FAULTS}")
    p.add_argument("--modes", default="quarantine,log", help="guard modes for the fault phase")
    p.add_argument(
        "--floor",
        choices=("empty", "facade"),
        default=None,
        help="the guard-on server of the interleaved rounds runs this floor instead (see above)",
    )
    p.add_argument(
        "--timing",
        action="store_true",
        help="time vLLM's schedule, update_from_output and execute_model in both servers (wall and CPU)",
    )
    p.add_argument(
        "--before",
        metavar="PATH",
        default=None,
        help="also run the guard from this checkout (an earlier commit) in the same rounds",
    )
    args = p.parse_args(argv)
    if args.before is not None:
        before = Path(args.before).resolve()
        if not (before / "vllm_kvguard" / "__init__.py").is_file():
            p.error(f"--before {args.before}: no vllm_kvguard package there (a checkout of this repository)")
        args.before = str(before)
        if args.floor is not None:
            p.error("--before and --floor: one comparison at a time")
    if not 1 <= args.concurrency <= 256:
        p.error(f"--concurrency {args.concurrency}: 1..256")
    if args.phase_seconds <= 0 or args.round_seconds <= 0:
        p.error("--phase-seconds and --round-seconds must be > 0")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("quarantine", "raise", "log"):
            p.error(f"--modes: {m!r} is not one of quarantine, raise, log")
    model, server_args = loadgen.prepare(p, args, args.faults)
    args.server_args = server_args
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        work.mkdir(parents=True, exist_ok=True)
        prompts = loadgen.prompt_mix()
        report: dict[str, Any] = {
            "floor": args.floor,
            "concurrency": args.concurrency,
            "phase_seconds": args.phase_seconds,
            "prompts": len(prompts),
            "max_tokens": loadgen.MAX_TOKENS,
        }
        names = ["off", "on"] + (["before"] if args.before else [])
        timing = {side: work / f"timing-{side}" if args.timing else None for side in names}
        envs = {
            "off": _env(False, None, timing["off"]),
            "on": _env(True, args.floor, timing["on"]),
            "before": _env(True, None, timing.get("before"), args.before),
        }
        t0 = time.monotonic()
        with contextlib.ExitStack() as servers_up:
            servers = {
                name: servers_up.enter_context(serve(model, work, envs[name], args=server_args, name=name))
                for name in names
            }
            off = servers["off"]
            print(f"servers up in {time.monotonic() - t0:.0f}s; reference run", file=sys.stderr, flush=True)
            ref = _reference(off, prompts, args.concurrency)
            # Each guard server's first pass: its warm-up, and every prompt checked against clean.
            for name in names[1:]:
                report[f"{name}_reference"] = loadgen.verdicts(
                    loadgen.run(servers[name].base, prompts, concurrency=args.concurrency, seconds=600,
                                max_requests=len(prompts), order=list(range(len(prompts)))),
                    ref,
                )  # fmt: skip
            print(f"interleaved rounds, {' vs '.join(names)} (no faults)", file=sys.stderr, flush=True)
            report["no_faults"] = interleaved(servers, prompts, ref, args)
            if args.timing:
                # Per call, over each server's life (its reference pass included).
                report["no_faults"]["timing"] = {
                    side: step_timing.read(str(t)) for side, t in timing.items() if t is not None
                }
        report["faults"] = {}
        for mode in modes:
            print(f"faults at a steady rate, mode {mode}", file=sys.stderr, flush=True)
            report["faults"][mode] = faulted(model, work, mode, prompts, ref, args)
        report["seconds"] = round(time.monotonic() - t0, 1)
        (work / "load.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
