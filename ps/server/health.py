"""The standard gRPC health service (``grpc.health.v1.Health``) of a tier: what probes ask.

>>> from ps.core.config import ServerConfig
>>> from ps.tiers.relay import Relay
>>> from ps.tiers.root import Root
>>> name = health_pb2.HealthCheckResponse.ServingStatus.Name
>>> root = Health(Root(ServerConfig(role="global")))    # served: health_handler(health)
>>> name(root.status("")), root.status("no.such.Service")      # ready at once; unknown: NOT_FOUND
('SERVING', None)
>>> root.status(RELAY_READY) is None                          # "are you a ready relay?": not a relay
True
>>> async def probe(parent):
...     zone = Relay(ServerConfig(role="zone", parent=parent, name="eu-b"))
...     health = Health(zone)
...     seen = [name(health.status(s)) for s in ("", LIVENESS, RELAY_READY)]    # before it synced
...     await zone.start()
...     while not zone.synced(): await asyncio.sleep(0.05)
...     seen.append(name(health.status(RELAY_READY)))
...     health.drain()        # on SIGTERM, before the server stops: every service NOT_SERVING
...     seen.append(name(health.status(LIVENESS)))
...     await zone.stop()
...     return seen
>>> asyncio.run(probe(address))
['NOT_SERVING', 'SERVING', 'NOT_SERVING', 'SERVING', 'NOT_SERVING']

Readiness is service ``""`` (and the hps service's own name): SERVING once the tier has synced
with its parent -- the root at once, a relay once its upstream link has succeeded (a heartbeat
or a register answered) and it holds a view of every job it serves. It stays SERVING through
a short loss of every parent (up to the member timeout: a parent restarting, a switch to an
alternate): the relay still serves the view it holds, and flipping readiness would empty the
Kubernetes Services below it, so a root restart would cascade down the whole tree and every
child would sit out gRPC's reconnect backoff. Cut off longer, it is NOT_SERVING: its parent
has dropped it, its view no longer moves, and workers are better sent to a zone that still
trains (``ps.tiers.parents``). A lost parent is also reported by ``hps_upstream_reachable``.
Liveness is service ``hps.liveness``: SERVING while the event loop answers at all.
Service ``hps.relay`` is readiness for a relay (zone or regional master) and NOT_FOUND at a
root: what a relay on an alternate parent asks its first parent before it moves back to it
(``ps.tiers.parents``), with no token (a restarted parent knows no job's token yet), and never
to a root (of a hot-standby pair, a relay follows whichever is the primary).

Every answer is computed from the tier's state when asked; there is nothing to keep in sync.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps.net.wire import RELAY_READY, SERVICE

__all__ = ["Health", "LIVENESS", "RELAY_READY", "health_handler"]

LIVENESS = "hps.liveness"
_READINESS = ("", SERVICE)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self, tier, poll_s: float | None = None) -> None:
        self.tier = tier
        self.poll_s = poll_s or max(0.05, tier.config.heartbeat_s / 2)
        self.draining = False

    def drain(self) -> None:
        """From now on every service answers NOT_SERVING (graceful shutdown)."""
        self.draining = True

    def status(self, service: str):
        """The ServingStatus of ``service``, or None for a service this server does not know."""
        if service == RELAY_READY and self.tier.role == "global":
            return None
        if service not in (LIVENESS, RELAY_READY) and service not in _READINESS:
            return None
        if self.draining:
            return _NOT_SERVING
        if service == LIVENESS or self.tier.synced():
            return _SERVING
        return _NOT_SERVING

    async def Check(self, request, context):
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown service {request.service!r} at this {self.tier.role} tier; ask "
                                f"for '' (readiness) or {LIVENESS!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        # Polled: readiness changes at most once per heartbeat, and watchers are rare (probes
        # use Check), so a short sleep is simpler than change notifications from the tier.
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await asyncio.sleep(self.poll_s)


def health_handler(health: Health) -> grpc.GenericRpcHandler:
    """``grpc.health.v1.Health`` with requests parsed here: a request that does not parse gets
    INVALID_ARGUMENT with a sentence (the generated servicer answered UNKNOWN and logged a
    traceback for each)."""
    async def parsed(data: bytes, context) -> health_pb2.HealthCheckRequest:
        try:
            return health_pb2.HealthCheckRequest.FromString(data)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the HealthCheckRequest does not parse")

    async def check(data, context):
        return await health.Check(await parsed(data, context), context)

    async def watch(data, context):
        await health.Watch(await parsed(data, context), context)

    serialize = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(check, None, serialize),
        "Watch": grpc.unary_stream_rpc_method_handler(watch, None, serialize),
    })
