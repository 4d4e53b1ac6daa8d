"""One process of ``zone_fanin.py``: THREADS workers of one bsp job at one zone, each a
``ParameterClient`` pushing a seeded gradient of the job's size and pulling the next version,
WARMUP + ROUNDS times, once all N workers of the job hold a rank (so every round has all of
them). Prints one JSON line per worker when done: {"worker", "versions", "seconds"}, the
seconds from its first measured push (after WARMUP rounds) to its last pull.

    python benchmarks/_fanin_worker.py ADDRESS JOB NUMEL FIRST THREADS ROUNDS WARMUP N
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
from _common import ROOT  # noqa: F401  (puts the project on the path)

from worker import ParameterClient


def run(address: str, job: str, numel: int, worker: int, rounds: int, warmup: int, n: int, out: list) -> None:
    c = ParameterClient(address, job, f"w{worker}", timeout_s=30, retry_s=60)
    c.register()
    c.rank()
    c.wait_workers(n, timeout_s=300)
    c.pull()
    grad = np.random.default_rng(worker).standard_normal(numel).astype(np.float32) * 1e-3
    t0 = time.perf_counter()
    versions = []
    for r in range(warmup + rounds):
        if r == warmup:
            t0 = time.perf_counter()
        v, _ = c.push(grad, clock=r)
        c.pull(min_version=v)
        versions.append(v)
    out.append(dict(worker=worker, versions=versions[warmup:], seconds=time.perf_counter() - t0))
    c.close()


def main() -> int:
    address, job, numel, first, threads, rounds, warmup, n = sys.argv[1:9]
    out: list[dict] = []
    ts = [threading.Thread(target=run, args=(address, job, int(numel), int(first) + i, int(rounds),
                                             int(warmup), int(n), out)) for i in range(int(threads))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for r in out:
        print(json.dumps(r), flush=True)
    return 0 if len(out) == int(threads) else 1


if __name__ == "__main__":
    raise SystemExit(main())
