"""A tier as a gRPC server: the servicer (decode, call the tier, encode), the health service,
and the server's lifecycle (``create_server``, ``shutdown``, ``serve``).

    server, port, tier = await create_server(ServerConfig(role="global", listen="127.0.0.1:0"))
"""

from ps.server.lifecycle import create_server, serve, shutdown

__all__ = ["create_server", "serve", "shutdown"]
