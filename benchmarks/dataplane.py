"""Data plane against the limit: push and pull of a large fp32 model through hps, side by side
with a plain Python TCP stream of the same bytes between two processes, in one run.

    python benchmarks/dataplane.py --params 100000000

Rows (each the median of --reps after one warm-up; the model is --params float32 values in keys of --key-elems):
- ``tcp``: one process sends the bytes with ``socket.sendall`` from a buffer, another reads
  them with ``recv_into`` into a buffer (no protocol at all): the limit on this machine;
- ``wire``: hps's own frames (ps.net.wire, identity serialisers) over gRPC to a server that
  does nothing with them: the transport alone, what the protocol costs over raw TCP;
- ``hps root``: a worker (this process) pushes a dense gradient straight to the root (one
  hop: ``ParameterClient.push`` returns once the root has applied it, SGD) and pulls the new
  version (``pull``: a dense fp32 delta, decoded, applied and checksum-verified);
- ``hps zone``: the same through one zone (worker -> zone -> root, the zone aggregating and
  forwarding the push, caching and serving the delta).
Each hps row runs with the servers on glibc's default allocator and with the allocator tuned
by environment (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=..., the setting ``hps launch``
gives its servers): glibc returns every >= 32 MiB buffer to the OS on free, so each large
message faults its pages in again. Ratio = TCP time / hps time (1.0 = as fast as raw TCP).
Goal: push and pull at least 0.8x of the TCP stream. Writes benchmarks/results/dataplane.json.
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
from pathlib import Path

import numpy as np
from _common import RESULTS, ROOT, met, plot, write

GOAL = 0.8
from ps.tools.launch import MALLOC_ENV as TUNED  # noqa: E402  (what hps launch gives its servers)


def _tcp_sender(port: int, nbytes: int, reps: int) -> None:
    buf = np.ones(nbytes // 4, np.float32)
    for _ in range(reps):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(memoryview(buf).cast("B"))
        s.recv(1)  # wait for the receiver's ack before the next rep
        s.close()


def tcp_stream(nbytes: int, reps: int) -> list[float]:
    """Seconds per transfer of nbytes from another process, measured at the receiver."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--tcp-sender", str(port), "--params", str(nbytes // 4),
                             "--reps", str(reps)], cwd=ROOT)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    times = []
    try:
        for _ in range(reps):
            conn, _ = srv.accept()
            t0 = time.perf_counter()
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:], min(nbytes - got, 1 << 22))
                if not n:
                    raise RuntimeError("sender closed early")
                got += n
            times.append(time.perf_counter() - t0)
            conn.sendall(b"k")
            conn.close()
    finally:
        proc.wait(60)
        srv.close()
    return times


def _wire_server(params: int, key_elems: int) -> None:
    """A gRPC server with hps's method table and frames that does nothing with them: Push
    reads every frame and acknowledges, Pull streams pre-encoded frames of the whole model."""
    import asyncio

    import grpc

    from ps.core.types import PullMeta, VersionMeta
    from ps.net.rpc import SERVER_OPTIONS
    from ps.net.wire import SERVICE, encode_pull_reply, pb

    frames = list(encode_pull_reply(PullMeta(1, 0, 1, False, 1), [(VersionMeta(1, 0), _chunks(params, key_elems))]))

    async def push(request_iterator, context):
        async for _ in request_iterator:
            pass
        return pb.PushAck(applied_version=1)

    async def pull(request, context):
        for f in frames:
            yield f

    async def serve():
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Push": grpc.stream_unary_rpc_method_handler(push, response_serializer=pb.PushAck.SerializeToString),
            "Pull": grpc.unary_stream_rpc_method_handler(pull, request_deserializer=pb.PullRequest.FromString)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


def _chunks(params: int, key_elems: int):
    from ps.core.codecs import get_codec
    from ps.core.tensors import split

    values = np.random.default_rng(1).standard_normal(params, dtype=np.float32)
    return split(_layout(params, key_elems), values, get_codec("fp32"))


