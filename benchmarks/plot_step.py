"""Plot ``step_micro.py`` results: the guard's µs per decode step against running requests and
against blocks in the pool, before and after a change.

    python benchmarks/step_micro.py --json before.json      # on the old tree (PYTHONPATH=...)
    python benchmarks/step_micro.py --json after.json
    python benchmarks/plot_step.py before.json after.json --out docs/img/step-micro.png

Each input is one ``--json`` file; its name (without .json) labels its lines. Panels: quiet and
mixed decode steps (step_micro.py's two kinds), scheduler and worker side, for one verify mode.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="step_micro.py --json files")
    ap.add_argument("--verify", default="reuse", help="which verify mode to plot (default reuse)")
    ap.add_argument("--out", type=Path, default=Path("step-micro.png"))
    a = ap.parse_args()
    runs = {p.stem: json.loads(p.read_text())["results"] for p in a.results}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    styles = {"scheduler": "-o", "worker": "--s"}
    for label, results in runs.items():
        rows = [r for r in results if r["verify"] == a.verify]
        if not rows:
            raise SystemExit(f"{label}: no results for verify={a.verify}")
        blocks = sorted({r["blocks"] for r in rows})
        running = sorted({r["running"] for r in rows})
        # Against running requests, at the largest pool every size fits in.
        pool = max(
            b
            for b in blocks
            if all(any(r["blocks"] == b and r["running"] == n for r in rows) for n in running)
        )
        # Against blocks, at the smallest batch.
        batch = running[0]
        for col, kind in enumerate(("quiet", "mixed")):
            for side, style in styles.items():
                key = f"{kind}_{side}_us"
                by_running = sorted((r["running"], r[key]) for r in rows if r["blocks"] == pool)
                by_blocks = sorted((r["blocks"], r[key]) for r in rows if r["running"] == batch)
                axes[0][col].plot(*zip(*by_running, strict=True), style, label=f"{label}: {side}")
                axes[1][col].plot(*zip(*by_blocks, strict=True), style, label=f"{label}: {side}")
            axes[0][col].set_title(f"{kind} decode step, {pool:,} blocks ({a.verify})")
            axes[1][col].set_title(f"{kind} decode step, {batch} running requests ({a.verify})")
    for ax in axes[0]:
        ax.set_xlabel("running requests")
    for ax in axes[1]:
        ax.set_xlabel("KV blocks in the pool")
    for ax in axes.flat:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylabel("guard µs per step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("vllm-kvguard: its own time per engine step (benchmarks/step_micro.py)")
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
