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
- ``hps root, N shards`` (``--shards 1,2,4``; issue 16): the same with the root spread over N
  root processes (``hps launch``'s ``shards: N``, equal weights): the worker cuts the push by
  shard and sends the parts at once, one thread per shard, and joins the pulls; each row
  reports each shard's bytes;
- ``hps zone``: the same through one zone (worker -> zone -> root, the zone aggregating and
  forwarding the push, caching and serving the delta).
Each hps row runs with the servers on glibc's default allocator and with the allocator tuned
by environment (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=..., the setting ``hps launch``
gives its servers): glibc returns every >= 32 MiB buffer to the OS on free, so each large
message faults its pages in again. Ratio = TCP time / hps time (1.0 = as fast as raw TCP).
Goal: push and pull at least 0.8x of the TCP stream. Writes benchmarks/results/dataplane.json.

Mutual TLS (``--tls both``, the default): each row on the allocators ``--tls-allocators``
names (tuned: what ``hps launch`` gives) runs twice, plaintext and with mutual TLS (every
tier on its own certificate from ``ps.tools.certs.init_certs`` in a temporary directory, the
worker on a worker certificate; ECDSA P-256, whatever cipher gRPC's BoringSSL negotiates),
one right after the other, in alternating order over ``--rounds`` rounds so that drift of a
shared machine hits both alike; each TLS row reports ``tls_over_plain``: its median time over
the plaintext row's (1.0 = TLS costs nothing, 2.0 = twice as long).
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

from ps.net.tls import TlsFiles

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


def _files(tls_dir: str | None, name: str) -> TlsFiles | None:
    """``name``'s certificate in a directory ``init_certs`` made, or None (plaintext)."""
    if not tls_dir:
        return None
    d = Path(tls_dir)
    return TlsFiles(str(d / f"{name}.crt"), str(d / f"{name}.key"), str(d / "ca.crt"))


def _wire_server(params: int, key_elems: int, tls_dir: str | None = None) -> None:
    """A gRPC server with hps's method table and frames that does nothing with them: Push
    reads every frame and acknowledges, Pull streams pre-encoded frames of the whole model."""
    import asyncio

    import grpc

    from ps.core.types import PullMeta, VersionMeta
    from ps.net.rpc import SERVER_OPTIONS
    from ps.net.tls import server_credentials
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
        tls = _files(tls_dir, "root")  # the root's certificate: clients verify it as a tier
        port = (server.add_secure_port("127.0.0.1:0", server_credentials(tls)) if tls
                else server.add_insecure_port("127.0.0.1:0"))
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


def wire_rows(params: int, key_elems: int, reps: int, env: dict, tls_dir: str | None = None) -> dict:
    """hps's frames over gRPC to a server that does no work: the transport alone."""
    import grpc

    from ps.core.types import PushMeta
    from ps.net.rpc import CHANNEL_OPTIONS
    from ps.net.tls import ClientTls, client_options
    from ps.net.wire import encode_push, pb, stubs

    proc = subprocess.Popen([sys.executable, __file__, "--wire-server", "--params", str(params),
                             "--key-elems", str(key_elems), *(["--tls-dir", tls_dir] if tls_dir else [])],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        port = int(proc.stdout.readline())
        frames = encode_push(PushMeta("big", "w0", 1, 0), _chunks(params, key_elems))
        tls = _files(tls_dir, "w0")
        channel = (grpc.secure_channel(f"127.0.0.1:{port}", ClientTls(tls).credentials(),
                                       options=CHANNEL_OPTIONS + client_options()) if tls
                   else grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS))
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


def hps_rows(params: int, key_elems: int, reps: int, through_zone: bool, env: dict,
             tls_dir: str | None = None, shards: int = 1) -> dict:
    from _tls import tls_cluster

    from ps.core.config import JobConfig, OptimizerConfig, ShardingConfig
    from ps.tools.launch import Cluster
    from worker.sharded import ShardedClient, connect

    layout = _layout(params, key_elems)
    topo = {"host": "127.0.0.1", "settings": {"heartbeat_s": 1.0, "member_timeout_s": 60.0},
            "root": {"name": "root", **({"zones": [{"name": "z"}]} if through_zone else {}),
                     **({"shards": shards} if shards > 1 else {})}}
    values = np.random.default_rng(0).standard_normal(params, dtype=np.float32)
    grad = np.random.default_rng(1).standard_normal(params, dtype=np.float32) * 1e-3
    job = JobConfig(name="big", optimizer=OptimizerConfig(kind="sgd", lr=0.01), delta_log_length=2,
                    sharding=ShardingConfig(weights=(1.0,) * shards) if shards > 1 else None)
    if tls_dir and shards > 1:
        raise ValueError("the TLS rows run at one root (certificates for root shards: not in this benchmark)")
    push, pull = [], []
    tls = _files(tls_dir, "w0")
    kind = tls_cluster({n: _files(tls_dir, n) for n in ("root", "z")}) if tls else Cluster
    with tempfile.TemporaryDirectory() as tmp, kind.start(topo, tmp, env=env, tune_malloc=bool(env)) as cluster:
        c = connect(cluster.address("z" if through_zone else "root"), "big", "w0",
                    timeout_s=300, round_timeout_s=300, tls=tls)
        try:
            c.create_job(job, layout, values)
            c.register()
            per_shard = ([4 * c.plan.shard_layout(i).numel for i in range(shards)]
                         if isinstance(c, ShardedClient) and c.plan is not None else [4 * params])
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
                snapshot_pull_s=snapshot, shards=shards, bytes_per_shard=per_shard)


def _run_row(args, where: str, alloc: str, tls_dir: str | None, shards: int = 1) -> dict:
    env = TUNED if alloc == "tuned" else {}
    out = subprocess.run([sys.executable, __file__, "--row", where, "--alloc", alloc, "--params",
                          str(args.params), "--key-elems", str(args.key_elems), "--reps", str(args.reps),
                          "--row-shards", str(shards),
                          *(["--tls-dir", tls_dir] if tls_dir else [])],
                         cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        print(f"{where}/{alloc}{' TLS' if tls_dir else ''}: failed\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}",
              file=sys.stderr)
        return dict(error=out.stderr[-500:])
    return json.loads(line[len("RESULT "):])


def measure(args, nbytes: int, certs: str | None) -> tuple[list[float], dict[str, dict]]:
    """Every row, each after a TCP stream of its own (its reference); with ``certs``, each row on
    --tls-allocators twice, plaintext and mutual TLS, in alternating order, ``--rounds`` times."""
    # The machine is shared and its speed drifts: every row is compared with a TCP stream
    # measured just before it (each row's own reference), and all of them are kept.
    tcp_all: list[float] = []
    rows: dict[str, dict] = {}
    shard_counts = [int(k) for k in args.shards.split(",")]
    for where, shards in [(w, k) for w in args.rows.split(",") for k in (shard_counts if w == "root" else [1])]:
        for alloc in args.allocators.split(","):
            name = {"wire": "gRPC + hps frames", "root": "hps push/pull at the root",
                    "zone": "hps push/pull through a zone"}[where] + f", {alloc} allocator"
            if shards > 1:
                name = name.replace("at the root", f"at {shards} root shards")
            variants = [(name, None)]
            if certs and alloc in args.tls_allocators.split(",") and shards == 1:
                variants.append((f"{name}, mutual TLS", certs))
            got: dict[str, dict] = {n: dict(push_s=[], pull_s=[], warm_ups=[], tcp_s=[]) for n, _ in variants}
            for rnd in range(args.rounds):
                tcp = tcp_stream(nbytes, args.reps)
                tcp_all += tcp
                for n, tls_dir in (variants if rnd % 2 == 0 else variants[::-1]):
                    r = _run_row(args, where, alloc, tls_dir, shards)
                    if "error" in r:
                        got[n]["error"] = r["error"]
                        continue
                    g = got[n]
                    g["push_s"] += r["push_s"]
                    g["pull_s"] += r["pull_s"]
                    g["tcp_s"] += tcp
                    g["warm_ups"].append(r["warm_up"])
                    if "bytes_per_shard" in r:
                        g["bytes_per_shard"] = r["bytes_per_shard"]
                    if "snapshot_pull_s" in r:
                        g.setdefault("snapshot_pull_s_all", []).append(r["snapshot_pull_s"])
                    print(f"  round {rnd + 1}/{args.rounds} {n:60s} push {statistics.median(r['push_s']):6.3f}s  "
                          f"pull {statistics.median(r['pull_s']):6.3f}s  (TCP {statistics.median(tcp):.3f}s)",
                          flush=True)
            for n, _ in variants:
                r = got[n]
                if "error" in r or not r["push_s"]:
                    rows[n] = dict(error=r.get("error", "no result"))
                    continue
                t_tcp = statistics.median(r["tcp_s"])
                t_push, t_pull = statistics.median(r["push_s"]), statistics.median(r["pull_s"])
                r.update(warm_up=r["warm_ups"][0], push_vs_tcp=t_tcp / t_push, pull_vs_tcp=t_tcp / t_pull,
                         push_gb_s=nbytes / t_push / 1e9, pull_gb_s=nbytes / t_pull / 1e9, runs=args.rounds)
                if "snapshot_pull_s_all" in r:
                    r["snapshot_pull_s"] = r["snapshot_pull_s_all"][0]
                r["meets_goal"] = r["push_vs_tcp"] >= GOAL and r["pull_vs_tcp"] >= GOAL
                rows[n] = r
                print(f"{n:60s} push {t_push:6.3f}s ({r['push_vs_tcp']:.2f}x TCP)  pull {t_pull:6.3f}s "
                      f"({r['pull_vs_tcp']:.2f}x TCP; TCP just before: {t_tcp:.3f}s)", flush=True)
            if len(variants) == 2 and "push_s" in rows.get(variants[0][0], {}) and "push_s" in rows.get(
                    variants[1][0], {}):
                plain, tls = rows[variants[0][0]], rows[variants[1][0]]
                tls["tls_over_plain"] = dict(
                    plain_row=variants[0][0], rounds=args.rounds, reps_per_round=args.reps,
                    push=statistics.median(tls["push_s"]) / statistics.median(plain["push_s"]),
                    pull=statistics.median(tls["pull_s"]) / statistics.median(plain["pull_s"]),
                    # per round (rows measured back to back): the spread of the ratio
                    push_by_round=[statistics.median(tls["push_s"][i:i + args.reps]) /
                                   statistics.median(plain["push_s"][i:i + args.reps])
                                   for i in range(0, min(len(tls["push_s"]), len(plain["push_s"])), args.reps)],
                    pull_by_round=[statistics.median(tls["pull_s"][i:i + args.reps]) /
                                   statistics.median(plain["pull_s"][i:i + args.reps])
                                   for i in range(0, min(len(tls["pull_s"]), len(plain["pull_s"])), args.reps)])
    return tcp_all, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=100_000_000, help="float32 values in the model")
    p.add_argument("--key-elems", type=int, default=4_000_000, help="values per key (tensor)")
    p.add_argument("--reps", type=int, default=3, help="timed pushes and pulls per row and round")
    p.add_argument("--rows", default="wire,root,zone",
                   help="rows to run: wire (gRPC + hps frames, no processing), root, zone")
    p.add_argument("--allocators", default="default,tuned", help="server allocators: default, tuned")
    p.add_argument("--tls", choices=("plain", "both"), default="both",
                   help="plain: plaintext rows only; both: each row on --tls-allocators also with mutual TLS")
    p.add_argument("--tls-allocators", default="tuned", help="allocators whose rows also run with mutual TLS")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every row (and its TLS twin, in alternating order) this many times")
    p.add_argument("--shards", default="1", help="root rows with the root as this many shards each, e.g. 1,2,4")
    p.add_argument("--row-shards", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--tcp-sender", type=int, help=argparse.SUPPRESS)
    p.add_argument("--wire-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--alloc", default="default", help=argparse.SUPPRESS)
    p.add_argument("--tls-dir", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    nbytes = 4 * args.params
    if args.tcp_sender:
        _tcp_sender(args.tcp_sender, nbytes, args.reps)
        return 0
    if args.wire_server:
        _wire_server(args.params, args.key_elems, args.tls_dir)
        return 0

    if args.row:  # one row in a process of its own, so its allocator setting covers the client too
        where, env = args.row, TUNED if args.alloc == "tuned" else {}
        if where == "wire":
            r = wire_rows(args.params, args.key_elems, args.reps, env, args.tls_dir)
        else:
            r = hps_rows(args.params, args.key_elems, args.reps, where == "zone", env, args.tls_dir,
                         args.row_shards)
        print("RESULT " + json.dumps(r), flush=True)
        return 0

    with tempfile.TemporaryDirectory() as certs:
        if args.tls == "both":
            from _tls import make_certs

            from ps.tools.certs import issue

            make_certs(certs, {"root": {"name": "root"}}, workers=["w0"])  # a CA, the root, worker w0
            issue(certs, "zone", "z", region="root")  # init_certs skips zones straight below the root
        tcp_all, rows = measure(args, nbytes, certs if args.tls == "both" else None)
    tls_rows = {n: r["tls_over_plain"] for n, r in rows.items() if "tls_over_plain" in r}
    write("dataplane", dict(
        settings=dict(params=args.params, bytes=nbytes, key_elems=args.key_elems, reps=args.reps,
                      rounds=args.rounds, optimizer="sgd (no state)", codec="fp32", tuned_allocator_env=TUNED,
                      root_shards=args.shards,
                      tls=args.tls, tls_allocators=args.tls_allocators if args.tls == "both" else "",
                      tls_certificates="ECDSA P-256 from ps.tools.certs.init_certs; tiers and worker each their own"),
        goal=f"push and pull at least {GOAL}x of the TCP stream (TCP time / hps time)",
        tcp=dict(seconds=tcp_all, gb_s_median=nbytes / statistics.median(tcp_all) / 1e9,
                 gb_s_best=nbytes / min(tcp_all) / 1e9), rows=rows, tls_over_plain=tls_rows), args.out)
    print(f"\n{args.params:,} float32 = {nbytes / 1e6:.0f} MB; TCP stream median {statistics.median(tcp_all):.3f}s "
          f"= {nbytes / statistics.median(tcp_all) / 1e9:.2f} GB/s (best {nbytes / min(tcp_all) / 1e9:.2f} GB/s)")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:60s} failed: {r['error'][-200:]}")
            continue
        print(f"{name:60s} push {r['push_vs_tcp']:.2f}x  pull {r['pull_vs_tcp']:.2f}x  (goal {GOAL}x: "
              f"{met(min(r['push_vs_tcp'], r['pull_vs_tcp']), GOAL)})")
    if tls_rows:
        print(f"\nwhat mutual TLS costs ({args.rounds} rounds x {args.reps} reps, medians; time with TLS / without):")
        print(f"{'row':46s} {'push GB/s plain':>15s} {'TLS':>6s} {'ratio':>6s}   {'pull GB/s plain':>15s} "
              f"{'TLS':>6s} {'ratio':>6s}")
        for name, t in tls_rows.items():
            plain, tls = rows[t["plain_row"]], rows[name]
            print(f"{t['plain_row']:46s} {plain['push_gb_s']:15.2f} {tls['push_gb_s']:6.2f} {t['push']:5.2f}x   "
                  f"{plain['pull_gb_s']:15.2f} {tls['pull_gb_s']:6.2f} {t['pull']:5.2f}x")

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
