"""Consistency modes side by side: bsp, ssp(2), ssp(8), async, async with damping and async with a
200 ms window at the root (fewer, larger versions) on the demo model, 4 workers, one of them 2x
slower, at an equal number of samples: the demo's workers draw their steps from one shared pool
of 4 x steps (ps/demo/budget.py), so in bsp each does its equal share and in ssp/async the
fast ones take what the slow one does not get to.

    python benchmarks/modes.py --steps 150 --repeats 2

Reports per mode: training time (from all workers up to the last one synced; the wall time
with the identical start-up is reported beside it), final validation loss (mean over workers,
after each has synced to the newest parameters), the speedup over bsp and the loss difference
to bsp, against the goal of ssp/async within 1% of bsp's final loss and at least 1.3x faster,
and the staleness the root measured (root version minus the gradient's base version).
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

import yaml

ROOT = Path(__file__).resolve().parent.parent
# (mode, staleness, damping, the root's flush window in ms or None for the topology's own)
MODES = [("bsp", 0, False, None), ("ssp", 2, False, None), ("ssp", 8, False, None),
         ("async", 0, False, None), ("async", 0, True, None), ("async", 0, False, 200.0)]


def run(mode: str, staleness: int, damping: bool, root_flush_ms: float | None, steps: int, slow: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        topology = []
        if root_flush_ms is not None:  # the default topology with a longer window at the root
            topo = yaml.safe_load((ROOT / "deploy" / "topology.yaml").read_text())
            topo["root"]["flush_ms"] = root_flush_ms
            Path(tmp, "topology.yaml").write_text(yaml.safe_dump(topo))
            topology = ["--topology", str(Path(tmp, "topology.yaml"))]
        r = subprocess.run([sys.executable, "-m", "ps.tools.cli", "demo", "--steps", str(steps), "--mode", mode,
                            "--staleness", str(staleness), "--slow", str(slow), "--out", tmp,
                            *(["--damping"] if damping else []), *topology],
                           cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"{mode} run failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        s = json.loads(Path(tmp, "summary.json").read_text())
    root = next(t for t in s["tiers"] if t["role"] == "global")
    return dict(train_s=s["train_s"], wall_s=s["wall_s"], val_loss=statistics.mean(w["val_loss"] for w in s["workers"]),
                train_loss=statistics.mean(w["train_loss"] for w in s["workers"]),
                root_versions=root["version"], lost_steps=sum(w["lost_steps"] for w in s["workers"]),
                steps_per_worker={w["worker"]: w["steps"] for w in s["workers"]},
                staleness_mean=root["staleness_mean"], staleness_max=root["staleness_max"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150,
                   help="steps per worker on average: a pool of 4 x steps shared by the workers")
    p.add_argument("--slow", type=float, default=2.0, help="slowdown of the last worker")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per mode (interleaved); times and losses are their means")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "modes.json"))
    args = p.parse_args()
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # interleaved: a drift in the machine's speed hits every mode
        for mode, s, damping, root_ms in MODES:
            name = ((f"ssp({s})" if mode == "ssp" else mode) + ("+damp" if damping else "")
                    + (f"+root{root_ms:g}ms" if root_ms is not None else ""))
            r = run(mode, s, damping, root_ms, args.steps, args.slow)
            runs.setdefault(name, []).append(r)
            print(f"{name:16s} train {r['train_s']:6.1f}s (wall {r['wall_s']:5.1f}s)  val loss {r['val_loss']:.4f}  "
                  f"versions {r['root_versions']}  staleness mean {r['staleness_mean']:.1f} max {r['staleness_max']}  "
                  f"steps {r['steps_per_worker']}", flush=True)
    rows = {}
    for name, rs in runs.items():
        rows[name] = {k: statistics.mean(r[k] for r in rs) for k in
                      ("train_s", "wall_s", "val_loss", "train_loss", "root_versions", "lost_steps",
                       "staleness_mean")}
        rows[name].update(staleness_max=max(r["staleness_max"] for r in rs),
                          val_loss_runs=[r["val_loss"] for r in rs], train_s_runs=[r["train_s"] for r in rs],
                          steps_per_worker=[r["steps_per_worker"] for r in rs])
    base = rows["bsp"]
    for name, r in rows.items():
        r["speedup_vs_bsp"] = base["train_s"] / r["train_s"]
        r["wall_speedup_vs_bsp"] = base["wall_s"] / r["wall_s"]  # with the same start-up in each
        r["val_loss_vs_bsp_pct"] = 100.0 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]
        r["meets_goal"] = name == "bsp" or (r["speedup_vs_bsp"] >= 1.3 and r["val_loss_vs_bsp_pct"] <= 1.0)
    result = dict(benchmark="modes", machine=dict(platform=platform.platform(), cores=os.cpu_count(),
                                                  python=platform.python_version()),
                  settings=dict(steps=args.steps, repeats=args.repeats, workers=4, slow_worker=args.slow,
                                model="TinyLM 470k",
                                optimizer="adam 3e-3, warm-up 20", batch=16),
                  goal="ssp/async within 1% of bsp's final loss and >= 1.3x faster in training time",
                  modes=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\n{'mode':16s} {'train s':>7s} {'speedup':>8s} {'val loss':>9s} {'vs bsp':>8s}  goal")
    for name, r in rows.items():
        print(f"{name:16s} {r['train_s']:7.1f} {r['speedup_vs_bsp']:7.2f}x {r['val_loss']:9.4f} "
              f"{r['val_loss_vs_bsp_pct']:+7.2f}%  {'met' if r['meets_goal'] else 'NOT met'}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
