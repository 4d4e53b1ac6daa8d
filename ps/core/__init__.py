"""The pure, synchronous core: errors, configuration, domain types, the replica view, tensors
and codecs, delta logs, rounds and windows, exactly-once books, the optimizer.

Imports numpy, torch, zstandard and xxhash only -- never grpc, protobuf or asyncio
(tests/test_layers.py enforces it) -- so every piece is unit-tested without a loop or a network.
"""
