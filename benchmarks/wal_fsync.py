"""What the root's write-ahead log costs per version: the write and the fsync of one record
(issue 18: "say what one fsync costs here and what share of a step it is").

    python benchmarks/wal_fsync.py                    # 30 appends per size, in a temp dir
    python benchmarks/wal_fsync.py --dir /mnt/volume  # where the root's checkpoint dir would be

Each row appends --appends records through the root's own ``ps.tiers.wal.WriteAheadLog`` (one
record per version, as the root writes them: the dense fp32 gradient it applied) and reports
the median and 90th percentile of the whole append and of its fsync alone (the log's own timer,
``WalStats.last_fsync_s``). Sizes: the demo model's gradient ("demo": 470,528 parameters), 1M,
10M and 100M parameters. The share of a step is taken against the demo's measured BSP step
(``results/bsp_step.json``, when present), for the demo-sized record only. Nothing is asserted.
What it does not show: group commit (several versions or jobs per fsync) is not built, so there
is nothing to compare it with; a network volume (Kubernetes PVCs are often one) is slower than
this machine's disk, so run it there with --dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import RESULTS, write

from ps.tiers.wal import WriteAheadLog
from ps.tiers.walrecord import WalRecord

SIZES = {"demo": 470_528, "1M": 1_000_000, "10M": 10_000_000, "100M": 100_000_000}


def one(directory: Path, numel: int, appends: int) -> dict:
    wal = WriteAheadLog(directory)
    grad = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
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
    return dict(numel=numel, record_mb=4 * numel / 1e6, appends=appends,
                append_ms_median=1e3 * statistics.median(total), append_ms_p90=1e3 * q(total, 0.9),
                fsync_ms_median=1e3 * statistics.median(fsync), fsync_ms_p90=1e3 * q(fsync, 0.9),
                write_gbps=4 * numel / 1e9 / max(1e-9, statistics.median(total) - statistics.median(fsync)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--appends", type=int, default=30)
    p.add_argument("--dir", help="where to write (default: a fresh temporary directory)")
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--out")
    args = p.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hps-wal-"))
    step = None
    bsp = RESULTS / "bsp_step.json"
    if bsp.exists():
        step = json.loads(bsp.read_text()).get("bsp_step_s")
    rows = {}
    for name in [s for s in args.sizes.split(",") if s]:
        n = SIZES[name]
        appends = args.appends if n <= 10_000_000 else max(3, args.appends // 6)
        d = base / name.split()[0]
        r = one(d, n, appends)
        for f in d.iterdir():
            f.unlink()
        if step and name == "demo":
            r["share_of_demo_bsp_step"] = r["append_ms_median"] / 1e3 / step
        rows[name] = r
        print(f"{name:6s} {r['record_mb']:7.1f} MB: append {r['append_ms_median']:8.2f} ms median "
              f"({r['append_ms_p90']:.2f} p90), of which fsync {r['fsync_ms_median']:8.2f} ms "
              f"({r['fsync_ms_p90']:.2f} p90); write {r['write_gbps']:.2f} GB/s"
              + (f"; {100 * r['share_of_demo_bsp_step']:.1f}% of the demo's BSP step ({1e3 * step:.0f} ms)"
                 if "share_of_demo_bsp_step" in r else ""), flush=True)
    write("wal_fsync", dict(directory=str(base) if args.dir else f"a temporary directory ({base.parent})",
                            demo_bsp_step_s=step, rows=rows), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
