"""The WAN link emulator: bytes arrive intact and in order, through many connections at once,
never sooner than the link's latency allows; connections close cleanly. No upper timing bound
is asserted (a shared machine may always be slower); benchmarks/wanem.py measures accuracy."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from ps.tools.wanem import Link, LinkProxy


async def _echo_server():
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _roundtrip(address: str, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    r, w = await asyncio.open_connection(host, int(port))

    async def send() -> None:
        for i in range(0, len(payload), 10_000):  # uneven pieces: reassembly must keep order
            w.write(payload[i:i + 10_000])
            await w.drain()
        w.write_eof()

    sender = asyncio.ensure_future(send())
    got = await r.read(-1)  # until the relay forwards the server's EOF
    await sender
    w.close()
    return got


def test_bytes_intact_and_in_order_across_many_connections():
    async def main():
        server, target = await _echo_server()
        async with LinkProxy(Link(latency_ms=10, bandwidth_mbit=200, jitter_ms=5, loss_pct=1), target) as relay:
            payloads = [os.urandom(300_000 + 7919 * i) for i in range(8)]
            got = await asyncio.gather(*(_roundtrip(relay.address, p) for p in payloads))
            assert [len(g) for g in got] == [len(p) for p in payloads]
            assert all(g == p for g, p in zip(got, payloads))
            assert relay.connections == 8
            assert relay.up.bytes == relay.down.bytes == sum(map(len, payloads))
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_delay_is_at_least_the_latency():
    async def main():
        server, target = await _echo_server()
        async with LinkProxy(Link(latency_ms=60), target) as relay:
            host, port = relay.address.rsplit(":", 1)
            r, w = await asyncio.open_connection(host, int(port))
            for _ in range(3):
                t0 = time.monotonic()
                w.write(b"ping")
                await w.drain()
                assert await r.readexactly(4) == b"ping"
                assert time.monotonic() - t0 >= 0.060 * 0.99  # one round trip: two half-latencies
            w.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_bandwidth_paces_a_bulk_transfer_no_faster_than_the_link():
    async def main():
        server, target = await _echo_server()
        # 2 MB at 80 Mbit/s (10 MB/s) each way: at least 0.2 s to serialise, plus the latency.
        async with LinkProxy(Link(latency_ms=20, bandwidth_mbit=80), target) as relay:
            t0 = time.monotonic()
            got = await _roundtrip(relay.address, b"x" * 2_000_000)
            assert len(got) == 2_000_000
            assert time.monotonic() - t0 >= 0.2 + 0.02
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_close_with_open_connections_and_unreachable_target():
    async def main():
        server, target = await _echo_server()
        relay = await LinkProxy(Link(latency_ms=5), target).start()
        host, port = relay.address.rsplit(":", 1)
        r, w = await asyncio.open_connection(host, int(port))
        w.write(b"hello")
        await w.drain()
        assert await r.readexactly(5) == b"hello"
        await asyncio.wait_for(relay.close(), 5)  # open connection: closed, not hung
        assert await asyncio.wait_for(r.read(-1), 5) == b""
        w.close()
        server.close()
        await server.wait_closed()
        # A target that refuses: the client's connection is closed, the relay keeps serving.
        async with LinkProxy(Link(), target) as dead:
            host, port = dead.address.rsplit(":", 1)
            r, w = await asyncio.open_connection(host, int(port))
            assert await asyncio.wait_for(r.read(-1), 5) == b""
            w.close()

    asyncio.run(main())


@pytest.mark.parametrize("spec, error", [(dict(latency_ms=-1), "latency_ms"), (dict(loss_pct=100), "loss_pct"),
                                         (dict(bandwidth_mbit=float("nan")), "bandwidth_mbit")])
def test_bad_links_are_refused_with_the_value(spec, error):
    with pytest.raises(ValueError, match=error):
        Link(**spec)


def test_link_from_a_topology_entry():
    assert Link.from_spec({"name": "eu", "port": 0}) is None
    link = Link.from_spec({"latency_ms": 100, "bandwidth_mbit": 100})
    assert link == Link(latency_ms=100.0, bandwidth_mbit=100.0)
    assert "100 ms RTT" in link.describe()


def test_a_target_that_resets_mid_stream_does_not_leave_the_connection_hanging():
    """The target resets the connection while more than a buffer of the client's bytes is
    queued in the link: the relay must notice, close both sides and be able to shut down
    (it used to wait forever for room in its full buffer)."""
    async def main():
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read(65536)
            w.transport.abort()  # a reset, as when the parent tier is killed

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        relay = await LinkProxy(Link(latency_ms=2, bandwidth_mbit=1000), target).start()
        host, port = relay.address.rsplit(":", 1)
        r, w = await asyncio.open_connection(host, int(port))
        try:
            for _ in range(64):  # 8 MiB, far more than the link buffers
                w.write(b"x" * 131072)
                await asyncio.wait_for(w.drain(), 5)
        except (ConnectionError, asyncio.TimeoutError):
            pass  # the relay closed us, or stopped reading: both fine
        w.close()
        for _ in range(200):  # bounded: up to 10 s for the handler to wind down
            if not relay._tasks:
                break
            await asyncio.sleep(0.05)
        assert not relay._tasks, "the connection handler never finished"
        await relay.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
