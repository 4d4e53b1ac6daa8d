"""gRPC plumbing every caller and the server share: the status table, channel options, and one
call helper that turns a failed call back into the hps error the server raised.

>>> from ps.net.wire import pb
>>> rpc = Caller(address)                          # or AsyncCaller(...) on an event loop
>>> reply = rpc.call("ListJobs", pb.ListJobsRequest(), timeout=5)
>>> rpc.call("EndJob", pb.EndJobRequest(job="no-such-job"), timeout=5)   # raises HpsError subclasses
Traceback (most recent call last):
ps.core.errors.UnknownJob: job 'no-such-job' is not known at this global tier; ...
>>> rpc.close()

A servicer refuses a call with ``await abort(context, BadInput("..."))``.

An hps error travels as its gRPC status code with the sentence as details, plus trailing
metadata ``hps-error: <class name>`` (so ``NotMember`` and ``NotReady`` stay apart although
both are FAILED_PRECONDITION) and the error's structured extras (``hps-wait-version``).
Statuses gRPC itself raises (connection refused, deadline) map by code alone.

Credentials travel as call metadata ``authorization: Bearer <token>`` (``bearer``); a caller
may send several (a relay's heartbeat covers every job it holds). ``FORWARDED`` holds the
tokens of the call a server is handling, so a relay forwarding it upward can present them
(ps/server/auth.py says when it does). Tokens are never part of an error's sentence.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2

from ps.core.config import address_list
from ps.core.errors import ERRORS, HpsError, Internal, NotReady, Stale, TimedOut, Unavailable
from ps.net.aio import wait_for
from ps.net.tls import ClientTls, TlsFiles, client_options
from ps.net.wire import RELAY_READY, stubs

__all__ = ["MAX_MESSAGE", "CHANNEL_OPTIONS", "SERVER_OPTIONS", "status_of", "trailers",
           "error_from", "abort", "bearer", "bearer_tokens", "FORWARDED", "Caller", "AsyncCaller",
           "cannot_connect", "cancelled_here", "RELAY_CHECK", "relay_check", "relay_check_failed"]

MAX_MESSAGE = 16 * 1024 * 1024
_SIZE = [("grpc.max_send_message_length", MAX_MESSAGE + 4096),
         ("grpc.max_receive_message_length", MAX_MESSAGE + 4096)]
# Reconnect promptly after a parent restarts. gRPC's default backoff (1 s, x1.6, up to 120 s)
# kept a region's heartbeats failing with "connection refused" for up to 6.7 s after the root
# was back, while the other region trained alone. A cluster's parents are few and near: a
# reconnect attempt every 0.1-0.5 s costs them nothing (benchmarks/reconnect.py).
CHANNEL_OPTIONS = _SIZE + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
# No SO_REUSEPORT (gRPC's default is on): with it a second process binds a port in use without
# an error and takes a share of its connections, and servers that ask for port 0 at once can be
# handed the same port (grpc/grpc#10755; a CI run's health probe was refused by it).
SERVER_OPTIONS = [*_SIZE, ("grpc.so_reuseport", 0)]

log = logging.getLogger("hps.rpc")

_DETAILS_LIMIT = 2000  # a sentence, not a dump: gRPC refuses trailers past its metadata limit
# Statuses that carry no hps-error name (raised by gRPC itself) map by code to the first class
# with it; the rest are errors of no hps kind.
_BY_CODE: dict[str, type[HpsError]] = {}
for _cls in ERRORS.values():
    _BY_CODE.setdefault(_cls.code, _cls)
_BY_CODE["FAILED_PRECONDITION"] = NotReady
assert all(hasattr(grpc.StatusCode, c.code) for c in ERRORS.values()), "every error needs a status"


# The bearer tokens of the call being served (set by ps/server for the handler's duration).
FORWARDED: ContextVar[tuple[str, ...]] = ContextVar("hps_forwarded_tokens", default=())


def bearer(tokens: Iterable[str]) -> tuple[tuple[str, str], ...] | None:
    """Call metadata presenting ``tokens`` (None: no credential)."""
    md = tuple(("authorization", f"Bearer {t}") for t in tokens if t)
    return md or None


def bearer_tokens(metadata: Iterable[tuple[str, Any]] | None) -> tuple[str, ...]:
    """The bearer tokens in a call's metadata, in order (other schemes are ignored)."""
    out = []
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            out.append(value[7:].strip())
    return tuple(t for t in out if t)


def status_of(exc: HpsError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN)


def trailers(exc: HpsError) -> tuple[tuple[str, str], ...]:
    return (("hps-error", type(exc).__name__),
            *((f"hps-{k}", v) for k, v in exc.extra().items()))


