"""What a job's creation costs a zone it goes through (issue 18: cut-through relays).

A worker creates a job of ``--params`` fp32 parameters (initial values included) at the root
and through a zone, alternating, ``--reps`` times each, on one cluster (``hps launch``'s
``Cluster``, plaintext, glibc's default allocator). For each create: its time, and the zone's
resident memory at its peak during the create over what it held just before (sampled from
/proc every 10 ms). A relay that assembles the values before sending them up holds them all
(4 bytes a parameter); one that passes the frames on as they arrive (cut through) holds a
frame or two.

    python benchmarks/create_through.py --params 25000000 --reps 3

Writes ``results/create_through.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """The highest resident size of ``pid`` while it runs, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.base = _rss(pid)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self.pid))
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._t.join(5)
        return max(0, self.peak - self.base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=25_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from ps.core.config import JobConfig, OptimizerConfig
    from ps.core.view import KeySpec, Layout
    from ps.tools.launch import Cluster
    from worker import ParameterClient

    n = args.params
    layout = Layout([KeySpec(f"k{i}", (min(4_000_000, n - i * 4_000_000),)) for i in range(-(-n // 4_000_000))])
    values = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    topo = {"host": "127.0.0.1", "settings": {"heartbeat_s": 1.0, "member_timeout_s": 60.0},
            "root": {"name": "root", "zones": [{"name": "z"}]}}
    rows: dict[str, list[dict]] = {"root": [], "zone": []}
    # glibc's default allocator: it returns a large array's pages when it is freed, so each
    # create's peak shows (with hps launch's tuned one the heap keeps the first create's pages).
    with tempfile.TemporaryDirectory() as tmp, Cluster.start(topo, tmp, tune_malloc=False, secure=False) as cluster:
        zone_pid = cluster.tiers["z"].proc.pid
        for rep in range(args.reps + 1):  # the first round warms both paths up (not kept)
            for where in ("root", "zone"):
                job = f"{where}-{rep}"
                c = ParameterClient(cluster.address("z" if where == "zone" else "root"), job, "w0",
                                    timeout_s=300)
                peak = _Peak(zone_pid)
                t0 = time.perf_counter()
                try:
                    c.create_job(JobConfig(name=job, optimizer=OptimizerConfig(kind="sgd", lr=0.01)), layout,
                                 values)
                    dt = time.perf_counter() - t0
                finally:
                    held = peak.stop()
                    c.close()
                if rep:
                    rows[where].append(dict(seconds=dt, zone_rss_over_base_bytes=held))
                print(f"{'warm-up' if not rep else f'rep {rep}'}: create at the {where}: {dt:.3f} s, "
                      f"zone's resident memory +{held / 1e6:.1f} MB", flush=True)
    med = {w: dict(seconds=statistics.median(r["seconds"] for r in rs),
                   zone_rss_over_base_bytes=statistics.median(r["zone_rss_over_base_bytes"] for r in rs))
           for w, rs in rows.items()}
    values_bytes = 4 * n
    print(f"median of {args.reps}: through the zone {med['zone']['seconds']:.3f} s against "
          f"{med['root']['seconds']:.3f} s at the root ({med['zone']['seconds'] / med['root']['seconds']:.2f}x); "
          f"the zone's peak over its base {med['zone']['zone_rss_over_base_bytes'] / 1e6:.1f} MB for "
          f"{values_bytes / 1e6:.0f} MB of values "
          f"({med['zone']['zone_rss_over_base_bytes'] / values_bytes:.3f}x)")
    write("create_through", dict(params=n, values_bytes=values_bytes, reps=args.reps, rows=rows, median=med),
          args.out)


if __name__ == "__main__":
    main()
