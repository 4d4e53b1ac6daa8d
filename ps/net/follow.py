"""A standby root's link to its primary: the Follow stream, and the questions it asks a peer root.

    link = LogLink("10.0.0.1:7000", tls=None, token="")       # the primary's address
    await link.follow(term=3, lease_s=2.0, handle=apply)      # until the stream ends or stalls
    status = await link.status(timeout=1.0)                   # TierStatus: root_state, term

``follow`` sends FOLLOW, then for every whole message the primary sends awaits
``handle(message)`` (the standby applies it durably) and acknowledges it with an ACK naming its
sequence number, in order. It returns when the primary ends the stream and raises
``Unavailable`` when the stream fails or nothing arrives for ``lease_s`` (a stopped primary
keeps its connection open but says nothing; the primary sends BEAT while idle).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from ps.core.errors import HpsError, Unavailable
from ps.core.types import LogMessage, TierStatus
from ps.net.aio import wait_for
from ps.net.messages import status_from_pb
from ps.net.rpc import AsyncCaller, bearer, error_from
from ps.net.tls import TlsFiles
from ps.net.wire import SERVICE, LogReader, encode_log, pb

__all__ = ["LogLink"]


class LogLink:
    """Calls from one root to its peer (plaintext or mutual TLS; ``token``: the admin token)."""

    def __init__(self, address: str, tls: TlsFiles | None = None, token: str = "") -> None:
        self.address = address
        self.token = token
        self._rpc = AsyncCaller(address, tls)

    async def status(self, timeout: float) -> TierStatus:
        return status_from_pb(await self._rpc.call("Status", pb.StatusRequest(), timeout, [self.token]))

    async def promote(self, timeout: float) -> int:
        return (await self._rpc.call("Promote", pb.PromoteRequest(), timeout, [self.token])).term

    async def follow(self, term: int, lease_s: float, handle: Callable[[LogMessage], Awaitable[None]],
                     address: str = "") -> None:
        """``address``: where this standby serves (the primary looks there for a newer primary)."""
        out: asyncio.Queue[LogMessage | None] = asyncio.Queue()
        out.put_nowait(LogMessage("follow", term=term, data=address.encode()))

        async def requests() -> AsyncIterator[bytes]:
            while (m := await out.get()) is not None:
                for frame in encode_log(m):
                    yield frame

        method = self._rpc.channel.stream_stream(f"/{SERVICE}/Follow")
        call = method(requests(), metadata=bearer([self.token]))
        reader = LogReader()
        try:
            while True:
                try:
                    data = await wait_for(call.read(), lease_s)
                except asyncio.TimeoutError:
                    raise Unavailable(f"the primary {self.address} said nothing for {lease_s:.1f}s") from None
                except grpc.RpcError as err:
                    raise error_from(err) from None
                if data is grpc.aio.EOF:
                    return
                msg = reader.feed(data)
                if msg is None:
                    continue
                await handle(msg)
                out.put_nowait(LogMessage("ack", job=msg.job, version=msg.version, seq=msg.seq))
        except HpsError:
            raise
        finally:
            out.put_nowait(None)
            call.cancel()

    async def close(self) -> None:
        await self._rpc.close()