_BROKEN_WRITE = "Internal error from Core"  # grpc.aio's own status for a failed send (cygrpc.InternalError)


def error_from(err: grpc.RpcError) -> HpsError:
    """The hps error a failed call carried (or the closest one for gRPC's own statuses)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else str(err)) or f"rpc failed with {code.name}"
    meta: dict[str, Any] = {}
    try:
        meta = {k: v for k, v in (err.trailing_metadata() or ())}
    except Exception:  # a call that never reached a server has none
        pass
    named = ERRORS.get(meta.get("hps-error", ""))
    if named is None and code == grpc.StatusCode.INTERNAL and details.startswith(_BROKEN_WRITE):
        # Not an hps peer's answer (which names its error in a trailer), nor a server's: grpc's
        # asyncio client says this of a message it could not write to a connection that broke.
        # The call broke in transit and its outcome is unknown, as with UNAVAILABLE: retried,
        # never passed down as final. Seen in CI when a root was killed while a regional
        # master's push to it was being written: the round was refused to the workers instead
        # of going to the standby.
        return Unavailable(f"{details} (gRPC, not the peer: the connection broke while the call was "
                           "sent; its outcome is unknown)")
    if named is None and code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
        # Not a tier's answer either (a tier names every refusal, its own bugs as Internal):
        # gRPC's for a stream reset under the call ("Stream removed"), a server shutting down
        # with the call in flight. Passed down as final, a relay's forward was reported to its
        # workers as refused while its parent applied it, and the next round, a different sum
        # under the same number, was refused as a Conflict for good (review).
        return Unavailable(f"{details} (gRPC {code.name}, not the peer's answer: the call broke in transit; "
                           "its outcome is unknown)")
    cls = named or _BY_CODE.get(code.name, HpsError)
    if cls is Stale:
        wait, epoch = meta.get("hps-wait-version"), meta.get("hps-epoch")
        return Stale(details, int(wait) if wait and str(wait).isdigit() else None,
                     int(epoch) if epoch and str(epoch).isdigit() else None)
    return cls(details)


async def abort(context: Any, exc: HpsError) -> NoReturn:
    """Refuse the call with ``exc`` (never returns)."""
    details = str(exc)
    if len(details) > _DETAILS_LIMIT:
        details = details[:_DETAILS_LIMIT - 1] + "…"
    await context.abort(status_of(exc), details, trailing_metadata=trailers(exc))
    raise AssertionError("context.abort returned")  # it raises; this says so to readers and mypy


class _Channels:
    """A channel to one address, plaintext or mutual TLS; with TLS, a new channel once the
    certificate files change (rotation). The channel it replaced is closed at the next change
    or at ``close``: calls still in flight on it finish."""

    def __init__(self, address: str, tls: TlsFiles | None, make: Callable[..., Any]) -> None:
        self.address = address
        self.tls = ClientTls(tls) if tls is not None else None
        self._make = make  # (address, credentials or None, options) -> channel
        self.channel = self._new()
        self.stubs = stubs(self.channel)
        self.retired: list = []

    def _new(self):
        if self.tls is None:
            return self._make(self.address, None, CHANNEL_OPTIONS)
        return self._make(self.address, self.tls.credentials(), CHANNEL_OPTIONS + client_options())

    def fresh(self) -> tuple[dict, list]:
        """The stubs to call with, and channels retired long enough ago to close now."""
        if self.tls is not None and self.tls.changed():
            try:
                channel = self._new()
            except (OSError, ValueError) as exc:  # half-written files: keep the old channel
                log.warning("TLS files changed but cannot be loaded yet (%s); keeping the previous ones", exc)
                return self.stubs, []
            log.info("TLS certificate files changed; a new channel to %s uses them", self.address)
            old, self.retired = self.retired, [self.channel]
            self.channel, self.stubs = channel, stubs(channel)
            return self.stubs, old
        return self.stubs, []


def cannot_connect(exc: HpsError) -> bool:
    """Whether a failed call never reached a server: gRPC's sentence for a connection refused
    or otherwise not made (a killed process), not a tier's refusal."""
    d = str(exc).lower()
    return isinstance(exc, Unavailable) and ("failed to connect" in d or "connection refused" in d
                                             or "connect failed" in d)


# The tokenless health check a relay or worker on an alternate asks its first parent or tier
# (``Caller.relay_ready``, ``ps.net.upstream.Upstream.relay_ready``).
RELAY_CHECK = health_pb2.HealthCheckRequest(service=RELAY_READY)


def relay_check(channel: Any) -> Any:
    """The health check method on ``channel`` (sync or grpc.aio)."""
    return channel.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                               response_deserializer=health_pb2.HealthCheckResponse.FromString)


