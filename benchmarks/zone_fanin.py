"""One zone with 4, 8, 16 and 32 workers on a small model (issue 18): aggregate samples per
second against 4 workers, and the CPU each round costs the zone (and the root).

    python benchmarks/zone_fanin.py                       # 4,8,16,32 workers, 2 repeats
    python benchmarks/zone_fanin.py --workers 4,8 --rounds 10 --repeats 1   # a smoke run

A root and one zone (``hps serve`` processes, started by PID through ``ps.tools.launch``, the
allocator `hps launch` uses). For each N, a bsp job of --numel parameters (default: the demo
model's 470,528, fp32 pushes) and N workers: ``ParameterClient``s, 4 threads to a process
(``_fanin_worker.py``), each pushing a seeded gradient and pulling the next version, every
worker of a round at the zone. Every worker joins (rank, wait for N) before the first push, so
every round has all N. After --warmup rounds, --rounds rounds are measured from the root's
version (polled every 20 ms): rounds per second, samples per second (N x --batch per round, a
nominal batch: the workers compute nothing, so this is the data path's ceiling, not a training
throughput), and the zone's and the root's CPU seconds per round (utime + stime from /proc).
Medians over --repeats runs of the whole list. Nothing is asserted.

On this 2-core machine the zone, the root and all the workers' processes share two cores:
the workers' own CPU (encoding, gRPC) competes with the zone's, so samples per second flatten
sooner than on a zone with cores of its own. The zone's CPU per round is the figure that
carries over.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import ROOT, plot, write

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.view import KeySpec, Layout
from ps.tools.launch import Cluster
from ps.tools.status import fetch_status
from worker import ParameterClient

THREADS = 4  # workers per process
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


# Leaves where a thread waits rather than works (py-spy samples threads blocked in C as active):
# the idle thread pool, gRPC's polling threads, the event loop's select.
_WAITING = ("Thread.run (threading.py", "_worker (concurrent/futures/thread.py", "EpollSelector.select (")


def top_frames(raw: Path, k: int = 8) -> list[tuple[str, float]]:
    """The leaf functions of a py-spy --format raw profile (collapsed stacks), by share of the
    samples not waiting (``_WAITING``)."""
    leaves: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        if leaf.startswith(_WAITING):
            continue
        leaves[leaf] = leaves.get(leaf, 0) + int(count)
        total += int(count)
    return [(f, c / max(total, 1)) for f, c in sorted(leaves.items(), key=lambda x: -x[1])[:k]]


def one(cluster: Cluster, n: int, numel: int, rounds: int, warmup: int, batch: int, tag: str,
        profile: Path | None = None) -> dict:
    job = f"fan{n}-{tag}"
    layout = Layout([KeySpec("w", (numel,))])
    boss = ParameterClient(cluster.address("root"), job, "creator", timeout_s=30)
    boss.create_job(JobConfig(name=job, optimizer=OptimizerConfig(kind="sgd", lr=1e-3), min_workers=n),
                    layout, np.zeros(numel, np.float32))
    boss.close()
    zone, root = cluster.tiers["z"].proc.pid, cluster.tiers["root"].proc.pid
    procs = []
    for first in range(0, n, THREADS):
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "_fanin_worker.py"), cluster.address("z"), job, str(numel),
             str(first), str(min(THREADS, n - first)), str(rounds), str(warmup), str(n)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    spy = None
    if profile is not None:  # the zone, sampled for the whole run (its idle time is not sampled)
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(zone), "-r", "50",
                                "--format", "raw", "-o", str(profile)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        marks: dict[int, tuple[float, float, float]] = {}
        deadline = time.monotonic() + 600
        while len(marks) < 2 and time.monotonic() < deadline:
            v = next((j.version for j in fetch_status(cluster.address("root")).jobs if j.name == job), 0)
            for want in (warmup, warmup + rounds):
                if v >= want and want not in marks:
                    marks[want] = (time.perf_counter(), cpu_seconds(zone), cpu_seconds(root))
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.02)
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes what it has
            spy.wait(timeout=30)
    if len(marks) < 2 or any(p.returncode for p in procs):
        errs = "\n".join(e[-1500:] for _, e in outs if e)
        raise RuntimeError(f"{n} workers did not finish their rounds:\n{errs}")
    (t0, z0, r0), (t1, z1, r1) = marks[warmup], marks[warmup + rounds]
    wall = t1 - t0
    return dict(workers=n, rounds=rounds, seconds=wall, rounds_per_s=rounds / wall,
                samples_per_s=n * batch * rounds / wall, zone_cpu_per_round_s=(z1 - z0) / rounds,
                root_cpu_per_round_s=(r1 - r0) / rounds, push_mb_per_round=4 * numel * n / 1e6)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="4,8,16,32")
    p.add_argument("--numel", type=int, default=470_528, help="parameters (default: the demo model's)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="nominal samples per worker per round")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true",
                   help="py-spy the zone during the last run of the most workers (needs py-spy; ptrace)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    ns = [int(x) for x in args.workers.split(",") if x]
    topo = {"host": "127.0.0.1", "settings": {"heartbeat_s": 0.5, "member_timeout_s": 30},
            "root": {"name": "root", "port": 0, "zones": [{"name": "z"}]}}
    runs: dict[int, list[dict]] = {n: [] for n in ns}
    profile: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="hps-fanin-") as logs, Cluster.start(topo, logs) as cluster:
        for rep in range(args.repeats):
            for n in ns:
                prof = (Path(logs) / "zone.raw") if args.profile and rep == args.repeats - 1 and n == ns[-1] else None
                r = one(cluster, n, args.numel, args.rounds, args.warmup, args.batch, f"r{rep}", prof)
                if prof is not None and prof.exists():
                    r["zone_profile_top"] = top_frames(prof)
                    profile = r["zone_profile_top"]
                runs[n].append(r)
                print(f"{n:3d} workers (run {rep + 1}): {r['rounds_per_s']:6.2f} rounds/s, "
                      f"{r['samples_per_s']:8.0f} samples/s, zone CPU {1e3 * r['zone_cpu_per_round_s']:6.1f} ms/round, "
                      f"root CPU {1e3 * r['root_cpu_per_round_s']:6.1f} ms/round", flush=True)
    rows = {}
    for n in ns:
        med = {k: statistics.median(r[k] for r in runs[n]) for k in
               ("rounds_per_s", "samples_per_s", "zone_cpu_per_round_s", "root_cpu_per_round_s")}
        rows[n] = dict(med, runs=runs[n])
    base = rows[ns[0]]["samples_per_s"]
    for n in ns:
        rows[n]["samples_vs_first"] = rows[n]["samples_per_s"] / base
        print(f"{n:3d} workers: {rows[n]['samples_per_s']:8.0f} samples/s = {rows[n]['samples_vs_first']:.2f}x "
              f"{ns[0]} workers; zone {1e3 * rows[n]['zone_cpu_per_round_s']:.1f} ms CPU per round "
              f"({1e3 * rows[n]['zone_cpu_per_round_s'] / n:.2f} ms per worker push)")
    for frame, share in profile:
        print(f"  zone, {ns[-1]} workers (py-spy, leaf functions, of samples not waiting): "
              f"{100 * share:5.1f}%  {frame}")
    path = write("zone_fanin", dict(zone_profile_top=profile, numel=args.numel, rounds=args.rounds,
                                    warmup=args.warmup, batch=args.batch,
                                    repeats=args.repeats, threads_per_process=THREADS,
                                    rows={str(n): r for n, r in rows.items()}), args.out)

    def draw(ax):
        ax.plot(ns, [rows[n]["samples_vs_first"] for n in ns], "o-", label=f"samples/s vs {ns[0]} workers")
        ax.plot(ns, [n / ns[0] for n in ns], "k--", label="linear")
        ax2 = ax.twinx()
        ax2.plot(ns, [1e3 * rows[n]["zone_cpu_per_round_s"] for n in ns], "s-", color="tab:red",
                 label="zone CPU ms per round")
        ax.set_xlabel("workers at one zone")
        ax.set_ylabel("aggregate samples/s (ratio)")
        ax2.set_ylabel("zone CPU per round (ms)")
        ax.legend(loc="upper left")
        ax2.legend(loc="lower right")
    plot(Path(str(path).removesuffix(".json") + ".png"), draw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
