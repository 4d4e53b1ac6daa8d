"""Server lifecycle: ``create_server(config) -> (server, port, tier)``, ``serve(config)``.

>>> from ps.tools.status import fetch_ready
>>> async def up_and_down():
...     server, port, tier = await create_server(ServerConfig(role="global", listen="127.0.0.1:0"))
...     address = f"127.0.0.1:{port}"                                # port 0: the kernel picked it
...     ready = await asyncio.to_thread(fetch_ready, address)        # what a readiness probe sees
...     await shutdown(server, tier)      # probes NOT_SERVING, the tier stops, RPCs get grace seconds
...     return ready, await asyncio.to_thread(fetch_ready, address)  # no answer once stopped
>>> asyncio.run(up_and_down())
('ready', 'ready ?')

With ``health_port`` >= 0 a second gRPC server listens on ``--listen``'s host, plaintext, with
``grpc.health.v1.Health`` alone (``health_port(tier)`` says where): kubelet's gRPC probe cannot
do TLS, and the main port of a secure tier takes mutual TLS only. Nothing but the health
answers is on it (every hps method: UNIMPLEMENTED), so it needs no certificate.

``serve`` prints one ready line (``hps: serving ROLE NAME on HOST:PORT``) that ``hps launch``
reads to learn the bound port (with ``ready_stream=None``, as ``--log-format json`` runs it, the
line is logged as event ``tier.started`` instead), and stops gracefully on SIGTERM/SIGINT: the root writes a
final checkpoint, relays leave their parent, in-flight RPCs get ``grace`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import weakref
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from ps.core.config import ServerConfig
from ps.core.logs import event
from ps.net.rpc import SERVER_OPTIONS
from ps.net.tls import TlsFiles, server_credentials
from ps.server.auth import guard_for
from ps.server.health import Health, health_handler
from ps.server.service import handler
from ps.tiers.metrics import TierMetrics, process_registry, serve_metrics
from ps.tiers.outer import OuterRelay
from ps.tiers.tier import Tier

__all__ = ["create_server", "shutdown", "serve", "health_port"]

log = logging.getLogger("hps.server")

# What shutdown() must wind down besides the tier and the server: its health, its metrics, and
# the plaintext health-only server with its port (None without --health-port).
_OPS: weakref.WeakKeyDictionary[Tier, tuple[Health, TierMetrics, grpc.aio.Server | None, int | None]] = \
    weakref.WeakKeyDictionary()
# The health-only port takes nothing larger than a HealthCheckRequest (a service name).
_HEALTH_OPTIONS = [("grpc.max_receive_message_length", 4096), ("grpc.so_reuseport", 0)]


def _bind(add_port: Callable[[], int], address: str, what: str = "") -> int:
    """The port ``add_port`` bound, or OSError with a sentence: gRPC returns 0 or raises
    RuntimeError (by version) for an address in use or not of this host."""
    try:
        port = add_port()
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"could not bind {what}{address}: in use by another process, or not an address of "
                      "this host")
    return port


async def create_server(config: ServerConfig, registry: CollectorRegistry | None = None
                        ) -> tuple[grpc.aio.Server, int, Tier]:
    """Start a tier; its metrics go to ``registry`` (a fresh one if None, never the global)."""
    if config.role == "global":
        from ps.tiers.root import Root  # the optimizer and checkpoints: only the root needs them

        tier: Tier = Root(config)
    else:
        tier = OuterRelay(config)  # a relay; for outer jobs whose inner loop is its role, their root
    server = grpc.aio.server(options=SERVER_OPTIONS)
    metrics = TierMetrics(tier, registry if registry is not None else CollectorRegistry())
    health = Health(tier)
    server.add_generic_rpc_handlers([handler(tier, metrics.rpc, guard_for(config, tier))])
    server.add_generic_rpc_handlers([health_handler(health)])  # grpc.health.v1: probes
    if config.secure:
        creds = server_credentials(TlsFiles(config.tls_cert, config.tls_key, config.tls_ca))
        port = _bind(lambda: server.add_secure_port(config.listen, creds), config.listen)
    else:
        port = _bind(lambda: server.add_insecure_port(config.listen), config.listen)
    host = config.listen.rsplit(":", 1)[0]
    probe_server, probe_port = None, None
    if config.health_port >= 0:  # probes without TLS: this server has the health service and nothing else
        probe_server = grpc.aio.server(options=_HEALTH_OPTIONS)
        probe_server.add_generic_rpc_handlers([health_handler(health)])
        probe = f"{host}:{config.health_port}"
        probe_port = _bind(lambda: probe_server.add_insecure_port(probe), probe, "the health port ")
    tier.set_address(f"{host}:{port}")
    await server.start()
    if probe_server is not None:
        await probe_server.start()
    await tier.start()
    metrics.start()
    _OPS[tier] = (health, metrics, probe_server, probe_port)
    return server, port, tier


def health_port(tier: Tier) -> int | None:
    """The bound plaintext health-only port of a tier that create_server started, or None."""
    ops = _OPS.get(tier)
    return ops[3] if ops is not None else None


async def shutdown(server: grpc.aio.Server, tier: Tier, grace: float = 2.0) -> None:
    health, metrics, probe_server, _ = _OPS.pop(tier, (None, None, None, None))
    if health is not None:
        health.drain()  # probes answer NOT_SERVING while the tier winds down
        await metrics.stop()
    await tier.stop()
    await server.stop(grace)
    if probe_server is not None:  # last: probes see NOT_SERVING, not a refused port, while it drains
        await probe_server.stop(0)


async def serve(config: ServerConfig, ready_stream=sys.stdout) -> None:
    if not config.secure:  # said loudly: anyone who reaches the port is a member, a parent, an admin
        log.warning("INSECURE: %s %s serves plaintext gRPC with no client certificates (--insecure); "
                    "anyone who can reach %s can read and change its jobs. Use --tls-cert/--tls-key/--tls-ca "
                    "outside a debugging session.", config.role, config.display_name, config.listen,
                    extra=event("tier.insecure"))
    registry = process_registry()
    server, port, tier = await create_server(config, registry)
    host = config.listen.rsplit(":", 1)[0]
    metrics_port = None
    if config.metrics_port >= 0:
        # Same interface as gRPC: 0.0.0.0 in a pod, so Prometheus can scrape it.
        metrics_port = serve_metrics(registry, config.metrics_port, host).server_port
    extra = f" metrics {metrics_port}" if metrics_port is not None else ""
    if health_port(tier) is not None:
        extra += f" health {health_port(tier)}"
    ready = f"hps: serving {config.role} {config.display_name} on {host}:{port}{extra}"
    if ready_stream is not None:
        print(ready, file=ready_stream, flush=True)
    else:  # structured logs: the ready line is a log event too (launch finds it in the log)
        log.info(ready, extra=event("tier.started", address=f"{host}:{port}", metrics_port=metrics_port,
                                    health_port=health_port(tier)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping %s %s", config.role, config.display_name, extra=event("tier.stopping"))
    await shutdown(server, tier)
    log.info("stopped %s %s", config.role, config.display_name, extra=event("tier.stopped"))