def relay_check_failed(err: grpc.RpcError) -> bool | None:
    """None where the check failed because the address is no relay (a root: NOT_FOUND);
    otherwise the error as an HpsError."""
    if err.code() == grpc.StatusCode.NOT_FOUND:
        return None
    raise error_from(err) from None


class Caller:
    """Blocking calls to one tier: every method of the service, errors as hps exceptions.
    ``tls``: present this certificate and verify the tier's (None: plaintext); ``token``:
    presented on every call (``authorization: Bearer``; None: none).

    ``address`` may list alternates, comma-separated (``ps.core.config.address_list``): calls go
    to one (``address``) until ``switch`` moves them to the next in turn; the caller decides
    when (``worker.client``)."""

    def __init__(self, address: str, tls: TlsFiles | None = None, token: str | None = None) -> None:
        self.addresses = address_list(address) or (address,)
        self.index = 0       # which of ``addresses`` the calls go to
        self.switches = 0
        self.token = token
        self._tls = tls
        self._lock = threading.Lock()
        self._retired: list[_Channels] = []  # channels of earlier addresses: their calls finish
        self._ch = self._channels(self.addresses[0])
        self._probe: _Channels | None = None  # to an address not in use (``relay_ready``)

    def _channels(self, address: str) -> _Channels:
        return _Channels(address, self._tls, lambda a, cred, opts: (
            grpc.secure_channel(a, cred, options=opts) if cred else grpc.insecure_channel(a, options=opts)))

    @property
    def address(self) -> str:
        """The tier the calls go to now."""
        return self.addresses[self.index]

    def switch(self, to: int | None = None) -> str:
        """Send the calls from now on to address ``to`` (default: the next in turn); returns
        it. The previous channel is closed at a later switch or at ``close`` (calls in flight
        there finish)."""
        with self._lock:
            if self._probe is not None:  # it may be to the address switched to: one channel there
                self._probe.channel.close()
                self._probe = None
            while len(self._retired) > 2:
                old = self._retired.pop(0)
                for ch in old.retired + [old.channel]:
                    ch.close()
            self._retired.append(self._ch)
            self.index = (self.index + 1) % len(self.addresses) if to is None else to
            self._ch = self._channels(self.address)
            self.switches += 1
            return self.address

    @property
    def channel(self) -> grpc.Channel:
        return self._ch.channel

    @property
    def stubs(self) -> dict:
        stubs_, old = self._ch.fresh()
        for ch in old:
            ch.close()
        return stubs_

    def call(self, name: str, request: Any, timeout: float) -> Any:
        try:
            return self.stubs[name](request, timeout=timeout, metadata=bearer([self.token or ""]))
        except grpc.RpcError as err:
            raise error_from(err) from None

    def stream(self, name: str, request: Any, timeout: float) -> list:
        """A server-streaming call's messages, all of them (a cut stream raises)."""
        try:
            return list(self.stubs[name](request, timeout=timeout, metadata=bearer([self.token or ""])))
        except grpc.RpcError as err:
            raise error_from(err) from None

    def _aside(self, index: int) -> grpc.Channel:
        """A channel to ``addresses[index]`` beside the one in use (one at a time; closed at the
        next switch or at ``close``)."""
        with self._lock:
            if self._probe is None or self._probe.address != self.addresses[index]:
                if self._probe is not None:
                    self._probe.channel.close()
                self._probe = self._channels(self.addresses[index])
            return self._probe.channel

    def call_at(self, index: int, name: str, request: Any, timeout: float) -> Any:
        """``call``, to ``addresses[index]`` rather than the address in use."""
        try:
            return stubs(self._aside(index))[name](request, timeout=timeout, metadata=bearer([self.token or ""]))
        except grpc.RpcError as err:
            raise error_from(err) from None

    def relay_ready(self, index: int, timeout: float) -> bool | None:
        """Whether ``addresses[index]`` (one not in use) is a relay ready for children again
        (``grpc.health.v1`` service ``RELAY_READY``, asked without a token). None: it is a
        root, or a build that does not say; HpsError: it does not answer."""
        try:
            r = relay_check(self._aside(index))(RELAY_CHECK, timeout=timeout)
        except grpc.RpcError as err:
            return relay_check_failed(err)
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        with self._lock:
            if self._probe is not None:
                self._probe.channel.close()
                self._probe = None
            for chs in [*self._retired, self._ch]:
                for ch in chs.retired + [chs.channel]:
                    ch.close()
            self._retired.clear()

    def __enter__(self) -> Caller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cancelled_here() -> Unavailable:
    """What a call that grpc.aio cancelled on this side, without this task being cancelled, is:
    its channel was closed under it (a retired parent's, a certificate rotation), so it never
    got its answer and its outcome is unknown -- retried, as a broken connection is. Raised as
    asyncio.CancelledError it ended the task awaiting it (a relay's forward, whose children then
    waited for good). Call it in ``except asyncio.CancelledError``: it re-raises when the task
    itself is being cancelled."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    return Unavailable("the call was cancelled on this side before its answer (its channel was closed); "
                       "its outcome is unknown")


class Outgoing:
    """A client-streamed call being written (``AsyncCaller.open``); gRPC errors become hps ones.
    A call cancelled is never taken for a whole one: the server sees no end of its stream."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def write(self, frame: bytes) -> None:
        try:
            await self._call.write(frame)
        except asyncio.CancelledError:
            raise cancelled_here() from None
        except (grpc.RpcError, asyncio.InvalidStateError):
            # The server answered already (a refusal; grpc.aio raises InvalidStateError for a
            # write to a call that has ended): its status, not this write's error.
            await self.finish()
            raise Internal("the parent answered a client-streamed call before its end") from None

    async def finish(self) -> Any:
        try:
            await self._call.done_writing()
            return await self._call
        except asyncio.CancelledError:
            raise cancelled_here() from None
        except grpc.RpcError as err:
            raise error_from(err) from None

    async def ended(self) -> None:
        """Return once the call has ended (the server answered: a refusal, before the end)."""
        await self._call.code()

    def cancel(self) -> None:
        self._call.cancel()


