"""Issue 15's targets against the floor under them, measured in the engine.

    python benchmarks/floors.py [--concurrency 16,128] [--passes 2] [--json out.json]

For each batch size it runs ``benchmarks/profile_hooks.py`` (the ``kvguard bench`` workload, the
engine in-process; a fresh process a run) for the empty-hooks floor (``--floor empty``), the
guard's facade with idle sides (``--floor facade``), and the guard in ``reuse``, ``sampled``
(the default) and ``paranoid``. It runs them in that order, ``--passes`` times over, every
configuration once a pass, so that a slow spell of the shared machine falls on all of them.
Then it prints, per batch size:

- per mode, the guard's share of ``generate()`` and the floor under it: what vLLM's calls to a
  connector with empty hooks take (the ``empty`` run's share) plus XXH3 over the bytes that mode
  hashed, read out of memory (the guard run's hashing floor). Both are summed pass by pass, and
  the range over the passes is given. Then the share with the guard's facade in place of the
  empty hooks, and where the issue's target lies: below the floor (in every pass), within the
  floor's range, or above it (and how many points it leaves, and µs of a mean step);
- the quiet decode step (scheduler and worker µs, medians): the empty hooks, the facade and the
  guard in ``reuse``, against the issue's 30 and 20 µs.

The hashing floor is XXH3's. The guard checks the rows of pages still being filled with its
row digest (KVG64) instead, summed where the rows lie in the pool. That is slower per byte on
vLLM's CPU layout (docs/performance.md, sixteenth round), so in ``paranoid`` the real floor is
higher than the one printed.
Takes about 6 minutes for two passes at 16 and 128 running on a 2-vCPU machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# (name, profile_hooks arguments); the empty floor first, so that every guard run has one.
CONFIGS = (
    ("empty", ["reuse", "--floor", "empty"]),
    ("facade", ["reuse", "--floor", "facade"]),
    ("reuse", ["reuse"]),
    ("sampled", ["sampled"]),
    ("paranoid", ["paranoid"]),
)
# Issue 15's targets: the guard's share of step time by mode; the quiet step's µs by side.
SHARE_TARGETS = {"reuse": 0.005, "sampled": 0.01, "paranoid": 0.10}
QUIET_TARGETS = {"scheduler_us": 30.0, "worker_us": 20.0}
QUIET = "quiet decode"


def run(args: list[str], concurrency: int, out: Path) -> dict[str, Any]:
    """One profile_hooks.py run in a fresh process; its --json figures."""
    cmd = [sys.executable, str(HERE / "profile_hooks.py"), *args]
    cmd += ["--concurrency", str(concurrency), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise SystemExit(f"profile_hooks.py {' '.join(args)} --concurrency {concurrency} failed:\n{tail}")
    return json.loads(out.read_text())


def span(values: list[float], scale: float = 100.0, unit: str = " %", digits: int = 2) -> str:
    lo, hi = (f"{v * scale:.{digits}f}" for v in (min(values), max(values)))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def verdict(target: float, floors: list[float], steps_us: list[float]) -> str:
    if target < min(floors):
        return "below the floor"
    if target <= max(floors):
        return "within the floor's range"
    room = [target - f for f in floors]
    us = [r * s for r, s in zip(room, steps_us, strict=True)]
    return (
        f"above the floor: leaves {span(room, unit=' points')}"
        f" ({span(us, 1.0, ' µs', 0)} a step) for the guard's own work"
    )


def report(concurrency: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print one batch size's table; return its figures."""
    empty, facade = runs["empty"], runs["facade"]
    passes = f"{len(empty)} pass" + ("es; ranges over them" if len(empty) > 1 else "")
    print(f"\n{concurrency} running ({passes})")
    print(f"  {'mode':9s} {'guard':>13s} {'floor':>15s} {'with facade':>15s} {'target':>7s}  target vs floor")
    figures: dict[str, Any] = {"concurrency": concurrency, "modes": {}, "quiet": {}}
    for mode, target in SHARE_TARGETS.items():
        mine = runs[mode]
        guard = [r["share"] for r in mine]
        floor = [e["share"] + r["hashing_floor_share"] for e, r in zip(empty, mine, strict=True)]
        with_facade = [f["share"] + r["hashing_floor_share"] for f, r in zip(facade, mine, strict=True)]
        steps_us = [r["generate_s"] * 1e6 / r["steps"] for r in mine]  # a mean step
        print(
            f"  {mode:9s} {span(guard):>13s} {span(floor):>15s} {span(with_facade):>15s}"
            f" {target * 100:6.1f} %  {verdict(target, floor, steps_us)}"
        )
        figures["modes"][mode] = {
            "guard": guard,
            "floor": floor,
            "with_facade": with_facade,
            "step_us": steps_us,
        }
    print("  quiet decode step, µs (medians):")
    for name in ("empty", "facade", "reuse"):
        steps = [r["kinds"].get(QUIET) for r in runs[name]]
        if any(s is None for s in steps):
            print(f"    {name:8s} (no quiet decode step in some pass)")
            continue
        sides = {side: [s[side] for s in steps] for side in QUIET_TARGETS}
        parts = "  ".join(
            f"{side.split('_')[0]} {span(v, 1.0, ' µs', 1)} (target {QUIET_TARGETS[side]:.0f})"
            for side, v in sides.items()
        )
        print(f"    {name:8s} {parts}")
        figures["quiet"][name] = sides
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="16,128", help="batch sizes, comma-separated (default 16,128)")
    ap.add_argument("--passes", type=int, default=2, help="runs of every configuration (default 2)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    try:
        sizes = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        msg = f"--concurrency {a.concurrency!r}: expected integers, comma-separated (e.g. 16,128)"
        raise SystemExit(msg) from None
    if not sizes or min(sizes) < 1 or a.passes < 1:
        raise SystemExit("--concurrency needs at least one size >= 1, and --passes at least 1")
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {c: {name: [] for name, _ in CONFIGS} for c in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(a.passes):
            for c in sizes:
                for name, args in CONFIGS:
                    print(f"pass {p + 1}/{a.passes}, {c} running: {name}", file=sys.stderr, flush=True)
                    runs[c][name].append(run(args, c, Path(tmp) / f"{name}-{c}-{p}.json"))
    print("Guard share of generate(); floor = empty hooks + XXH3 over the bytes the mode hashed;")
    print("with facade = the guard's facade (idle sides) + the same hashing.")
    out = [report(c, runs[c]) for c in sizes]
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
