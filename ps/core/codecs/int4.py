"""int4: int8's scheme at 4 bits, two values a byte (lossy, ~0.5 byte per element).

>>> import numpy as np
>>> x = np.linspace(-1, 1, 10_000, dtype=np.float32)
>>> codec = Int4(chunk=1024, seed=0)
>>> payload = codec.encode(x)
>>> len(payload)                             # a 16-byte header, 10 scales, half a byte each
5056
>>> y = codec.decode(payload, x.size)
>>> bool((abs(y - x) < 1 / 7).all())         # |y - x| < scale of x's chunk, E[y] = x
True

Each chunk of ``chunk`` elements is scaled so its largest |x| maps to 7, and rounded to one of
the 15 levels -7..7 up or down at random with the probability that makes the rounding unbiased
(QSGD with s = 7, Alistarh et al. 2017), as ``Int8`` does with 127. Meant for what a sender
keeps the error of and sends rarely: an ``outer`` job's pseudo-gradients (Streaming DiLoCo,
Douillard et al. 2025, sends its outer gradients in 4 bits without loss of quality).

Payload (little-endian): format | 3 pad | u32 chunk | u64 numel, then one float32 scale per
chunk, then ceil(numel / 2) bytes: element 2i in the low nibble of byte i, element 2i + 1 in
the high one, each stored as level + 8. A nibble of 0 (level -8) is never written; a decoder
reads it as -8 times the scale, finite and bounded like every other level.
"""

from __future__ import annotations

import struct

import torch

from ps.core.codecs._common import FORMAT, as_tensor, check_size, host_tensor, pack, read_header
from ps.core.codecs.base import Array, Device, Payload
from ps.core.codecs.int8 import MAX_CHUNK, Int8, dequantize_, quantize
from ps.core.errors import BadInput

__all__ = ["Int4"]

_HEAD = struct.Struct("<B3xIQ")  # format, chunk, numel (16 bytes); then float32 scales, nibbles
LEVELS = 7


class Int4(Int8):
    """Per-chunk absmax 4-bit levels with stochastic rounding; run it under error feedback.
    Int8's options and checks; its own levels, packing and default chunk.

        payload = Int4(seed=1).encode(pseudo_grad.cuda())   # rounding and packing on the GPU
    """

    name = "int4"

    def __init__(self, chunk: int = 1024, seed: int = 0) -> None:
        super().__init__(chunk, seed)

    def encode(self, x: Array) -> bytes:
        x = as_tensor(x)
        n = x.numel()
        scales, qs = quantize(x, self.chunk, LEVELS, self._rng.get(x.device))
        nibbles = torch.cat([q.reshape(-1) for q in qs]) if qs else x.new_zeros(0)
        nibbles = nibbles.add_(8).to(torch.uint8)
        if n % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])  # a level 0 pads
        pairs = nibbles.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        return pack(_HEAD.pack(FORMAT, self.chunk, n), *scales, packed)

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        chunk, _ = read_header(payload, _HEAD, self.name, numel)
        if not 1 <= chunk <= MAX_CHUNK:
            raise BadInput(f"int4 payload has chunk {chunk}, outside [1, {MAX_CHUNK}]")
        nchunks = -(-numel // chunk)
        nbytes = -(-numel // 2)
        check_size(payload, _HEAD.size + 4 * nchunks + nbytes, self.name, numel)
        scale = host_tensor(payload, "<f4", _HEAD.size, nchunks).to(device)
        packed = host_tensor(payload, "u1", _HEAD.size + 4 * nchunks, nbytes).to(device)
        levels = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]
        out = levels.float().sub_(8)  # small integers: exact in float32
        return dequantize_(out, scale, chunk)
