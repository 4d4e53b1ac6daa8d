"""The small error vocabulary of hps, and the one table that maps it to gRPC status codes.

    raise BadInput(f"gradient for key {key!r} has shape {shape}, the job holds {want}")

Domain modules raise these; ``ps.service`` turns them into gRPC statuses with the sentence as
details, and clients turn statuses back into the same classes (``from_rpc_error``), so a
training loop sees ``BadInput`` whether the check ran locally or on a server.
"""

from __future__ import annotations

import grpc

__all__ = [
    "HpsError", "BadInput", "UnknownJob", "NotReady", "Conflict", "Stale", "Unavailable",
    "NotBuilt", "TimedOut", "code_of", "from_rpc_error",
]


class HpsError(Exception):
    """Base class; the message is a sentence a user can act on."""


class BadInput(HpsError):
    """The request is malformed or inconsistent with the job (shape, dtype, NaN, frame)."""


class UnknownJob(HpsError):
    """The job does not exist at this tier (or its parent)."""


class NotReady(HpsError):
    """The caller must do something first (register, or pull a newer version)."""


class Conflict(HpsError):
    """The request contradicts existing state (a job re-created with other keys)."""


class Stale(HpsError):
    """The caller's view or round is gone (epoch changed, round already closed); resync."""


class Unavailable(HpsError):
    """A tier or its parent cannot be reached right now; retry with backoff."""


class NotBuilt(HpsError):
    """The feature exists in the protocol but is not built yet."""


class TimedOut(HpsError):
    """A wait (barrier, pull) passed its deadline."""


# The one table: exception class <-> gRPC status code.
_TABLE: list[tuple[type[HpsError], grpc.StatusCode]] = [
    (BadInput, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownJob, grpc.StatusCode.NOT_FOUND),
    (NotReady, grpc.StatusCode.FAILED_PRECONDITION),
    (Conflict, grpc.StatusCode.ALREADY_EXISTS),
    (Stale, grpc.StatusCode.ABORTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (NotBuilt, grpc.StatusCode.UNIMPLEMENTED),
    (TimedOut, grpc.StatusCode.DEADLINE_EXCEEDED),
]
_BY_CLASS = {cls: code for cls, code in _TABLE}
_BY_CODE = {code: cls for cls, code in _TABLE}


def code_of(exc: HpsError) -> grpc.StatusCode:
    """The gRPC status code for an hps exception."""
    for cls in type(exc).__mro__:
        if cls in _BY_CLASS:
            return _BY_CLASS[cls]
    return grpc.StatusCode.INTERNAL


def from_rpc_error(err: grpc.RpcError) -> HpsError:
    """Rebuild the hps exception a server raised from the status a client received."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return _BY_CODE.get(code, HpsError)(details or f"rpc failed with {code.name}")
