"""Consistency modes side by side: bsp, ssp(2), ssp(8) and async on the demo model, 4 workers,
one of them 2x slower, at an equal number of samples (every worker runs the same steps).

    python benchmarks/modes.py --steps 80

Reports per mode: wall-clock time, final validation loss (mean over workers, after each has
synced to the newest parameters), the speedup over bsp and the loss difference to bsp, against
the goal of ssp/async within 1% of bsp's final loss and at least 1.3x faster.
Writes benchmarks/results/modes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = [("bsp", 0), ("ssp", 2), ("ssp", 8), ("async", 0)]


def run(mode: str, staleness: int, steps: int, slow: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "ps.cli", "demo", "--steps", str(steps), "--mode", mode,
                            "--staleness", str(staleness), "--slow", str(slow), "--out", tmp],
                           cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"{mode} run failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        s = json.loads(Path(tmp, "summary.json").read_text())
    root = next(t for t in s["tiers"] if t["role"] == "global")
    return dict(wall_s=s["wall_s"], val_loss=statistics.mean(w["val_loss"] for w in s["workers"]),
                train_loss=statistics.mean(w["train_loss"] for w in s["workers"]),
                root_versions=root["version"], lost_steps=sum(w["lost_steps"] for w in s["workers"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80, help="steps per worker (equal samples per mode)")
    p.add_argument("--slow", type=float, default=2.0, help="slowdown of the last worker")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "modes.json"))
    args = p.parse_args()
    rows = {}
    for mode, s in MODES:
        name = f"ssp({s})" if mode == "ssp" else mode
        rows[name] = run(mode, s, args.steps, args.slow)
        print(f"{name:8s} wall {rows[name]['wall_s']:6.1f}s  val loss {rows[name]['val_loss']:.4f}  "
              f"versions {rows[name]['root_versions']}", flush=True)
    base = rows["bsp"]
    for name, r in rows.items():
        r["speedup_vs_bsp"] = base["wall_s"] / r["wall_s"]
        r["val_loss_vs_bsp_pct"] = 100.0 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]
        r["meets_goal"] = name == "bsp" or (r["speedup_vs_bsp"] >= 1.3 and r["val_loss_vs_bsp_pct"] <= 1.0)
    result = dict(benchmark="modes", machine=dict(platform=platform.platform(), cores=os.cpu_count(),
                                                  python=platform.python_version()),
                  settings=dict(steps=args.steps, workers=4, slow_worker=args.slow, model="TinyLM 470k",
                                optimizer="adam 3e-3, warm-up 20", batch=16),
                  goal="ssp/async within 1% of bsp's final loss and >= 1.3x faster", modes=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\n{'mode':8s} {'wall s':>7s} {'speedup':>8s} {'val loss':>9s} {'vs bsp':>8s}  goal")
    for name, r in rows.items():
        print(f"{name:8s} {r['wall_s']:7.1f} {r['speedup_vs_bsp']:7.2f}x {r['val_loss']:9.4f} "
              f"{r['val_loss_vs_bsp_pct']:+7.2f}%  {'met' if r['meets_goal'] else 'NOT met'}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
