"""Accuracy of the WAN link emulator (ps/tools/wanem.py): does a 100 ms / 100 Mbit link measure so?

    python benchmarks/wanem.py --latency-ms 100 --bandwidth-mbit 100

Starts the emulator as its own process (``python -m ps.tools.wanem``, as ``hps launch`` does) in
front of plain-socket servers in this process, then measures with plain sockets:
- round-trip time: median of --pings ping-pongs of 64-byte messages (the link's latency is a
  round-trip figure, so this should read --latency-ms), next to loopback without the relay;
- throughput each way: a --megabytes bulk transfer, timed at the receiver from its first to
  its last byte (so the latency is not counted as lost bandwidth);
- whether this kernel has ``tc netem`` (probed in a throw-away network namespace when root).
Goal: each figure within 10% of the link's. Writes benchmarks/results/wanem.json.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

from _common import ROOT, met, write


def _server(handler) -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)

    def loop():
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return s, s.getsockname()[1]


def _echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.close()


class _Sink:
    """Receives a bulk transfer; records its first and last byte's arrival."""

    def __init__(self) -> None:
        self.first = self.last = 0.0
        self.n = 0
        self.first_n = 0
        self.done = threading.Event()

    def __call__(self, conn: socket.socket) -> None:
        while data := conn.recv(1 << 20):
            now = time.perf_counter()
            if not self.n:
                self.first, self.first_n = now, len(data)
            self.n += len(data)
            self.last = now
        conn.close()
        self.done.set()

    @property
    def rate(self) -> float:  # bytes/s after the first read
        return (self.n - self.first_n) / max(self.last - self.first, 1e-9)


class _Source:
    """Sends a bulk transfer to whoever connects (the download direction)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, conn: socket.socket) -> None:
        block = b"\0" * (1 << 20)
        left = self.nbytes
        while left > 0:
            conn.sendall(block[:min(left, len(block))])
            left -= len(block)
        conn.close()


def _relay(target_port: int, latency_ms: float, bandwidth_mbit: float):
    proc = subprocess.Popen([sys.executable, "-m", "ps.tools.wanem", "--target", f"127.0.0.1:{target_port}",
                             "--latency-ms", str(latency_ms), "--bandwidth-mbit", str(bandwidth_mbit)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"relaying (\S+):(\d+) ->", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"emulator did not start: {line!r}")
    return proc, int(m.group(2))


def _ping(port: int, n: int) -> list[float]:
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"p" * 64
    times = []
    for _ in range(n + 2):
        t0 = time.perf_counter()
        c.sendall(msg)
        got = b""
        while len(got) < len(msg):
            got += c.recv(64 - len(got))
        times.append(time.perf_counter() - t0)
    c.close()
    return times[2:]  # the first include connection set-up


def _upload(port: int, sink: _Sink, nbytes: int) -> float:
    c = socket.create_connection(("127.0.0.1", port))
    block = b"\0" * (1 << 20)
    left = nbytes
    while left > 0:
        c.sendall(block[:min(left, len(block))])
        left -= len(block)
    c.close()
    sink.done.wait(120)
    return sink.rate


def _download(port: int) -> float:
    c = socket.create_connection(("127.0.0.1", port))
    sink = _Sink()
    sink(c)
    return sink.rate


def netem_available() -> str:
    if os.geteuid() != 0:
        return "unknown (probing needs root)"
    ns = f"hps-probe-{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True, capture_output=True)
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "10ms"], capture_output=True, text=True)
        return "yes" if r.returncode == 0 else f"no ({r.stderr.strip()})"
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"unknown ({exc})"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency-ms", type=float, default=100.0, help="the link's round-trip latency")
    p.add_argument("--bandwidth-mbit", type=float, default=100.0)
    p.add_argument("--pings", type=int, default=30)
    p.add_argument("--megabytes", type=float, default=25.0, help="bulk transfer size each way")
    p.add_argument("--out")
    args = p.parse_args()
    nbytes = int(args.megabytes * 1e6)

    echo, echo_port = _server(_echo)
    direct = statistics.median(_ping(echo_port, args.pings))
    proc, port = _relay(echo_port, args.latency_ms, args.bandwidth_mbit)
    try:
        rtts = _ping(port, args.pings)
    finally:
        proc.terminate()
        proc.wait(10)
    sink = _Sink()
    sink_srv, sink_port = _server(sink)
    proc, port = _relay(sink_port, args.latency_ms, args.bandwidth_mbit)
    try:
        up = _upload(port, sink, nbytes)
    finally:
        proc.terminate()
        proc.wait(10)
    src_srv, src_port = _server(_Source(nbytes))
    proc, port = _relay(src_port, args.latency_ms, args.bandwidth_mbit)
    try:
        down = _download(port)
    finally:
        proc.terminate()
        proc.wait(10)
    for s in (echo, sink_srv, src_srv):
        s.close()

    rtt = statistics.median(rtts)
    figures = dict(
        rtt_ms=dict(measured=rtt * 1000, p10=1000 * sorted(rtts)[len(rtts) // 10],
                    p90=1000 * sorted(rtts)[len(rtts) * 9 // 10], link=args.latency_ms,
                    loopback_without_relay=direct * 1000),
        upload_mbit=dict(measured=up * 8 / 1e6, link=args.bandwidth_mbit),
        download_mbit=dict(measured=down * 8 / 1e6, link=args.bandwidth_mbit))
    for f in figures.values():
        f["ratio"] = f["measured"] / f["link"]
        f["within_10pct"] = abs(f["ratio"] - 1) <= 0.10
    netem = netem_available()
    write("wanem", dict(
        settings=dict(latency_ms=args.latency_ms, bandwidth_mbit=args.bandwidth_mbit, pings=args.pings,
                      bulk_bytes=nbytes, latency_means="round trip; each direction delays by half"),
        goal="each figure within 10% of the link's", figures=figures, tc_netem_available=netem), args.out)
    print(f"link: {args.latency_ms:g} ms RTT, {args.bandwidth_mbit:g} Mbit/s each way; tc netem here: {netem}")
    print(f"loopback RTT without the relay {direct * 1e3:8.3f} ms")
    for name, f in figures.items():
        print(f"{name:14s} measured {f['measured']:8.2f}  link {f['link']:6g}  ratio {f['ratio']:.3f}  "
              f"{met(int(f['within_10pct']), 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
