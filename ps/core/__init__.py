"""The pure, synchronous core: errors, configuration, domain types, the replica view, tensors
and codecs, delta logs, rounds and windows, exactly-once books, the optimizer.

Imports numpy, torch, zstandard and xxhash only -- never grpc, protobuf or asyncio
(tests/test_layers.py enforces it) -- so every piece is unit-tested without a loop or a network.

>>> import torch
>>> from ps.core.codecs import get_codec
>>> from ps.core.tensors import assemble, split
>>> from ps.core.view import KeySpec, Layout
>>> layout = Layout([KeySpec("w", (4, 3)), KeySpec("b", (3,))])
>>> chunks = split(layout, torch.ones(layout.numel), get_codec("fp16"))   # what a push carries
>>> float(assemble(layout, chunks, what="push").sum())                    # what a tier decodes
15.0
"""