# How long a server-streamed call read with an idle timeout (``AsyncCaller.stream``) may take in
# all: 400 MB at 10 Mbit/s is ~5.5 min; a stream that keeps trickling is cut after this.
LONGEST_STREAM_S = 3600.0


class AsyncCaller:
    """``Caller`` for grpc.aio: a relay's calls to its parent."""

    def __init__(self, address: str, tls: TlsFiles | None = None) -> None:
        self.address = address
        self._ch = _Channels(address, tls, lambda a, cred, opts: (
            grpc.aio.secure_channel(a, cred, options=opts) if cred else grpc.aio.insecure_channel(a, options=opts)))

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._ch.channel

    async def _stubs(self) -> dict:
        stubs_, old = self._ch.fresh()
        for ch in old:
            await ch.close()
        return stubs_

    async def call(self, name: str, request: Any, timeout: float, tokens: Iterable[str] = ()) -> Any:
        try:
            return await (await self._stubs())[name](request, timeout=timeout, metadata=bearer(tokens))
        except asyncio.CancelledError:
            raise cancelled_here() from None
        except grpc.RpcError as err:
            raise error_from(err) from None

    async def stream(self, name: str, request: Any, timeout: float, tokens: Iterable[str] = (),
                     idle: float | None = None) -> list:
        """A server-streamed call's messages. ``idle``: ``timeout`` bounds the wait for the first
        message only, and each next one must come within ``idle`` seconds, however long the
        whole takes (at most ``LONGEST_STREAM_S``): a relay's pull of a large model over a WAN
        (400 MB at 100 Mbit/s: 32 s) never fit one call's deadline, and was pulled again and
        again, from the start, for good (review)."""
        try:
            if idle is None:
                return [m async for m in (await self._stubs())[name](request, timeout=timeout,
                                                                     metadata=bearer(tokens))]
            call = (await self._stubs())[name](request, timeout=timeout + LONGEST_STREAM_S, metadata=bearer(tokens))
            out: list = []
            messages = call.__aiter__()
            limit = timeout
            while True:
                try:
                    out.append(await wait_for(messages.__anext__(), limit))
                except StopAsyncIteration:
                    return out
                except asyncio.TimeoutError:
                    call.cancel()
                    raise TimedOut(f"{name} to {self.address}: no message for {limit:.1f}s "
                                   f"({'none yet' if not out else f'after {len(out)}'})") from None
                limit = idle
        except asyncio.CancelledError:
            raise cancelled_here() from None
        except grpc.RpcError as err:
            raise error_from(err) from None

    async def open(self, name: str, timeout: float, tokens: Iterable[str] = ()) -> Outgoing:
        """A client-streamed call written frame by frame as the frames come (a relay passing a
        child's stream on): ``write`` each, then ``finish`` for the reply, or ``cancel``."""
        return Outgoing((await self._stubs())[name](timeout=timeout, metadata=bearer(tokens)))

    async def close(self, grace: float | None = None) -> None:
        """Close the channels; calls still in flight get ``grace`` seconds to end first (None:
        cancelled at once, which they report as ``cancelled_here``)."""
        for ch in self._ch.retired + [self._ch.channel]:
            await ch.close(grace)