def _layout(params: int, key_elems: int):
    from ps.core.view import KeySpec, Layout

    return Layout([KeySpec(f"layer{i}.weight", (min(key_elems, params - off),))
                   for i, off in enumerate(range(0, params, key_elems))])


def wire_rows(params: int, key_elems: int, reps: int, env: dict) -> dict:
    """hps's frames over gRPC to a server that does no work: the transport alone."""
    import grpc

    from ps.core.types import PushMeta
    from ps.net.rpc import CHANNEL_OPTIONS
    from ps.net.wire import encode_push, pb, stubs

    proc = subprocess.Popen([sys.executable, __file__, "--wire-server", "--params", str(params),
                             "--key-elems", str(key_elems)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    try:
        port = int(proc.stdout.readline())
        frames = encode_push(PushMeta("big", "w0", 1, 0), _chunks(params, key_elems))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        rpc = stubs(channel)
        push, pull = [], []
        for _ in range(reps + 1):  # the first is a warm-up (connection, first allocations)
            t0 = time.perf_counter()
            rpc["Push"](iter(frames), timeout=300)
            push.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = list(rpc["Pull"](pb.PullRequest(job="big"), timeout=300))
            pull.append(time.perf_counter() - t0)
            del got
        channel.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return dict(push_s=push[1:], pull_s=pull[1:], warm_up=dict(push_s=push[0], pull_s=pull[0]))


def hps_rows(params: int, key_elems: int, reps: int, through_zone: bool, env: dict) -> dict:
    from ps.core.config import JobConfig, OptimizerConfig
    from ps.tools.launch import Cluster
    from worker.client import ParameterClient

    layout = _layout(params, key_elems)
    topo = {"host": "127.0.0.1", "settings": {"heartbeat_s": 1.0, "member_timeout_s": 60.0},
            "root": {"name": "root", **({"zones": [{"name": "z"}]} if through_zone else {})}}
    values = np.random.default_rng(0).standard_normal(params, dtype=np.float32)
    grad = np.random.default_rng(1).standard_normal(params, dtype=np.float32) * 1e-3
    job = JobConfig(name="big", optimizer=OptimizerConfig(kind="sgd", lr=0.01), delta_log_length=2)
    push, pull = [], []
    with tempfile.TemporaryDirectory() as tmp, Cluster.start(topo, tmp, env=env, tune_malloc=bool(env)) as cluster:
        c = ParameterClient(cluster.address("z" if through_zone else "root"), "big", "w0",
                            timeout_s=300, round_timeout_s=300)
        try:
            c.create_job(job, layout, values)
            c.register()
            t0 = time.perf_counter()
            c.pull(min_version=c.start_version)
            snapshot = time.perf_counter() - t0
            for _ in range(reps + 1):  # the first is a warm-up (first allocations in every process)
                t0 = time.perf_counter()
                version, _ = c.push(grad)
                push.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.pull(min_version=version)
                pull.append(time.perf_counter() - t0)
        finally:
            c.close()
    return dict(push_s=push[1:], pull_s=pull[1:], warm_up=dict(push_s=push[0], pull_s=pull[0]),
                snapshot_pull_s=snapshot)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=100_000_000, help="float32 values in the model")
    p.add_argument("--key-elems", type=int, default=4_000_000, help="values per key (tensor)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rows", default="wire,root,zone",
                   help="rows to run: wire (gRPC + hps frames, no processing), root, zone")
    p.add_argument("--allocators", default="default,tuned", help="server allocators: default, tuned")
    p.add_argument("--tcp-sender", type=int, help=argparse.SUPPRESS)
    p.add_argument("--wire-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--alloc", default="default", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    nbytes = 4 * args.params
    if args.tcp_sender:
        _tcp_sender(args.tcp_sender, nbytes, args.reps)
        return 0
    if args.wire_server:
        _wire_server(args.params, args.key_elems)
        return 0

    if args.row:  # one row in a process of its own, so its allocator setting covers the client too
        where, env = args.row, TUNED if args.alloc == "tuned" else {}
        if where == "wire":
            r = wire_rows(args.params, args.key_elems, args.reps, env)
        else:
            r = hps_rows(args.params, args.key_elems, args.reps, where == "zone", env)
        print("RESULT " + json.dumps(r), flush=True)
        return 0

    # The machine is shared and its speed drifts: every row is compared with a TCP stream
    # measured just before it (each row's own reference), and all of them are kept.
    tcp_all: list[float] = []
    rows: dict[str, dict] = {}
    for where in args.rows.split(","):
        for alloc in args.allocators.split(","):
            name = {"wire": "gRPC + hps frames", "root": "hps push/pull at the root",
                    "zone": "hps push/pull through a zone"}[where] + f", {alloc} allocator"
            env = TUNED if alloc == "tuned" else {}
            tcp = tcp_stream(nbytes, args.reps)
            tcp_all += tcp
            t_tcp = statistics.median(tcp)
            out = subprocess.run([sys.executable, __file__, "--row", where, "--alloc", alloc, "--params",
                                  str(args.params), "--key-elems", str(args.key_elems), "--reps", str(args.reps)],
                                 cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                print(f"{name}: failed\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}", file=sys.stderr)
                rows[name] = dict(error=out.stderr[-500:])
                continue
            r = json.loads(line[len("RESULT "):])
            t_push, t_pull = statistics.median(r["push_s"]), statistics.median(r["pull_s"])
            r.update(tcp_s=tcp, push_vs_tcp=t_tcp / t_push, pull_vs_tcp=t_tcp / t_pull,
                     push_gb_s=nbytes / t_push / 1e9, pull_gb_s=nbytes / t_pull / 1e9)
            r["meets_goal"] = r["push_vs_tcp"] >= GOAL and r["pull_vs_tcp"] >= GOAL
            rows[name] = r
            print(f"{name:45s} push {t_push:6.3f}s ({r['push_vs_tcp']:.2f}x TCP)  pull {t_pull:6.3f}s "
                  f"({r['pull_vs_tcp']:.2f}x TCP; TCP just before: {t_tcp:.3f}s)", flush=True)
    write("dataplane", dict(
        settings=dict(params=args.params, bytes=nbytes, key_elems=args.key_elems, reps=args.reps,
                      optimizer="sgd (no state)", codec="fp32", tuned_allocator_env=TUNED),
        goal=f"push and pull at least {GOAL}x of the TCP stream (TCP time / hps time)",
        tcp=dict(seconds=tcp_all, gb_s_median=nbytes / statistics.median(tcp_all) / 1e9,
                 gb_s_best=nbytes / min(tcp_all) / 1e9), rows=rows), args.out)
    print(f"\n{args.params:,} float32 = {nbytes / 1e6:.0f} MB; TCP stream median {statistics.median(tcp_all):.3f}s "
          f"= {nbytes / statistics.median(tcp_all) / 1e9:.2f} GB/s (best {nbytes / min(tcp_all) / 1e9:.2f} GB/s)")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:45s} failed: {r['error'][-200:]}")
            continue
        print(f"{name:45s} push {r['push_vs_tcp']:.2f}x  pull {r['pull_vs_tcp']:.2f}x  (goal {GOAL}x: "
              f"{met(min(r['push_vs_tcp'], r['pull_vs_tcp']), GOAL)})")

    def draw(ax):
        names = [n for n, r in rows.items() if "error" not in r]
        ys = range(len(names))
        ax.barh([y + 0.2 for y in ys], [rows[n]["push_vs_tcp"] for n in names], 0.4, label="push")
        ax.barh([y - 0.2 for y in ys], [rows[n]["pull_vs_tcp"] for n in names], 0.4, label="pull")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.axvline(GOAL, color="grey", linestyle=":", label=f"goal {GOAL}x")
        ax.set_yticks(list(ys), names, fontsize=7)
        ax.set_xlabel("throughput as a multiple of a raw TCP stream (higher is better)")
        ax.set_title(f"{nbytes / 1e6:.0f} MB fp32 model: push and pull vs TCP")
        ax.legend(fontsize=8)

    plot(RESULTS / "dataplane.png" if not args.out else Path(args.out + ".png"), draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
