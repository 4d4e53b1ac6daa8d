"""A hot-standby root (issue 15): what a kill -9 of the primary costs training, and what
synchronous replication costs every step.

    python benchmarks/standby.py                        # 5 takeovers per lease (1 s, 2 s); 5 x 2 cost runs
    python benchmarks/standby.py --repeats 3 --leases 2 --cost-runs 3

Takeover. A root pair (root-a primary, root-b started with --standby-of root-a, each with its own
checkpoint directory), a regional master eu listing both (``--parent root-a,root-b``), zones
eu-a and eu-b below it, one BSP worker process per zone (benchmarks/_failover_worker.py). After
--kill-after steps root-a is killed with SIGKILL and left dead. Measured: seconds from the kill
to the first step completed on a version made after it (the workers' own clocks), the versions
the workers were acknowledged that root-b does not hold with the same checksum... by
construction of the check: every worker's versions must run 1..STEPS with no gap (bsp: one
version a step, none lost, none doubled), pushes root-b applied twice (hps_double_applied, 0),
and steps refused as not applied (the round in flight at the kill; at most one).

Replication cost. One client pushes a dense fp32 gradient straight to the root and pulls the
next version, --cost-steps times; the root writes its log (fsync) either alone or with a
standby that must hold each record first (the acknowledgement waits for it). Runs alternate
(alone, with standby, alone, ...) --cost-runs times each; the figure is the median over runs of
each run's median step time, and the ratio. Figures go to benchmarks/results/standby.json.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import failover_workers, json_lines, write

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.view import KeySpec, Layout
from ps.tools.launch import Cluster
from ps.tools.status import fetch_status
from worker import ParameterClient

SETTINGS = {"heartbeat_s": 0.2, "member_timeout_s": 3.0}  # the member timeout's default


def _topology(tmp: Path, lease_s: float, standby: bool = True, regions: bool = True) -> dict:
    root: dict = {"name": "root-a", "port": 0, "checkpoint_dir": str(tmp / "a"), "lease_s": lease_s}
    if standby:
        root["standby"] = {"name": "root-b", "checkpoint_dir": str(tmp / "b"), "lease_s": lease_s}
    topo = {"host": "127.0.0.1", "settings": SETTINGS, "root": root}
    if regions:
        topo["regions"] = [{"name": "eu", "zones": [{"name": "eu-a"}, {"name": "eu-b"}]}]
    return topo


def takeover(lease_s: float, steps: int, kill_after: int, logdir: Path) -> dict:
    procs: list[subprocess.Popen] = []
    with Cluster.start(_topology(logdir, lease_s), logdir / "logs") as cluster:
        try:
            procs += failover_workers(cluster, ("eu-a", "eu-b"), steps, logdir)
            first = [json_lines(p, kill_after, 120) for p in procs]
            if not all(len(f) == kill_after for f in first):
                raise SystemExit(f"no training before the kill; logs under {logdir}")
            cluster.stop_tier("root-a", signal.SIGKILL)
            killed = time.time()
            rest = [json_lines(p, steps - kill_after, 180) for p in procs]
            for p in procs:
                p.wait(timeout=60)
            seen = [f + r for f, r in zip(first, rest)]
            before = max(e["version"] for s in seen for e in s if e["t"] < killed)
            after = [e["t"] for s in seen for e in s if e["version"] > before + 1]
            st = fetch_status(cluster.address("root-b"))
            (j,) = st.jobs
            complete = all([e["version"] for e in s] == list(range(1, steps + 1)) for s in seen)
            return dict(lease_s=lease_s, recovery_s=round(min(after) - killed, 3) if after else None,
                        versions_lost_or_out_of_order=0 if complete else 1,
                        steps_not_applied=sum(not e["applied"] for s in seen for e in s),
                        double_applied=j.stats.double_applied, root_b=f"{st.root_state} term {st.term}",
                        worker_exit=[p.returncode for p in procs], final_version=j.version)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def step_cost(standby: bool, numel: int, steps: int, logdir: Path, lease_s: float) -> float:
    """Median seconds of a push + pull of ``numel`` fp32 values straight to the root."""
    layout = Layout([KeySpec("w", (numel,))])
    with Cluster.start(_topology(logdir, lease_s, standby=standby, regions=False), logdir / "logs") as cluster:
        if standby:  # the standby in sync: versions wait for it from here on
            deadline = time.monotonic() + 60
            while "in sync with the primary" not in (logdir / "logs" / "root-b.log").read_text():
                if time.monotonic() > deadline:
                    raise SystemExit(f"the standby never synced; logs under {logdir}")
                time.sleep(0.05)
        c = ParameterClient(cluster.address("root-a"), "cost", "w0", timeout_s=30)
        c.create_job(JobConfig(name="cost", optimizer=OptimizerConfig(kind="sgd", lr=0.01)), layout,
                     np.zeros(numel, np.float32))
        c.register()
        c.pull()
        rng = np.random.default_rng(0)
        grad = rng.standard_normal(numel).astype(np.float32)
        times = []
        for s in range(steps + 3):
            t0 = time.perf_counter()
            v, _ = c.push(grad, clock=s)
            c.pull(min_version=v)
            times.append(time.perf_counter() - t0)
        if standby:
            assert fetch_status(cluster.address("root-b")).jobs[0].version == c.view.version
        c.close()
        return statistics.median(times[3:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="takeovers per lease")
    ap.add_argument("--leases", default="1,2", help="--lease-s values to measure takeovers at")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-after", type=int, default=10)
    ap.add_argument("--cost-runs", type=int, default=5, help="interleaved runs of each (alone, with standby)")
    ap.add_argument("--cost-steps", type=int, default=40)
    ap.add_argument("--sizes", default="65536,1048576", help="gradient sizes (fp32 values) for the cost")
    ap.add_argument("--skip-takeover", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict = dict(settings=SETTINGS, takeover={}, cost={})
    tmp = tempfile.mkdtemp(prefix="hps-standby-")  # logs kept on failure (SystemExit names them)
    if True:
        if not args.skip_takeover:
            for lease in [float(x) for x in args.leases.split(",")]:
                runs = []
                for i in range(args.repeats):
                    d = Path(tmp) / f"takeover-{lease}-{i}"
                    d.mkdir()
                    r = takeover(lease, args.steps, args.kill_after, d)
                    print(f"lease {lease:g}s run {i + 1}: {r}", flush=True)
                    runs.append(r)
                rec = [r["recovery_s"] for r in runs if r["recovery_s"] is not None]
                result["takeover"][f"lease_{lease:g}s"] = dict(
                    runs=runs, recovery_median_s=round(statistics.median(rec), 3) if rec else None,
                    recovery_max_s=max(rec) if rec else None,
                    versions_lost=sum(r["versions_lost_or_out_of_order"] for r in runs),
                    double_applied=sum(r["double_applied"] for r in runs),
                    steps_not_applied=sum(r["steps_not_applied"] for r in runs))
                print(f"lease {lease:g}s: {result['takeover'][f'lease_{lease:g}s']}", flush=True)
        if not args.skip_cost:
            for numel in [int(x) for x in args.sizes.split(",")]:
                alone, paired = [], []
                for i in range(args.cost_runs):
                    for standby, into in ((False, alone), (True, paired)):
                        d = Path(tmp) / f"cost-{numel}-{i}-{int(standby)}"
                        d.mkdir()
                        into.append(step_cost(standby, numel, args.cost_steps, d, lease_s=2.0))
                    print(f"{numel} values, run {i + 1}: alone {alone[-1] * 1e3:.2f} ms, with standby "
                          f"{paired[-1] * 1e3:.2f} ms", flush=True)
                a, p = statistics.median(alone), statistics.median(paired)
                result["cost"][str(numel)] = dict(
                    runs=args.cost_runs, steps_per_run=args.cost_steps, alone_ms=[round(x * 1e3, 3) for x in alone],
                    with_standby_ms=[round(x * 1e3, 3) for x in paired], alone_median_ms=round(a * 1e3, 3),
                    with_standby_median_ms=round(p * 1e3, 3), extra_ms=round((p - a) * 1e3, 3),
                    ratio=round(p / a, 3))
                print(f"{numel} values: {result['cost'][str(numel)]}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    write("standby", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
