"""The network layer: the protocol's generated code (``proto/``), the one place protobuf meets
domain types (``wire``), the gRPC call helpers and status table (``rpc``), and a relay's link to
its parent (``upstream``). Imports ``ps.core`` only.
"""
