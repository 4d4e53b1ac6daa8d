"""Scaled sign: one bit per element and one scale, mean |x| (lossy, 32x smaller than float32).

>>> import numpy as np
>>> x = np.array([1, -3, 0, 2], np.float32)
>>> codec = Sign()
>>> codec.decode(codec.encode(x), x.size)   # y = mean(|x|) * sign(x), zeros as +
array([ 1.5, -1.5,  1.5,  1.5], dtype=float32)

The scale mean |x| = ||x||_1 / d is the one that makes sign compression work with error
feedback (EF-SignSGD, Karimireddy et al. 2019); without the residual, signSGD is biased.
Bits are packed most significant first, as ``numpy.packbits`` does.
"""

from __future__ import annotations

import struct

import torch

from ps.core.codecs._common import FORMAT, as_tensor, check_size, host_tensor, pack, read_header
from ps.core.codecs.base import Array, Device, Payload, TensorCodec
from ps.core.errors import BadInput

__all__ = ["Sign"]

_HEAD = struct.Struct("<B3xfQ")  # format, scale (float32), numel (16 bytes); then the bits


def _shifts(device: Device) -> torch.Tensor:
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


class Sign(TensorCodec):
    """1 bit per element (set: x >= 0) and the float32 scale mean |x|.

        payload = Sign().encode(grad.cuda())   # packs the bits on the GPU, copies n/8 bytes
    """

    name = "sign"

    def encode(self, x: Array) -> bytes:
        x = as_tensor(x)
        n = x.numel()
        # ||x||_1 / n reads x once; x.abs().mean() would first write a |x| temporary.
        scale = torch.linalg.vector_norm(x, ord=1).item() / n if n else 0.0
        bits = (x >= 0).to(torch.uint8)
        if n % 8:
            bits = torch.cat([bits, bits.new_zeros(8 - n % 8)])
        packed = (bits.view(-1, 8) << _shifts(x.device)).sum(dim=1, dtype=torch.uint8)
        return pack(_HEAD.pack(FORMAT, scale, n), packed)

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        scale, _ = read_header(payload, _HEAD, self.name, numel)
        nbytes = -(-numel // 8)
        check_size(payload, _HEAD.size + nbytes, self.name, numel)
        if scale < 0:
            raise BadInput(f"sign payload has a negative scale {scale}; the encoder writes mean |x|")
        packed = host_tensor(payload, "u1", _HEAD.size, nbytes).to(device)
        bits = ((packed[:, None] >> _shifts(device)) & 1).reshape(-1)[:numel]
        # 2b - 1 is exactly +-1, and +-1 times the float32 scale is exact: +-scale on every device.
        return bits.float().mul_(2).sub_(1).mul_(scale)
