"""The small error vocabulary of hps, and the one table that names each error's gRPC status.

>>> key = "fc.weight"
>>> raise BadInput(f"gradient for key {short(key)} has shape (3, 4), the job holds (4, 3)")
Traceback (most recent call last):
ps.core.errors.BadInput: gradient for key 'fc.weight' has shape (3, 4), the job holds (4, 3)
>>> Stale("round 41 closed", wait_version=42).code, ERRORS["NotMember"].code
('ABORTED', 'FAILED_PRECONDITION')

Domain modules raise these. The network layer (``ps.net.rpc``) turns them into gRPC statuses with
the sentence as details and the class name in the trailing metadata, and turns statuses back
into the same classes, so a training loop sees ``NotMember`` whether the check ran locally or
on a server. This module imports no grpc: the pure core raises these without loading it.
"""

from __future__ import annotations

__all__ = [
    "HpsError", "BadInput", "UnknownJob", "NotReady", "NotMember", "Conflict", "Stale",
    "Unavailable", "NotPrimary", "Exhausted", "NotBuilt", "TimedOut", "Internal", "Unauthenticated",
    "PermissionDenied", "ERRORS", "short",
]


def short(value: object, limit: int = 64) -> str:
    """``repr`` of a caller-supplied value, cut to ``limit`` characters: error sentences echo
    names, and a 1 MiB job name must not turn the intended error into "metadata too large"."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 1]}…'"


class HpsError(Exception):
    """Base class; the message is a sentence a user can act on.

    ``code`` is the name of the gRPC status the error travels as (``ps.net.rpc`` maps it)."""

    code = "UNKNOWN"

    def extra(self) -> dict[str, str]:
        """Structured details beyond the sentence, sent as trailing metadata ``hps-<name>``."""
        return {}


class BadInput(HpsError):
    """The request is malformed or inconsistent with the job (shape, dtype, NaN, frame)."""

    code = "INVALID_ARGUMENT"


class UnknownJob(HpsError):
    """The job does not exist (the root says so, or it ended)."""

    code = "NOT_FOUND"


class NotReady(HpsError):
    """The caller must do something first, or wait a moment (the tier is catching up)."""

    code = "FAILED_PRECONDITION"


class NotMember(NotReady):
    """The caller is not (or no longer) a member of the job at this tier: register again.

    A relay that restarted holds no job until a child registers; it says this, not
    UnknownJob, so its children register again instead of ending their training."""


class Conflict(HpsError):
    """The request contradicts existing state (a job re-created with other keys, a sequence
    number reused for another body, a member id used by two processes)."""

    code = "ALREADY_EXISTS"


class Stale(HpsError):
    """The push was not applied and will not be (its round closed, or the root restarted).

    ``wait_version``: the version to pull before computing again (the open round's), so a
    worker that hears this waits for it instead of recomputing on the view it holds.
    ``epoch``: the root epoch the refusing tier holds, when the refusal is that the push was
    computed on another (the root restarted): a tier below it may not have moved there yet."""

    code = "ABORTED"

    def __init__(self, message: str, wait_version: int | None = None, epoch: int | None = None) -> None:
        super().__init__(message)
        self.wait_version = wait_version
        self.epoch = epoch

    def extra(self) -> dict[str, str]:
        out = {} if self.wait_version is None else {"wait-version": str(self.wait_version)}
        if self.epoch is not None:
            out["epoch"] = str(self.epoch)
        return out


class Unavailable(HpsError):
    """A tier or its parent cannot do this right now; retry the same call with backoff."""

    code = "UNAVAILABLE"


class NotPrimary(Unavailable):
    """A standby root (or a deposed primary) refuses what only the primary does: a relay that
    lists both roots (``--parent A,B``) tries the other one; anyone else retries with backoff."""


class Exhausted(HpsError):
    """A budget of the tier is used up (bytes of pushes in flight, pushes per member, jobs);
    retry with backoff."""

    code = "RESOURCE_EXHAUSTED"


class NotBuilt(HpsError):
    """The feature exists in the protocol but is not built yet."""

    code = "UNIMPLEMENTED"


class TimedOut(HpsError):
    """A wait (barrier, pull) passed its deadline."""

    code = "DEADLINE_EXCEEDED"


class Internal(HpsError):
    """A bug: the tier could not handle a request it should have (logged where it happened)."""

    code = "INTERNAL"


class Unauthenticated(HpsError):
    """The call carried no credential this tier accepts (no token, or one it does not know).
    The sentence says which token to supply; it never echoes the one that was sent."""

    code = "UNAUTHENTICATED"


class PermissionDenied(HpsError):
    """The caller is known but may not do this: a job token used for another job, or a job
    token where the admin token is needed."""

    code = "PERMISSION_DENIED"


# The one table: every class a server may send, by the name that travels in the metadata.
ERRORS: dict[str, type[HpsError]] = {cls.__name__: cls for cls in (
    BadInput, UnknownJob, NotReady, NotMember, Conflict, Stale, Unavailable, NotPrimary, Exhausted,
    NotBuilt, TimedOut, Internal, Unauthenticated, PermissionDenied)}
