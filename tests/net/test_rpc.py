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
