"""Bytes per step on every edge of the demo, dense against compressed, with the loss each reaches.

    python benchmarks/demo_codecs.py --steps 60 --runs fp32,topk,topk/fp16,int8
    python benchmarks/demo_codecs.py --steps 80 --runs powersgd,topk,int8 --repeat 3

Each run is ``hps demo`` (4 workers, root -> 2 regions -> 2 zones each, BSP) with one push
codec (``CODEC``) or push and delta codec (``CODEC/DELTA``); all runs happen side by side in
one invocation. Reports (and writes benchmarks/results/demo_codecs.json), per run:
- payload bytes per step on each edge kind (one child edge: worker -> zone, zone -> region,
  region -> root, and the pulls back down), and how many times smaller than dense fp32;
- the worker -> zone push over the second half of the run only (the workers' own per-step
  counts), past top-k's density warm-up (the first 20 steps start at 25% density);
- held-out loss at the end, median step time and wall time.
With ``--repeat N`` each run is made N times (interleaved: every codec once, then again) and
each figure is the median of the N, the individual losses kept beside it. Nothing is
asserted. Note the optimizers differ: top-k runs DGC's recipe (sgd 0.1, momentum
0.9, corrected at the workers), the others Adam (3e-3): compare losses within a codec family.
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
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ps.demo.model import ModelConfig, build_model  # noqa: E402

WARMUP = 20  # the demo's top-k density warm-up (ps.demo.train.demo_job)


def _run(codec: str, delta: str, steps: int, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "ps.tools.cli", "demo", "--steps", str(steps),
                            "--workers", str(workers), "--codec", codec, "--delta-codec", delta,
                            "--out", tmp], cwd=ROOT, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - t0
        if r.returncode != 0:
            raise RuntimeError(f"demo with {codec}/{delta} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        summary = json.loads(Path(tmp, "summary.json").read_text())
    tiers = {t["tier"].strip(): t for t in summary["tiers"]}
    versions = max(t["version"] for t in tiers.values())
    # One child edge of each kind: the first zone, its region, the root.
    edges = {
        "worker -> zone (push)": tiers["eu-a"]["push_in_bytes"] / versions,
        "zone -> region (push)": tiers["eu-a"]["push_up_bytes"] / versions,
        "region -> root (push, WAN)": tiers["eu"]["push_up_bytes"] / versions,
        "root -> region (pull, WAN)": tiers["eu"]["pull_in_bytes"] / versions,
        "region -> zone (pull)": tiers["eu-a"]["pull_in_bytes"] / versions,
        "zone -> worker (pull)": tiers["eu-a"]["pull_out_bytes"] / versions,
    }
    late = statistics.mean(w["late_push_bytes_per_step"] for w in summary["workers"])
    return dict(codec=codec, delta_codec=delta, wall_s=wall, versions=versions, edges=edges,
                late_worker_push_bytes_per_step=late,
                val_loss=statistics.mean(w["val_loss"] for w in summary["workers"]),
                median_step_s=statistics.median(w["median_step_s"] for w in summary["workers"]))


def _median_of(runs: list[dict]) -> dict:
    """One run's figures, each the median over ``runs`` (the losses of each kept too)."""
    med = statistics.median
    out = dict(runs[0], wall_s=med(r["wall_s"] for r in runs), versions=min(r["versions"] for r in runs),
               edges={k: med(r["edges"][k] for r in runs) for k in runs[0]["edges"]},
               late_worker_push_bytes_per_step=med(r["late_worker_push_bytes_per_step"] for r in runs),
               val_loss=med(r["val_loss"] for r in runs), median_step_s=med(r["median_step_s"] for r in runs))
    if len(runs) > 1:
        out.update(repeats=len(runs), val_loss_runs=[r["val_loss"] for r in runs])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=4, help="one per zone of the default topology")
    p.add_argument("--runs", default="fp32,topk,topk/fp16,int8",
                   help="comma-separated CODEC or CODEC/DELTA_CODEC; the first is the dense reference")
    p.add_argument("--repeat", type=int, default=1, help="runs of each codec; figures are medians")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "demo_codecs.json"))
    args = p.parse_args()

    params = sum(x.numel() for x in build_model(ModelConfig(), 0).parameters())
    dense = 4 * params
    specs = args.runs.split(",")
    made: dict[str, list[dict]] = {spec: [] for spec in specs}
    for i in range(args.repeat):  # interleaved, so a slow spell of the machine hits every codec
        for spec in specs:
            codec, _, delta = spec.partition("/")
            made[spec].append(_run(codec, delta or "fp32", args.steps, args.workers))
            print(f"{spec} run {i + 1}/{args.repeat}: held-out loss {made[spec][-1]['val_loss']:.3f}", flush=True)
    results = []
    for spec in specs:
        res = _median_of(made[spec])
        res["x_smaller"] = {k: dense / v if v else float("inf") for k, v in res["edges"].items()}
        res["late_worker_push_x_smaller"] = dense / res["late_worker_push_bytes_per_step"]
        results.append(res)
        print(f"\n{spec}: held-out loss {res['val_loss']:.3f}, median step {res['median_step_s'] * 1e3:.0f} ms, "
              f"wall {res['wall_s']:.0f} s over {res['versions']} versions", flush=True)
        for k, v in res["edges"].items():
            print(f"  {k:28s} {v / 1024:9.1f} KiB/step  ({dense / v if v else float('inf'):7.1f}x smaller "
                  "than dense fp32)", flush=True)
        late = res["late_worker_push_bytes_per_step"]
        print(f"  {'worker push, 2nd half':28s} {late / 1024:9.1f} KiB/step  ({dense / late:7.1f}x smaller "
              "than dense fp32)", flush=True)
    out = dict(benchmark="demo_codecs", params=params, dense_fp32_bytes=dense,
               settings=dict(steps=args.steps, workers=args.workers, topk_warmup_steps=WARMUP, repeat=args.repeat,
                             note="per-step figures average over every step, warm-up included; with "
                                  "repeat > 1 each figure is the median over the repeats"),
               machine=dict(platform=platform.platform(), cores=os.cpu_count(),
                            python=platform.python_version(), torch=torch.__version__),
               runs=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
