"""BSP through the hps tree against torch.distributed (gloo all_reduce) of the same gradients,
N = 2 and N = 4 workers, side by side in one run.

    python benchmarks/bsp_vs_gloo.py --params 4000000 --steps 20 --workers 2,4

Every worker holds a --params float32 gradient (the same values on both sides, seeded by rank)
and runs --steps BSP steps (benchmarks/_peer.py):
- gloo: ``all_reduce`` (sum, ring) of the gradient, then the local SGD update; the process
  group runs in a network namespace of its own with only loopback (gloo's store binds every
  interface), or on 127.0.0.1 with GLOO_SOCKET_IFNAME=lo where namespaces are not available;
- hps, per codec: push to the worker's zone, up through its regional master to the root
  (root, 2 regions x 2 zones; N=2 puts one worker in each region), SGD at the root, then pull
  the new version back down. Codecs: fp32 (lossless), fp16 (pushes, relays' aggregates and the
  published deltas in fp16), topk (1% with error feedback at every sender, the root's deltas
  top-k too).
With ``--root-shards 1,2`` (issue 16) each N also runs the codecs with every worker straight at
the root (no relays: relays in front of root shards are not built), once at one root and once
at a root of 2 shards (the job's blocks placed over them by equal weights; every push cut by
shard, every pull joined): what spreading the root over processes does to a step, side by side.
The step time is each worker's median over the steps after the first two (start-up), the
slowest worker's reported. Goals, as hps step / gloo step: fp32 <= 1.5x, fp16 <= 1.0x,
topk 1% <= 0.2x (at least 5x faster than dense gloo). Writes benchmarks/results/bsp_vs_gloo.json
and bsp_vs_gloo.png.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from _common import RESULTS, ROOT, met, plot, write

PEER = str(ROOT / "benchmarks" / "_peer.py")
GOALS = {"fp32": 1.5, "fp16": 1.0, "topk": 0.2}
ZONES = ["eu-a", "us-a", "eu-b", "us-b"]  # N=2 -> one worker per region


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _netns() -> str | None:
    """A fresh network namespace with only loopback up, or None where that is not possible."""
    if os.geteuid() != 0:
        return None
    ns = f"hps-gloo-{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True, capture_output=True)
        return ns
    except (OSError, subprocess.CalledProcessError):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        return None


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"peer failed ({p.returncode}):\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _step(results: list[dict]) -> float:
    return max(statistics.median(r["times"][2:] or r["times"]) for r in results)


def run_gloo(n: int, params: int, steps: int, ns: str | None) -> float:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    prefix = ["ip", "netns", "exec", ns] if ns else []
    procs = [subprocess.Popen(prefix + [sys.executable, PEER, "gloo", "--rank", str(r), "--world", str(n),
                                        "--port", str(port), "--params", str(params), "--steps", str(steps)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for r in range(n)]
    try:
        return _step(_collect(procs, 600))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


TOPOLOGY = {"host": "127.0.0.1", "settings": {"heartbeat_s": 0.5, "member_timeout_s": 10.0},
            "root": {"name": "root"},
            "regions": [{"name": r, "zones": [{"name": f"{r}-a"}, {"name": f"{r}-b"}]} for r in ("eu", "us")]}


def run_hps(cluster, n: int, params: int, steps: int, codec: str, topk: float,
            at: str = "") -> tuple[float, dict]:
    """One job per codec (bench-<codec>) on the same cluster: jobs never see each other. Workers
    at zones in turn, or all at tier ``at`` (a root, or a sharded root's address)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for r in range(n):
        procs.append(subprocess.Popen(
            [sys.executable, PEER, "hps", "--rank", str(r), "--address", cluster.address(at or ZONES[r % 4]),
             "--worker-id", f"w{r}", "--params", str(params), "--steps", str(steps), "--codec", codec,
             "--topk", str(topk)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
        if r == 0:  # the first creates the job; the rest join it (all before the first push)
            time.sleep(1.0)
    try:
        res = _collect(procs, 900)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return _step(res), dict(up=statistics.mean(r["bytes"]["up"] for r in res),
                            down=statistics.mean(r["bytes"]["down"] for r in res))


def _codec_available(codec: str) -> str:
    from ps.core.config import JobConfig

    try:
        JobConfig(name="probe", push_codec=codec, delta_codec=codec)
        if codec == "topk":
            JobConfig(name="probe", push_codec="topk", topk=0.01)
    except Exception as exc:  # a field or codec the build does not have yet
        return f"not built yet: {exc}"
    return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=4_000_000, help="gradient size (float32 values)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", default="2,4")
    p.add_argument("--codecs", default="fp32,fp16,topk")
    p.add_argument("--topk", type=float, default=0.01)
    p.add_argument("--root-shards", default="",
                   help="also run every worker straight at a root of each of these shard counts, e.g. 1,2")
    p.add_argument("--out")
    args = p.parse_args()
    from ps.tools.launch import Cluster

    ns = _netns()
    rows: dict[str, dict] = {}
    try:
        for n in map(int, args.workers.split(",")):
            with tempfile.TemporaryDirectory() as tmp, Cluster.start(TOPOLOGY, tmp) as cluster:
                one_n(cluster, n, args, ns, rows)
            for shards in [int(k) for k in args.root_shards.split(",") if k]:
                root = {"name": "root", **({"shards": shards} if shards > 1 else {})}
                with tempfile.TemporaryDirectory() as tmp, \
                        Cluster.start({**TOPOLOGY, "root": root, "regions": []}, tmp) as cluster:
                    direct(cluster, n, shards, args, rows[f"N={n}"])
    finally:
        if ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    _report(args, ns, rows)
    return 0


def one_n(cluster, n: int, args, ns: str | None, rows: dict) -> None:
    gloo = run_gloo(n, args.params, args.steps, ns)
    row = rows[f"N={n}"] = dict(gloo_step_s=gloo, hps={})
    print(f"N={n}  gloo all_reduce step {gloo * 1000:8.1f} ms", flush=True)
    for codec in args.codecs.split(","):
        missing = _codec_available(codec)
        if missing:
            row["hps"][codec] = dict(status=missing)
            print(f"N={n}  hps {codec:5s} {missing}", flush=True)
            continue
        step, nbytes = run_hps(cluster, n, args.params, args.steps, codec, args.topk)
        ratio = step / gloo
        row["hps"][codec] = dict(step_s=step, vs_gloo=ratio, goal=GOALS.get(codec),
                                 meets_goal=ratio <= GOALS.get(codec, float("inf")),
                                 bytes_per_step_per_worker=nbytes)
        print(f"N={n}  hps {codec:5s} step {step * 1000:8.1f} ms = {ratio:.2f}x gloo "
              f"(goal <= {GOALS.get(codec)}x: {met(ratio, GOALS.get(codec, 9e9), False)}); "
              f"per worker up {nbytes['up'] / 1e6:.2f} MB down {nbytes['down'] / 1e6:.2f} MB", flush=True)


def direct(cluster, n: int, shards: int, args, row: dict) -> None:
    """Every codec with all ``n`` workers straight at a root of ``shards`` shards."""
    out = row.setdefault("direct", {})[f"{shards} root shard{'s' if shards > 1 else ''}"] = {}
    for codec in args.codecs.split(","):
        if _codec_available(codec):
            continue
        step, nbytes = run_hps(cluster, n, args.params, args.steps, codec, args.topk, at="root")
        ratio = step / row["gloo_step_s"]
        out[codec] = dict(step_s=step, vs_gloo=ratio, bytes_per_step_per_worker=nbytes)
        print(f"N={n}  hps {codec:5s} straight at {shards} root shard(s): step {step * 1000:8.1f} ms = "
              f"{ratio:.2f}x gloo", flush=True)


def _report(args, ns: str | None, rows: dict) -> None:
    write("bsp_vs_gloo", dict(
        settings=dict(params=args.params, bytes=4 * args.params, steps=args.steps, topk=args.topk,
                      topology="root, 2 regions x 2 zones; N=2: one worker per region",
                      direct=("rows[N].direct: every worker straight at a root of 1 or more shards "
                              "(equal weights), no relays" if args.root_shards else "not run"),
                      gloo="all_reduce sum (ring) + local SGD; "
                           + ("own netns, loopback only" if ns else "127.0.0.1, GLOO_SOCKET_IFNAME=lo"),
                      hps="push (applied at root, SGD) + pull of the new version"),
        goals={k: f"hps {k} step <= {v}x gloo's dense step" for k, v in GOALS.items()}, rows=rows), args.out)

    def draw(ax):
        labels = list(rows)
        kinds = ["gloo"] + args.codecs.split(",")
        width = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            vals = [rows[n]["gloo_step_s"] * 1000 if kind == "gloo" else rows[n]["hps"][kind].get("step_s", 0) * 1000
                    for n in labels]
            ax.bar([j + i * width for j in range(len(labels))], vals, width,
                   label="gloo all_reduce" if kind == "gloo" else f"hps {kind}")
        ax.set_xticks([j + width * (len(kinds) - 1) / 2 for j in range(len(labels))], labels)
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"BSP step, {4 * args.params / 1e6:.0f} MB gradient: hps tree vs gloo")
        ax.legend()

    plot(RESULTS / "bsp_vs_gloo.png" if not args.out else ROOT / (args.out + ".png"), draw)


if __name__ == "__main__":
    sys.exit(main())
