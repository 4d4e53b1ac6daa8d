"""A failed call's status as the hps error it stands for (ps.net.rpc.error_from)."""

from __future__ import annotations

import grpc

from ps.core.errors import BadInput, Internal, Stale, Unavailable
from ps.net.rpc import error_from, trailers


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, meta: tuple = ()) -> None:
        self._code, self._details, self._meta = code, details, meta

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._meta


def test_an_hps_peers_answer_keeps_its_error_and_grpcs_own_internal_is_a_broken_call():
    assert type(error_from(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "no", trailers(BadInput("no"))))) is BadInput
    stale = error_from(_Failed(grpc.StatusCode.ABORTED, "late", trailers(Stale("late", wait_version=4))))
    assert isinstance(stale, Stale) and stale.wait_version == 4
    # an hps tier that answers Internal says so in its trailer: final, as it was
    assert type(error_from(_Failed(grpc.StatusCode.INTERNAL, "bug", trailers(Internal("bug"))))) is Internal
    # grpc's asyncio client, when a message could not be written to a connection that broke
    # (a parent killed mid-push): outcome unknown, retried like UNAVAILABLE
    broken = error_from(_Failed(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert isinstance(broken, Unavailable) and "outcome is unknown" in str(broken)
    # any other INTERNAL without a trailer (a server that could not parse the request) stays final
    assert type(error_from(_Failed(grpc.StatusCode.INTERNAL, "Exception deserializing request!"))) is Internal


def test_a_call_broken_in_transit_is_an_unknown_outcome_and_a_peers_unknown_is_its_answer():
    """A stream reset under the call (UNKNOWN "Stream removed", grpc/grpc#34076) or a server
    shutting down with it in flight (CANCELLED) is not the parent's answer: a relay passed it to
    its workers as final while the parent had applied the push (review). An hps tier names its
    answers in a trailer (its own bugs as Internal), so those stay what they say."""
    for code, details in ((grpc.StatusCode.UNKNOWN, "Stream removed"), (grpc.StatusCode.CANCELLED, "Cancelled")):
        err = error_from(_Failed(code, details))
        assert isinstance(err, Unavailable) and "outcome is unknown" in str(err), (code, err)
    assert type(error_from(_Failed(grpc.StatusCode.INTERNAL, "bug", trailers(Internal("bug"))))) is Internal


def test_a_client_streamed_write_after_the_servers_answer_raises_that_answer():
    """``Outgoing`` (a relay passing a child's CreateJob on): the server refused at the first
    frame, without reading the rest. grpc.aio raises InvalidStateError for a write to an ended
    call, which the relay reported as its own bug (INTERNAL) instead of the parent's answer."""
    import asyncio

    from ps.core.errors import Unauthenticated
    from ps.net.rpc import AsyncCaller
    from ps.net.wire import SERVICE

    async def refuse(request_iterator, context):
        async for _ in request_iterator:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token (refused by the test)")

    async def run() -> list[str]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "CreateJob": grpc.stream_unary_rpc_method_handler(refuse)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        rpc = AsyncCaller(f"127.0.0.1:{port}")
        said = []
        try:
            call = await rpc.open("CreateJob", 10.0)
            await call.write(b"first")
            await asyncio.wait_for(call.ended(), 10)  # answered
            for _ in range(2):
                try:
                    await call.write(b"next")
                except Unauthenticated as exc:
                    said.append(str(exc))
        finally:
            await rpc.close()
            await server.stop(0)
        return said

    said = asyncio.run(run())
    assert len(said) == 2 and all("no token" in s for s in said), said
