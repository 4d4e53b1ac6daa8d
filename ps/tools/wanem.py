"""A user-space WAN link emulator: a TCP proxy that delays and rate-limits what passes through.

    python -m ps.tools.wanem --target 127.0.0.1:7000 --latency-ms 100 --bandwidth-mbit 100
    # wanem: relaying 127.0.0.1:41234 -> 127.0.0.1:7000 (latency 100 ms RTT, 100 Mbit/s each way)

In-process (tests, benchmarks), here in front of a tier at ``address``:

>>> from ps.net.rpc import AsyncCaller
>>> from ps.net.wire import pb
>>> async def round_trip(target):
...     async with LinkProxy(Link(latency_ms=100, bandwidth_mbit=100), target) as proxy:
...         rpc = AsyncCaller(proxy.address)                # connect here instead
...         await rpc.call("ListJobs", pb.ListJobsRequest(), timeout=5)   # connected
...         t0 = time.perf_counter()
...         await rpc.call("ListJobs", pb.ListJobsRequest(), timeout=5)
...         await rpc.close()
...         return time.perf_counter() - t0
>>> asyncio.run(round_trip(address)) >= 0.1             # latency_ms is the round trip: never less
True

Point a child at the proxy instead of its parent and every byte between them crosses an
emulated link. gRPC works through it unchanged: it is only TCP. This exists because the
machines we run on have no ``netem`` qdisc (``tc tbf`` rate-limits, but cannot delay).

The model of a link (one per proxy, shared by every connection through it, each direction on
its own, i.e. full duplex):

- ``latency_ms`` is the **round-trip** time the link adds: each direction delays every byte by
  ``latency_ms / 2``. A ping-pong of small messages through the proxy therefore measures
  ``latency_ms`` (plus the loopback's few microseconds). A topology's "100 ms" edge means what
  ``ping`` across it would show.
- ``bandwidth_mbit`` paces each direction with a serialisation clock (a token bucket of one
  chunk): a chunk of n bytes leaves ``n * 8 / bandwidth`` after the previous one, then
  propagates for the one-way delay. Unlimited when 0.
- ``jitter_ms`` adds a uniform random 0..jitter to each chunk's one-way delay without ever
  reordering bytes (a chunk never arrives before the one ahead of it).
- ``loss_pct`` cannot drop bytes from a TCP stream without corrupting it, so it models what
  TCP does with a lost segment: a chunk that contains a lost 1448-byte segment (probability
  1 - (1 - p)^segments) arrives one extra round trip later, and the bytes behind it wait too
  (head-of-line blocking). Throughput collapse under loss (congestion control) is not modelled.

Each direction holds at most ``buffer_bytes`` in flight (default: two bandwidth-delay products,
at least 1 MiB); past it the proxy stops reading, so the sender's TCP window does the rest,
as it would behind a real bottleneck. Accuracy is measured by ``benchmarks/wanem.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass

__all__ = ["Link", "LinkProxy", "main"]

_CHUNK = 64 * 1024       # read size; also the granularity of pacing and delay
_MSS = 1448              # TCP payload per segment on a 1500-byte MTU, for loss_pct


@dataclass(frozen=True)
class Link:
    """One emulated edge; see the module docstring for what each number means."""

    latency_ms: float = 0.0        # round-trip time added (each direction: half)
    bandwidth_mbit: float = 0.0    # per direction; 0 = unlimited
    jitter_ms: float = 0.0         # extra one-way delay, uniform in [0, jitter_ms]
    loss_pct: float = 0.0          # per 1448-byte segment; a loss costs one extra round trip
    buffer_bytes: int = 0          # bytes in flight per direction before reading stops; 0 = auto

    def __post_init__(self) -> None:
        for name in ("latency_ms", "bandwidth_mbit", "jitter_ms"):
            v = getattr(self, name)
            if not (v >= 0 and v < float("inf")):
                raise ValueError(f"link {name} must be a finite number >= 0, got {v!r}")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"link loss_pct must be in [0, 100), got {self.loss_pct!r}")
        if self.buffer_bytes < 0:
            raise ValueError(f"link buffer_bytes must be >= 0, got {self.buffer_bytes!r}")

    @classmethod
    def from_spec(cls, spec: dict) -> Link | None:
        """The link a topology entry declares (``latency_ms``, ``bandwidth_mbit``, ``jitter_ms``,
        ``loss_pct``), or None when it declares none."""
        keys = ("latency_ms", "bandwidth_mbit", "jitter_ms", "loss_pct")
        if not any(spec.get(k) for k in keys):
            return None
        return cls(**{k: float(spec.get(k) or 0) for k in keys})

    @property
    def one_way_s(self) -> float:
        return self.latency_ms / 2000.0

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbit * 1e6 / 8.0

    @property
    def buffer(self) -> int:
        if self.buffer_bytes:
            return self.buffer_bytes
        bdp = self.bytes_per_s * self.latency_ms / 1000.0 if self.bandwidth_mbit else 0
        return max(1 << 20, int(2 * bdp))

    def describe(self) -> str:
        bw = f"{self.bandwidth_mbit:g} Mbit/s each way" if self.bandwidth_mbit else "unlimited bandwidth"
        extra = (f", jitter {self.jitter_ms:g} ms" if self.jitter_ms else "") + \
                (f", loss {self.loss_pct:g}%" if self.loss_pct else "")
        return f"latency {self.latency_ms:g} ms RTT, {bw}{extra}"


class _Direction:
    """One direction of the link: a serialisation clock shared by every connection."""

    def __init__(self, link: Link, rng: random.Random) -> None:
        self.link = link
        self.rng = rng
        self.free_at = 0.0     # when the link finishes serialising what it has accepted
        self.bytes = 0         # payload bytes carried (for reports)

    def schedule(self, n: int, now: float, after: float) -> float:
        """When n bytes read at ``now`` arrive at the far end (never before ``after``)."""
        link = self.link
        if link.bandwidth_mbit:
            start = max(now, self.free_at)
            self.free_at = start + n / link.bytes_per_s
            sent = self.free_at
        else:
            sent = now
        delay = link.one_way_s
        if link.jitter_ms:
            delay += self.rng.uniform(0.0, link.jitter_ms / 1000.0)
        if link.loss_pct:
            segments = -(-n // _MSS)
            if self.rng.random() < 1.0 - (1.0 - link.loss_pct / 100.0) ** segments:
                delay += 2 * link.one_way_s  # retransmitted one round trip later
        self.bytes += n
        return max(sent + delay, after)  # bytes keep their order


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, d: _Direction) -> None:
    """Copy reader -> writer, each chunk delivered at the time the link model says."""
    loop = asyncio.get_running_loop()
    queue: collections.deque = collections.deque()
    held = 0
    room = asyncio.Event()
    room.set()
    ready = asyncio.Event()
    eof = False

    async def deliver() -> None:
        nonlocal held
        try:
            while True:
                while not queue:
                    if eof:
                        return
                    ready.clear()
                    await ready.wait()
                at, data = queue[0]
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                queue.popleft()
                writer.write(data)
                held -= len(data)
                if held < d.link.buffer:
                    room.set()
                await writer.drain()
        except BaseException:
            room.set()  # the far side failed: wake the reader so it stops too (else it waits forever)
            raise

    sender = asyncio.ensure_future(deliver())
    last = 0.0
    try:
        while True:
            # Checked before waiting too: a reader that filled the buffer after delivery failed
            # (and set ``room`` for the last time) cleared it again and waited forever.
            if sender.done():
                break  # delivery failed; ``await sender`` below raises its error
            await room.wait()
            if sender.done():
                break
            data = await reader.read(_CHUNK)
            if not data:
                break
            last = d.schedule(len(data), loop.time(), last)
            queue.append((last, data))
            held += len(data)
            if held >= d.link.buffer:
                room.clear()
            ready.set()
        eof = True
        ready.set()
        await sender
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction may still be talking
    except (ConnectionError, OSError):
        sender.cancel()
        writer.close()
    finally:
        if not sender.done():
            sender.cancel()


class LinkProxy:
    """An emulated link in front of ``target``: listen on ``listen`` (port 0: any free port).

        async with LinkProxy(Link(100, 100), "127.0.0.1:7000") as proxy:
            channel = grpc.aio.insecure_channel(proxy.address)
    """

    def __init__(self, link: Link, target: str, listen: str = "127.0.0.1:0", seed: int = 0) -> None:
        self.link = link
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.listen_host, port = listen.rsplit(":", 1)
        self.listen_port = int(port)
        rng = random.Random(seed)
        self.up = _Direction(link, rng)     # client -> target
        self.down = _Direction(link, rng)   # target -> client
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()  # one per connection
        self._writers: set[asyncio.StreamWriter] = set()
        self.address = ""

    async def start(self) -> LinkProxy:
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"
        return self

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.connections += 1
        t_writer = None
        self._writers.add(c_writer)
        try:
            t_reader, t_writer = await asyncio.open_connection(self.target_host, self.target_port)
            self._writers.add(t_writer)
            for w in (c_writer, t_writer):
                sock = w.get_extra_info("socket")
                if sock is not None:  # small messages (pings, acks) must not wait for Nagle
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(_pump(c_reader, t_writer, self.up), _pump(t_reader, c_writer, self.down),
                                 return_exceptions=True)
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (c_writer, t_writer):
                if w is not None:
                    w.close()
                    self._writers.discard(w)
            self._tasks.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Abort the sockets rather than cancel the handlers: reads end, each pump returns.
        for w in list(self._writers):
            w.transport.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> LinkProxy:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _serve(args) -> None:
    link = Link(latency_ms=args.latency_ms, bandwidth_mbit=args.bandwidth_mbit,
                jitter_ms=args.jitter_ms, loss_pct=args.loss_pct)
    proxy = await LinkProxy(link, args.target, args.listen, seed=args.seed).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    name = f" {args.name}" if args.name else ""
    # SIGUSR1: log the byte counters now (a benchmark reads them before and after a phase).
    loop.add_signal_handler(signal.SIGUSR1, lambda: print(
        f"wanem{name}: {proxy.up.bytes} bytes up, {proxy.down.bytes} bytes down so far", flush=True))
    print(f"wanem{name}: relaying {proxy.address} -> {args.target} ({link.describe()})", flush=True)
    t0 = time.monotonic()
    await stop.wait()
    await proxy.close()
    print(f"wanem{name}: stopped after {time.monotonic() - t0:.1f}s; {proxy.connections} connections, "
          f"{proxy.up.bytes} bytes up, {proxy.down.bytes} bytes down", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps.tools.wanem", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HOST:PORT to proxy to (the parent tier)")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept on (port 0: any)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="round-trip latency the link adds")
    p.add_argument("--bandwidth-mbit", type=float, default=0.0, help="per direction; 0 = unlimited")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="extra one-way delay, uniform 0..jitter")
    p.add_argument("--loss-pct", type=float, default=0.0, help="segment loss, as one extra round trip")
    p.add_argument("--seed", type=int, default=0, help="seed of jitter and loss")
    p.add_argument("--name", default="", help="edge name for the log lines")
    args = p.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except ValueError as exc:
        print(f"wanem: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
