"""An outer job while its root is down (issue 17): does each region keep training?

    python benchmarks/outer_outage.py                       # 2 runs a side, root down 8 s
    python benchmarks/outer_outage.py --repeats 1 --down-s 15

deploy/wan.yaml's tree (2 regions x 2 zones, each region's link to the root 100 ms round trip,
100 Mbit/s each way), the root with a checkpoint directory, the demo model's outer job as
benchmarks/wan_loss.py runs it (H=10, int8 pseudo-gradients and outer deltas, AdamW 3e-3
inside each region, one worker per zone, --steps each). Once every worker has made --kill-at
steps the root is killed with SIGKILL, left dead --down-s seconds, and restarted on its port
(from its checkpoint and log). Side by side, alternating: ``sync_wait_s`` 0 (the default: a
region waits for each sync, so it stops at its next one until the root is back) against
--sync-wait-s (a region trains on without a sync that has not landed by then).

Reported per run: the inner steps the workers made while the root was down (from the kill to
the restarted root's ready line; the workers' own clocks), the wall time of the whole run, the
final validation loss (mean over workers), and at each regional master the syncs postponed,
failed and made and the inner steps lost (must be 0). Figures go to
benchmarks/results/outer_outage.json.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import ROOT, write

from ps.demo.run import read_events
from ps.tools.launch import Cluster, load_topology
from ps.tools.status import fetch_status

WORKER = str(ROOT / "benchmarks" / "_wan_worker.py")
ZONES = ("eu-a", "eu-b", "us-a", "us-b")


def _job(wait_s: float) -> dict:
    return dict(name=f"outage-w{wait_s:g}", mode="outer", push_codec="fp32", relay_codec="fp32",
                delta_codec="fp32", min_workers=len(ZONES), optimizer=dict(kind="adamw", lr=3e-3, warmup_steps=20),
                outer=dict(inner_steps=10, codec="int8", delta_codec="int8", sync_wait_s=wait_s))


def one_run(wait_s: float, steps: int, kill_at: int, down_s: float, logdir: Path) -> dict:
    topo = load_topology(str(ROOT / "deploy" / "wan.yaml"))
    topo["root"]["checkpoint_dir"] = str(logdir / "ckpt")
    job = _job(wait_s)
    with Cluster.start(topo, logdir / "logs") as cluster:
        q: queue.Queue = queue.Queue()
        procs = []
        try:
            for i, z in enumerate(ZONES):
                p = subprocess.Popen([sys.executable, WORKER, "--address", cluster.address(z), "--worker-id", f"w{i}",
                                      "--seed", str(i), "--steps", str(steps), "--job", json.dumps(job)],
                                     stdout=subprocess.PIPE, stderr=open(logdir / f"w{i}.log", "wb"), text=True,
                                     cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                                    "HPS_RUN_ID": f"outage-{wait_s:g}"})
                procs.append(p)
                threading.Thread(target=read_events, args=(p, q), daemon=True).start()
            events: list[dict] = []
            done: dict[str, int] = {}
            killed = back = None
            exited = 0
            deadline = time.monotonic() + 900
            while exited < len(procs):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the run did not finish; logs under {logdir}")
                try:
                    ev = q.get(timeout=0.2)
                except queue.Empty:
                    ev = None
                if ev is not None:
                    if ev["event"] == "exit":
                        exited += 1
                        continue
                    events.append(ev)
                    if ev["event"] == "step":
                        done[ev["worker"]] = ev["step"] + 1
                if killed is None and len(done) == len(procs) and min(done.values()) >= kill_at:
                    cluster.stop_tier("root", signal.SIGKILL)
                    killed = time.time()
                elif killed is not None and back is None and time.time() - killed >= down_s:
                    cluster.restart("root")  # returns once its ready line is out
                    back = time.time()
            regions = {}
            for r in ("eu", "us"):
                (j,) = fetch_status(cluster.address(r)).jobs
                s = j.stats
                regions[r] = dict(syncs=s.outer_syncs, sync_failures=s.outer_sync_failures,
                                  postponed=s.outer_syncs_postponed, inner_steps_lost=s.inner_steps_lost)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    finals = [e for e in events if e["event"] == "done"]
    if len(finals) != len(procs) or killed is None or back is None:
        raise SystemExit(f"{len(finals)} of {len(procs)} workers finished (kill {killed}, back {back}); "
                         f"logs under {logdir}")
    start = min(e["t"] for e in events if e["event"] == "start")
    during = [e for e in events if e["event"] == "step" and killed < e["t"] <= back]
    return dict(sync_wait_s=wait_s, down_s=round(back - killed, 2), steps_while_down=len(during) / len(procs),
                wall_s=round(max(e["t"] for e in finals) - start, 2),
                val_loss=round(sum(e["val_loss"] for e in finals) / len(finals), 4), regions=regions)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="steps per worker")
    ap.add_argument("--kill-at", type=int, default=30, help="kill the root once every worker made this many steps")
    ap.add_argument("--down-s", type=float, default=8.0, help="seconds the root stays dead")
    ap.add_argument("--sync-wait-s", type=float, default=2.0, help="the job's sync_wait_s in the other runs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    runs: dict[str, list] = {"0": [], f"{args.sync_wait_s:g}": []}
    with tempfile.TemporaryDirectory(prefix="hps-outage-") as tmp:
        for i in range(args.repeats):
            for wait in (0.0, args.sync_wait_s):
                d = Path(tmp) / f"w{wait:g}-{i}"
                d.mkdir()
                r = one_run(wait, args.steps, args.kill_at, args.down_s, d)
                print(json.dumps(r), flush=True)
                runs[f"{wait:g}"].append(r)
    summary = {w: dict(steps_while_down_median=statistics.median(r["steps_while_down"] for r in rs),
                       down_s_median=statistics.median(r["down_s"] for r in rs),
                       wall_s_median=statistics.median(r["wall_s"] for r in rs),
                       val_loss_median=statistics.median(r["val_loss"] for r in rs),
                       inner_steps_lost=sum(g["inner_steps_lost"] for r in rs for g in r["regions"].values()))
               for w, rs in runs.items()}
    for w, s in summary.items():
        print(f"sync_wait_s {w}: {s['steps_while_down_median']:.1f} steps per worker while the root was down "
              f"{s['down_s_median']:.1f}s; run {s['wall_s_median']:.1f}s; val loss {s['val_loss_median']:.4f}; "
              f"inner steps lost {s['inner_steps_lost']} (medians of {args.repeats})")
    write("outer_outage", dict(settings=vars(args), runs=runs, summary=summary), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
