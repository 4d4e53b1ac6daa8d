"""What a BSP step costs before any byte: push and pull of a tiny job, hop by hop, beside a bare
gRPC call on the same machine.

    python benchmarks/step_latency.py                 # ~1 minute on 2 cores
    python benchmarks/step_latency.py --profile       # and py-spy of the root for the one-worker row

The tiers are ``hps launch``'s (root, 2 regions x 2 zones, as bsp_vs_gloo.py); workers are
threads of this process, each a ``ParameterClient``. Rows, each the median of every call after
the first --skip, per worker (the slowest worker's figure reported):

- ``tree``: two workers, one per region (worker -> zone -> regional -> root, and back);
- ``one zone``: both workers on one zone (zone -> regional -> root);
- ``root``: both workers straight at the root;
- ``root, one worker``: one worker at the root; and on its channel a ``pull`` with nothing new
  and a bare unary ``Status`` call (gRPC's own round trip, no hps work).

A push's time runs until the root's acknowledgement is back at the worker (the round closed,
the version applied and published), a pull's until the new version is applied at the worker.
Writes benchmarks/results/step_latency.json. No goal of its own: it says where bsp_vs_gloo.py's
fixed per-step cost goes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time

import numpy as np
from _common import RESULTS, write
from bsp_vs_gloo import TOPOLOGY


def _job(name: str, params: int):
    from ps.core.config import JobConfig, OptimizerConfig
    from ps.core.view import KeySpec, Layout

    return (JobConfig(name=name, optimizer=OptimizerConfig(kind="sgd", lr=0.01)), Layout([KeySpec("w", (params,))]))


def _row(addresses: list[str], name: str, args) -> dict:
    """Workers (one per address) stepping in BSP: push, then pull the version that applied it."""
    from worker import ParameterClient

    job, layout = _job(name, args.params)
    clients = [ParameterClient(a, name, f"w{i}", timeout_s=60) for i, a in enumerate(addresses)]
    times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(clients))}
    try:
        clients[0].create_job(job, layout, np.zeros(args.params, np.float32))
        for c in clients:
            c.register()
            c.pull(min_version=0)

        def run(i: int) -> None:
            g = np.ones(args.params, np.float32)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                v, _ = clients[i].push(g)
                t1 = time.perf_counter()
                clients[i].pull(min_version=v)
                times[i].append((t1 - t0, time.perf_counter() - t1))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        for c in clients:
            c.close()
    per = [(statistics.median(p for p, _ in ts[args.skip:]), statistics.median(q for _, q in ts[args.skip:]))
           for ts in times.values()]
    return dict(push_ms=round(1000 * max(p for p, _ in per), 2), pull_ms=round(1000 * max(q for _, q in per), 2),
                workers=len(clients), calls=args.steps - args.skip)


def _calls(address: str, name: str, args, profile_pid: int | None) -> dict:
    """One worker at the root: its push and pull, a pull with nothing new, a bare Status call."""
    import grpc

    from ps.net.wire import pb, stubs
    from worker import ParameterClient

    def median_ms(fn, n: int) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return round(1000 * statistics.median(ts[args.skip:]), 2)

    job, layout = _job(name, args.params)
    c = ParameterClient(address, name, "w0", timeout_s=60)
    out: dict = {}
    try:
        c.create_job(job, layout, np.zeros(args.params, np.float32))
        c.register()
        c.pull(min_version=0)
        g = np.ones(args.params, np.float32)
        push, pull = [], []
        spy = None
        if profile_pid is not None:
            spy = subprocess.Popen(["py-spy", "record", "-p", str(profile_pid), "-d", "10", "-r", "200", "-f", "raw",
                                    "-o", str(RESULTS / "step_latency_root.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(args.steps * (4 if spy else 1)):
            t0 = time.perf_counter()
            v, _ = c.push(g)
            t1 = time.perf_counter()
            c.pull(min_version=v)
            push.append(t1 - t0)
            pull.append(time.perf_counter() - t1)
        if spy is not None:
            spy.wait(60)
            out["profile"] = str(RESULTS / "step_latency_root.txt")
        out.update(push_ms=round(1000 * statistics.median(push[args.skip:]), 2),
                   pull_ms=round(1000 * statistics.median(pull[args.skip:]), 2),
                   pull_nothing_new_ms=median_ms(lambda: c.pull(min_version=0), args.steps))
        with grpc.insecure_channel(address) as ch:
            status = stubs(ch)["Status"]
            out["status_unary_ms"] = median_ms(lambda: status(pb.StatusRequest(), timeout=10), args.steps)
    finally:
        c.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=1000)
    p.add_argument("--steps", type=int, default=100, help="calls per worker and row")
    p.add_argument("--skip", type=int, default=5, help="first calls left out of each median")
    p.add_argument("--profile", action="store_true", help="py-spy the root during the one-worker row")
    p.add_argument("--out")
    args = p.parse_args()
    if args.skip >= args.steps:
        p.error("--skip must be below --steps")
    from ps.tools.launch import Cluster

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, Cluster.start(TOPOLOGY, tmp) as cluster:
        at = cluster.address
        rows["tree"] = _row([at("eu-a"), at("us-a")], "lat-tree", args)
        rows["one zone"] = _row([at("eu-a"), at("eu-a")], "lat-zone", args)
        rows["root"] = _row([at("root"), at("root")], "lat-root", args)
        rows["root, one worker"] = _calls(at("root"), "lat-one", args,
                                          cluster.tiers["root"].proc.pid if args.profile else None)
    for name, r in rows.items():
        extra = "".join(f", {k[:-3].replace('_', ' ')} {v} ms" for k, v in r.items()
                        if k.endswith("_ms") and k not in ("push_ms", "pull_ms"))
        print(f"{name:18s} push {r['push_ms']:7.2f} ms  pull {r['pull_ms']:7.2f} ms{extra}", flush=True)
    write("step_latency", dict(settings=vars(args), topology="root, 2 regions x 2 zones (bsp_vs_gloo.py's)",
                               rows=rows), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
