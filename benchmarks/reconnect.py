"""How soon a child's channel answers again after its parent comes back, with gRPC's default
reconnect backoff and with the options every hps channel uses (ps.net.rpc.CHANNEL_OPTIONS).

    python benchmarks/reconnect.py                 # outages of 1, 3 and 6 s, 5 repetitions each
    python benchmarks/reconnect.py --quick

A server (the gRPC health service, so nothing of hps is measured but the channel) goes away for
D seconds and comes back on the same port. A client calls it every 20 ms throughout, as a
relay's heartbeat and follow loop do. What is reported is the time from the server listening
again to the client's first successful call: the time a region keeps training alone after the
root is back (the reliability issue measured up to 6.7 s with the defaults).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from concurrent import futures

import grpc
from _common import write
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ps.net.rpc import CHANNEL_OPTIONS

DEFAULT = [o for o in CHANNEL_OPTIONS if "backoff" not in o[0]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def one(options, outage_s: float) -> float:
    """Seconds from the server's return to the client's first answered call."""
    port = _free_port()
    server = _serve(port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    server.stop(0).wait()
    end = time.monotonic() + outage_s
    while time.monotonic() < end:  # the client keeps calling, as a relay does
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=0.2)
        except grpc.RpcError:
            pass
        time.sleep(0.02)
    server = _serve(port)
    back = time.monotonic()
    try:
        while time.monotonic() - back < 60:
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=0.2)
                return time.monotonic() - back
            except grpc.RpcError:
                time.sleep(0.02)
        return float("inf")
    finally:
        channel.close()
        server.stop(0).wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one outage length, 2 repetitions")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="result file (default benchmarks/results/reconnect.json)")
    args = p.parse_args(argv)
    outages, repeats = ([3.0], 2) if args.quick else ([1.0, 3.0, 6.0], args.repeats)
    rows = []
    for outage in outages:
        times = {"grpc default": [], "hps": []}
        for _ in range(repeats):  # interleaved, so both see the same machine
            times["grpc default"].append(one(DEFAULT, outage))
            times["hps"].append(one(CHANNEL_OPTIONS, outage))
        for name, ts in times.items():
            rows.append(dict(outage_s=outage, options=name, median_s=statistics.median(ts), max_s=max(ts),
                             runs=len(ts)))
            print(f"outage {outage:4.1f} s  {name:13s} back after median {statistics.median(ts):5.2f} s, "
                  f"max {max(ts):5.2f} s ({len(ts)} runs)")
    write("reconnect", dict(options={k: v for k, v in CHANNEL_OPTIONS if "backoff" in k}, rows=rows),
          args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
