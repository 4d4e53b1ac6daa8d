"""What the root's write-ahead log costs per version: the write and the fsync of one record
(issue 18: "say what one fsync costs here and what share of a step it is").

    python benchmarks/wal_fsync.py                    # 30 appends per size, in a temp dir
    python benchmarks/wal_fsync.py --dir /mnt/volume  # where the root's checkpoint dir would be

Each row appends --appends records through the root's own ``ps.tiers.wal.WriteAheadLog`` (one
record per version, as the root writes them) and reports the median and 90th percentile of the
whole append and of its fsync alone (the log's own timer, ``WalStats.last_fsync_s``), and the
record's bytes. Sizes: the demo model's gradient ("demo": 470,528 parameters), 1M, 10M and 100M
parameters, each twice: a dense gradient (fp32, fp16 or int8 pushes sum to one; the record is
dense fp32) and a top-k job's aggregate ("topk": 4 workers' 1% each, ~4% of the entries set,
which the log writes sparse: indices and values). The append includes finding the set entries.
The share of a step is taken against the demo's measured BSP step (``results/bsp_step.json``,
when present), for the demo-sized record only. --jobs N also appends the demo record to N jobs'
logs at once, each from its own thread (as a root with N jobs does): the wall time of such a
round against one log's append. Nothing is asserted.
What it does not show: group commit (several versions or jobs per fsync) is not built, so there
is nothing to compare it with; a network volume (Kubernetes PVCs are often one) is slower than
this machine's disk, so run it there with --dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import RESULTS, write

from ps.tiers.wal import WriteAheadLog
from ps.tiers.walrecord import WalRecord

SIZES = {"demo": 470_528, "1M": 1_000_000, "10M": 10_000_000, "100M": 100_000_000}


def one(directory: Path, numel: int, appends: int, density: float = 1.0) -> dict:
    wal = WriteAheadLog(directory)
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(numel).astype(np.float32)
    if density < 1.0:  # the sum of top-k pushes: a random ~density of the entries set
        grad[rng.random(numel, dtype=np.float32) >= density] = 0
    total, fsync = [], []
    try:
        for v in range(1, appends + 1):
            t0 = time.perf_counter()
            wal.append(WalRecord(v, contributors=4, clock_min=0, grad=grad, keys=b"k" * 64))
            total.append(time.perf_counter() - t0)
            fsync.append(wal.stats.last_fsync_s)
    finally:
        wal.close()

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
    record = wal.stats.bytes_written / appends
    return dict(numel=numel, density=density, record_mb=record / 1e6, dense_mb=4 * numel / 1e6, appends=appends,
                append_ms_median=1e3 * statistics.median(total), append_ms_p90=1e3 * q(total, 0.9),
                fsync_ms_median=1e3 * statistics.median(fsync), fsync_ms_p90=1e3 * q(fsync, 0.9),
                write_gbps=record / 1e9 / max(1e-9, statistics.median(total) - statistics.median(fsync)))


def jobs_at_once(base: Path, numel: int, jobs: int, appends: int) -> dict:
    """``jobs`` logs (one per job, as the root keeps them) appending one version each at the same
    time, from their own threads as the root's jobs do: the wall time of each such round against
    one log's append. Nothing groups their fsyncs but the filesystem's journal."""
    wals = [WriteAheadLog(base / f"job{j}") for j in range(jobs)]
    grad = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    walls = []
    try:
        for v in range(1, appends + 1):
            ts = [threading.Thread(target=w.append, args=(WalRecord(v, 4, 0, grad, keys=b"k" * 64),))
                  for w in wals]
            t0 = time.perf_counter()
            [t.start() for t in ts]
            [t.join() for t in ts]
            walls.append(time.perf_counter() - t0)
    finally:
        for w in wals:
            w.close()
    return dict(numel=numel, jobs=jobs, appends=appends, round_ms_median=1e3 * statistics.median(walls),
                fsync_ms_median=1e3 * statistics.median(
                    [w.stats.total_fsync_s / max(1, w.stats.appends) for w in wals]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--appends", type=int, default=30)
    p.add_argument("--dir", help="where to write (default: a fresh temporary directory)")
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--density", type=float, default=0.04,
                   help="the top-k rows' share of entries set (default 0.04: 4 workers x 1%%)")
    p.add_argument("--jobs", type=int, default=4,
                   help="also append the demo-sized record to this many jobs' logs at once (0: skip)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hps-wal-"))
    step = None
    bsp = RESULTS / "bsp_step.json"
    if bsp.exists():
        step = json.loads(bsp.read_text()).get("bsp_step_s")
    rows = {}
    sizes = [s for s in args.sizes.split(",") if s]
    for size, kind, density in [(s, k, d) for s in sizes for k, d in (("dense", 1.0), ("topk", args.density))]:
        name, n = f"{size} {kind}", SIZES[size]
        appends = args.appends if n <= 10_000_000 else max(3, args.appends // 6)
        d = base / size
        r = one(d, n, appends, density)
        for f in d.iterdir():
            f.unlink()
        if step and size == "demo" and kind == "dense":
            r["share_of_demo_bsp_step"] = r["append_ms_median"] / 1e3 / step
        rows[name] = r
        print(f"{name:11s} {r['record_mb']:7.2f} MB: append {r['append_ms_median']:8.2f} ms median "
              f"({r['append_ms_p90']:.2f} p90), of which fsync {r['fsync_ms_median']:8.2f} ms "
              f"({r['fsync_ms_p90']:.2f} p90); {r['write_gbps']:.2f} GB/s of record outside the fsync"
              + (f"; {100 * r['share_of_demo_bsp_step']:.1f}% of the demo's BSP step ({1e3 * step:.0f} ms)"
                 if "share_of_demo_bsp_step" in r else ""), flush=True)
    together = None
    if args.jobs:
        together = jobs_at_once(base / "jobs", SIZES["demo"], args.jobs, args.appends)
        one_log = rows.get("demo dense", {}).get("append_ms_median")
        ratio = f", {together['round_ms_median'] / one_log:.2f}x one log's append" if one_log else ""
        print(f"{args.jobs} jobs' logs at once (demo dense): {together['round_ms_median']:.2f} ms per version of "
              f"all of them{ratio}", flush=True)
    where = str(base) if args.dir else f"a temporary directory ({base.parent})"
    write("wal_fsync", dict(directory=where, demo_bsp_step_s=step, rows=rows, jobs_at_once=together), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
