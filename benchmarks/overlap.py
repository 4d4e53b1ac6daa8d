"""A bsp step with and without the worker's backward overlap (``HpsOptimizer(overlap=True)``),
side by side in one run.

    python benchmarks/overlap.py                       # ~6 min: 2 links x 2 modes x 2 repeats
    python benchmarks/overlap.py --links none --repeats 1 --steps 5

N workers (separate processes, one torch thread each) train an MLP (``--depth`` layers of
``--width``) in bsp through root -> zone, with fp32 pushes. Each link setting runs a fresh
cluster: ``none`` connects the workers to the zone directly (loopback), a number puts an
emulated link (``ps/tools/wanem.py``, ``--latency-ms`` round trip, that many Mbit/s each way,
shared by the workers) between the workers and their zone: a NIC slower than loopback, where
sending the gradient takes about as long as backward. Within a setting, the two modes
alternate over ``--repeats`` (off first, then on first), each a job of its own.

Reports (and writes benchmarks/results/overlap.json): per setting and mode the median step
(forward to ``step()``'s return, every worker's steps after ``--warmup``) and median backward
(longer with overlap where the encoding and sending threads share the cores with it),
and the ratio of the steps (overlap / without) per repeat and its median. The step without
overlap is the limit overlap is measured against: with backward fully hidden behind the push,
the step would shrink by at most backward's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, write

from ps.tools.launch import Cluster

WORKER = Path(__file__).resolve().parent / "_overlap_worker.py"


def one(address: str, job: str, overlap: bool, args) -> dict:
    """One job: ``args.workers`` worker processes; their steps and backwards, pooled."""
    procs = [subprocess.Popen([sys.executable, str(WORKER), address, job, f"w{i}", "1" if overlap else "0",
                               str(args.steps), str(args.warmup), str(args.width), str(args.depth), str(args.batch),
                               str(args.bucket_mb), str(args.workers)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(args.workers)]
    rows = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait(timeout=10)
            raise RuntimeError(f"job {job}: workers still running after {args.timeout_s}s") from None
        if p.returncode != 0:
            raise RuntimeError(f"job {job}: a worker exited with {p.returncode}:\n{err[-2000:]}")
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps = [s for r in rows for s in r["steps_s"]]
    backs = [s for r in rows for s in r["backward_s"]]
    return dict(step_ms=round(1000 * statistics.median(steps), 1),
                backward_ms=round(1000 * statistics.median(backs), 1), params=rows[0]["params"], steps=len(steps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=10, help="measured steps per worker and job")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--links", default="none,400", help="comma-separated: none (loopback) or Mbit/s")
    p.add_argument("--latency-ms", type=float, default=1.0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    settings = []
    for link in args.links.split(","):
        topo: dict = {"host": "127.0.0.1", "root": {"name": "root", "zones": [{"name": "z"}]}}
        if link != "none":
            topo["links"] = [{"name": "nic", "to": "z", "latency_ms": args.latency_ms,
                              "bandwidth_mbit": float(link)}]
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        with tempfile.TemporaryDirectory(prefix="hps-overlap-") as logs, \
                Cluster.start(topo, logs, env={"PYTHONPATH": os.pathsep.join(
                    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}) as cluster:
            address = cluster.address("nic" if link != "none" else "z")
            for r in range(args.repeats):
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                for mode in order:
                    got = one(address, f"ov-{link}-{r}-{mode}", mode == "on", args)
                    runs[mode].append(got)
                    print(f"link {link:>4}  repeat {r}  overlap {mode:3s}  step {got['step_ms']:7.1f} ms  "
                          f"backward {got['backward_ms']:6.1f} ms", flush=True)
        ratios = [on["step_ms"] / off["step_ms"] for on, off in zip(runs["on"], runs["off"], strict=True)]
        settings.append(dict(
            link=link, latency_ms=args.latency_ms if link != "none" else 0.0, runs=runs,
            step_off_ms=statistics.median(r["step_ms"] for r in runs["off"]),
            step_on_ms=statistics.median(r["step_ms"] for r in runs["on"]),
            backward_off_ms=statistics.median(r["backward_ms"] for r in runs["off"]),
            backward_on_ms=statistics.median(r["backward_ms"] for r in runs["on"]),
            ratio_on_off=round(statistics.median(ratios), 3), ratios=[round(x, 3) for x in ratios]))
    print(f"\n{'link':>8} {'step without':>13} {'with overlap':>13} {'ratio':>7}  {'backward without, with':>22}   "
          f"({args.workers} workers, {settings[0]['runs']['off'][0]['params'] / 1e6:.1f}M params, "
          f"{args.repeats} repeats, medians)")
    for s in settings:
        name = "loopback" if s["link"] == "none" else f"{s['link']} Mb/s"
        print(f"{name:>8} {s['step_off_ms']:11.1f}ms {s['step_on_ms']:11.1f}ms {s['ratio_on_off']:7.3f}  "
              f"{s['backward_off_ms']:12.1f}ms, {s['backward_on_ms']:.1f}ms")
    write("overlap", dict(args=vars(args), settings=settings), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
