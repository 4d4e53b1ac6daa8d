"""A tier as a gRPC server: the servicer (decode, call the tier, encode), the health service,
and the server's lifecycle (``create_server``, ``shutdown``, ``serve``).

>>> import asyncio
>>> from ps.core.config import ServerConfig
>>> from ps.tools.status import fetch_status
>>> async def a_root():
...     server, port, tier = await create_server(ServerConfig(role="global", listen="127.0.0.1:0"))
...     status = await asyncio.to_thread(fetch_status, f"127.0.0.1:{port}")   # a client's Status call
...     await shutdown(server, tier)
...     return status.role, status.ready
>>> asyncio.run(a_root())
('global', True)

A process serves one with ``asyncio.run(serve(config))`` (what ``hps serve`` runs).
"""

from ps.server.lifecycle import create_server, serve, shutdown

__all__ = ["create_server", "serve", "shutdown"]
