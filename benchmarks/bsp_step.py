"""BSP step time of the demo model with N workers through root -> regions -> zones, and the
bytes each edge carries per step, measured side by side with the compute-only step in one run.

    python benchmarks/bsp_step.py --steps 40 --workers 4

Reports (and writes benchmarks/results/bsp_step.json):
- compute-only: forward + backward + Adam of the same model and batch in one process;
- the compute floor for N workers on this machine: N processes cannot step faster than
  compute-only x N / cores when N > cores (what BSP would cost with free communication);
- the measured BSP step (median over steps after the first 3, which include start-up);
- bytes per step on every edge, against the dense fp32 model size;
- with ``--tls both`` (the default): the same demo with mutual TLS on every edge (each tier on
  its own certificate from ``ps.tools.certs.init_certs`` in a temporary directory, the workers
  on a worker certificate; ``benchmarks/_tls.py``), run right after the plaintext one (in
  alternating order over ``--repeats``), and the ratio of the BSP steps (TLS / plaintext).
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

import grpc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ps.demo.corpus import BatchSampler, load_corpus  # noqa: E402
from ps.demo.model import ModelConfig, build_model  # noqa: E402


def compute_only(steps: int, batch: int) -> float:
    torch.set_num_threads(1)
    cfg = ModelConfig()
    model = build_model(cfg, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sampler = BatchSampler(load_corpus(), context=cfg.context, batch_size=batch, seed=0)
    times = []
    for _ in range(steps):
        x, y = sampler.next_batch()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def run_demo(args, loop: str, tls: bool) -> dict | None:
    """One ``hps demo`` (over mutual TLS with ``tls``): its summary, wall time and BSP step."""
    with tempfile.TemporaryDirectory() as tmp:
        demo = ["--steps", str(args.steps), "--workers", str(args.workers), "--batch", str(args.batch),
                "--out", str(Path(tmp, "demo"))]
        cmd = ([sys.executable, str(ROOT / "benchmarks" / "_tls.py"), "demo", str(Path(tmp, "certs")), "--", *demo]
               if tls else [sys.executable, "-m", "ps.tools.cli", "demo", *demo])
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                           env={**os.environ, "HPS_LOOP": loop})
        wall = time.monotonic() - t0
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
            return None
        summary = json.loads(Path(tmp, "demo", "summary.json").read_text())
    return dict(summary=summary, wall=wall, bsp=statistics.median(w["median_step_s"] for w in summary["workers"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--loops", default="asyncio,uvloop",
                   help="server event loops to run, comma-separated; the first is the headline")
    p.add_argument("--tls", choices=("plain", "both"), default="both",
                   help="plain: plaintext only; both: each run also with mutual TLS on every edge")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each (loop, plaintext/TLS); the figures are their medians")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bsp_step.json"))
    args = p.parse_args()

    alone = compute_only(args.steps, args.batch)
    variants = ["plain", "tls"] if args.tls == "both" else ["plain"]
    demos: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for loop in args.loops.split(","):
            for variant in (variants if rep % 2 == 0 else variants[::-1]):  # noise hits both alike
                d = run_demo(args, loop, variant == "tls")
                if d is None:
                    return 1
                demos.setdefault((loop, variant), []).append(d)
                print(f"  run {rep + 1}/{args.repeats} {loop:8s} {variant:5s} BSP step {d['bsp'] * 1000:7.1f} ms",
                      flush=True)
    runs = {loop: dict(summary=ds[0]["summary"], wall=statistics.median(d["wall"] for d in ds),
                       bsp=statistics.median(d["bsp"] for d in ds), bsp_runs=[d["bsp"] for d in ds])
            for (loop, variant), ds in demos.items() if variant == "plain"}
    tls_runs = {loop: dict(bsp=statistics.median(d["bsp"] for d in ds), bsp_runs=[d["bsp"] for d in ds],
                           wall=statistics.median(d["wall"] for d in ds))
                for (loop, variant), ds in demos.items() if variant == "tls"}
    loop = args.loops.split(",")[0]
    summary, wall, bsp = runs[loop]["summary"], runs[loop]["wall"], runs[loop]["bsp"]
    params = sum(p.numel() for p in build_model(ModelConfig(), 0).parameters())
    dense = 4 * params
    cores = os.cpu_count() or 1
    floor = alone * max(1.0, args.workers / cores)
    tiers = {t["tier"].strip(): t for t in summary["tiers"]}
    versions = max(t["version"] for t in tiers.values())
    edges = {}
    for name, t in tiers.items():
        role = t["role"]
        below = {"global": "region", "regional": "zone", "zone": "worker"}[role]
        edges[f"{below}s -> {name} (push)"] = t["push_in_bytes"] / versions
        edges[f"{name} -> {below}s (pull)"] = t["pull_out_bytes"] / versions
    result = dict(
        benchmark="bsp_step", machine=dict(platform=platform.platform(), cores=cores,
                                           python=platform.python_version(), torch=torch.__version__,
                                           grpc=grpc.__version__),
        settings=dict(steps=args.steps, workers=args.workers, batch=args.batch, params=params,
                      codec="fp32", optimizer="adam"),
        compute_only_step_s=alone, compute_floor_step_s=floor, bsp_step_s=bsp,
        bsp_over_compute_only=bsp / alone, bsp_over_floor=bsp / floor, demo_wall_s=wall,
        bsp_step_s_by_loop={k: v["bsp"] for k, v in runs.items()},
        repeats=args.repeats, bsp_step_s_runs={k: v["bsp_runs"] for k, v in runs.items()},
        tls=({k: dict(bsp_step_s=v["bsp"], bsp_step_s_runs=v["bsp_runs"], demo_wall_s=v["wall"],
                      plain_bsp_step_s=runs[k]["bsp"], tls_over_plain=v["bsp"] / runs[k]["bsp"],
                      tls_over_plain_by_run=[t / q for t, q in zip(v["bsp_runs"], runs[k]["bsp_runs"])])
              for k, v in tls_runs.items()} or None),
        dense_fp32_bytes=dense, bytes_per_step=edges,
        bytes_per_step_over_dense={k: v / dense for k, v in edges.items()},
        final_train_loss=statistics.mean(w["train_loss"] for w in summary["workers"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"model {params:,} parameters ({dense / 2**20:.2f} MiB fp32), {args.workers} workers, "
          f"{cores} cores, {args.steps} steps")
    print(f"compute-only step        {alone * 1000:8.1f} ms")
    print(f"compute floor ({args.workers}/{cores} cores) {floor * 1000:8.1f} ms")
    print(f"BSP step (median)        {bsp * 1000:8.1f} ms   = {bsp / alone:.2f}x compute-only, "
          f"{bsp / floor:.2f}x the floor")
    for k, v in runs.items():
        print(f"  server loop {k:8s}      {v['bsp'] * 1000:8.1f} ms")
    for k, v in tls_runs.items():
        print(f"with mutual TLS ({k})    {v['bsp'] * 1000:8.1f} ms   = {v['bsp'] / runs[k]['bsp']:.2f}x plaintext "
              f"({runs[k]['bsp'] * 1000:.1f} ms; medians of {args.repeats} run(s) each)")
    print("bytes per step per edge (sum over the edges of that kind below a tier):")
    for k, v in edges.items():
        print(f"  {k:28s} {v / 2**20:8.2f} MiB  ({v / dense:.2f}x dense fp32 model)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
