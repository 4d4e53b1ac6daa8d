"""Failover to an alternate regional master (issue 15): kill -9 of a regional master that is
never restarted, during BSP training, with and without an alternate parent for its zone.

    python benchmarks/failover.py                 # 3 kills per member timeout (1.5 s, 3 s)
    python benchmarks/failover.py --repeats 5 --member-timeouts 3
    python benchmarks/failover.py --back --steps 400   # eu-1 restarted: the zone moves back to it

The cluster: a root, regional masters eu-1 and eu-2, zone eu-a below eu-1 and eu-b below eu-2,
one worker process per zone (benchmarks/_failover_worker.py, a linear model in BSP). With an
alternate, eu-a runs with ``--parent eu-1,eu-2`` and eu-b with ``--parent eu-2,eu-1``. After a
few steps eu-1 is killed with SIGKILL and left dead.

Recovery: seconds from the kill to the first step the workers complete on a version made after
it (the lost training). Also counted: steps not applied (a worker told its gradient missed its
round), and worker pushes the root applied twice (hps_double_applied, must be 0). Without an
alternate the zone has nowhere to go: the run is watched for --stall-s seconds and reported
stalled if no version came (today's behaviour until the region is restarted by someone).
With --back, eu-1 is restarted once eu-a runs on eu-2 (same port): measured too, the seconds
from eu-1 serving again to eu-a back on it (it probes its first parent every member timeout and
moves after two ready answers, between two rounds), and the steps not applied over both moves.
Figures go to benchmarks/results/failover.json (failover_back.json with --back).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import failover_workers, json_lines, write

from ps.tools.launch import Cluster
from ps.tools.status import fetch_status


def _topology(member_timeout_s: float, alternate: bool) -> dict:
    def zone(name: str, alt: str) -> dict:
        return {"name": name, "alternates": [alt]} if alternate else {"name": name}
    return {"host": "127.0.0.1", "settings": {"heartbeat_s": min(0.5, member_timeout_s / 6),
                                              "member_timeout_s": member_timeout_s},
            "root": {"name": "root", "port": 0},
            "regions": [{"name": "eu-1", "zones": [zone("eu-a", "eu-2")]},
                        {"name": "eu-2", "zones": [zone("eu-b", "eu-1")]}]}


def _move_back(cluster: Cluster, timeout_s: float = 60.0) -> float:
    """Once eu-a runs on eu-2, restart eu-1; seconds from it serving to eu-a back on it."""
    home, away = cluster.address("eu-1"), cluster.address("eu-2")
    deadline = time.monotonic() + timeout_s
    while fetch_status(cluster.address("eu-a")).parent != away:
        if time.monotonic() > deadline:
            raise SystemExit("eu-a never moved to its alternate")
        time.sleep(0.05)
    cluster.restart("eu-1")  # returns once it printed its ready line
    serving = time.monotonic()
    while fetch_status(cluster.address("eu-a")).parent != home:
        if time.monotonic() > serving + timeout_s:
            raise SystemExit(f"eu-a did not move back to eu-1 within {timeout_s:g}s")
        time.sleep(0.05)
    return time.monotonic() - serving


def one_run(member_timeout_s: float, alternate: bool, steps: int, kill_after: int, stall_s: float,
            logdir: Path, back: bool = False) -> dict:
    procs: list[subprocess.Popen] = []
    with Cluster.start(_topology(member_timeout_s, alternate), logdir / "logs") as cluster:
        try:
            procs += failover_workers(cluster, ("eu-a", "eu-b"), steps, logdir)
            first = [json_lines(p, kill_after, 120, stamped=True) for p in procs]
            if not all(len(f) == kill_after for f in first):
                raise SystemExit(f"no training before the kill; logs under {logdir}")
            last = max(e["version"] for f in first for _, e in f)
            cluster.stop_tier("eu-1", signal.SIGKILL)
            killed, killed_wall = time.monotonic(), time.time()
            if not alternate:
                # eu-a's worker: its zone has nowhere to go (eu-b's region trains on alone once
                # the root drops eu-1 after the member timeout)
                got = json_lines(procs[0], 1, stall_s, stamped=True)
                moved = [e for _, e in got if e["version"] > last + 1]
                return dict(alternate=False, stalled=not moved, watched_s=stall_s,
                            recovery_s=(got[-1][0] - killed) if moved else None)
            back_s = _move_back(cluster) if back else None
            rest = [json_lines(p, steps - kill_after, 180, stamped=True) for p in procs]
            if not all(len(r) == steps - kill_after for r in rest):
                raise SystemExit(f"training stopped after the kill; logs under {logdir}")
            if back_s is not None and fetch_status(cluster.address("eu-a")).parent != cluster.address("eu-1"):
                raise SystemExit(f"eu-a left eu-1 again; logs under {logdir}")
            # the workers' own clocks: with --back the lines are read only after the move back
            resumed = min(e["t"] for r in rest for _, e in r if e["version"] > last + 1)
            (job,) = fetch_status(cluster.address("root")).jobs
            return dict(alternate=True, recovery_s=round(resumed - killed_wall, 3),
                        not_applied=sum(not e["applied"] for r in rest for _, e in r),
                        double_applied=job.stats.double_applied, versions=job.version, steps=steps,
                        **({} if back_s is None else dict(back_s=round(back_s, 3))))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--member-timeouts", default="1.5,3", help="seconds, comma-separated")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kill-after", type=int, default=8)
    ap.add_argument("--stall-s", type=float, default=20.0)
    ap.add_argument("--back", action="store_true", help="restart eu-1 and time the zone's move back (no "
                    "run without an alternate)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hps-failover-") as tmp:
        for mt in (float(x) for x in args.member_timeouts.split(",")):
            runs = []
            for r in range(args.repeats):
                d = Path(tmp) / f"alt-{mt}-{r}"
                d.mkdir()
                runs.append(one_run(mt, True, args.steps, args.kill_after, args.stall_s, d, args.back))
                print(f"member timeout {mt:g}s, alternate: {runs[-1]}", flush=True)
            rec = [x["recovery_s"] for x in runs]
            if runs:
                rows.append(dict(member_timeout_s=mt, alternate=True, runs=runs,
                                 recovery_median_s=statistics.median(rec), recovery_max_s=max(rec),
                                 double_applied=sum(x["double_applied"] for x in runs),
                                 not_applied=sum(x["not_applied"] for x in runs),
                                 **({} if not args.back else dict(
                                     back_median_s=statistics.median(x["back_s"] for x in runs),
                                     back_max_s=max(x["back_s"] for x in runs)))))
            if args.back:
                continue
            d = Path(tmp) / f"none-{mt}"
            d.mkdir()
            base = one_run(mt, False, args.steps, args.kill_after, args.stall_s, d)
            print(f"member timeout {mt:g}s, no alternate: {base}", flush=True)
            rows.append(dict(member_timeout_s=mt, **base))
    path = write("failover_back" if args.back else "failover", dict(rows=rows, goal="under 5 s of lost training"),
                 args.out)
    for row in rows:
        if row["alternate"]:
            print(f"member timeout {row['member_timeout_s']:g}s: recovery median {row['recovery_median_s']:.2f}s, "
                  f"max {row['recovery_max_s']:.2f}s; steps not applied {row['not_applied']}, applied twice "
                  f"{row['double_applied']}" + (f"; back on eu-1 {row['back_median_s']:.2f}s (median) / "
                                                f"{row['back_max_s']:.2f}s (max) after it served again"
                                                if "back_median_s" in row else ""))
        else:
            print(f"member timeout {row['member_timeout_s']:g}s without an alternate: "
                  f"{'stalled for all ' + str(row['watched_s']) + 's watched' if row['stalled'] else row}")
    print(f"wrote {path}")
    bad = any(r.get("double_applied") for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
