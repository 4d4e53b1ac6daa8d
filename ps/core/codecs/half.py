"""Half-width floats: float16 behind a power-of-two scale, and bfloat16 (lossy, 2 bytes each).

>>> import numpy as np
>>> x = np.linspace(-1, 1, 1000, dtype=np.float32)
>>> codec = Fp16()
>>> y = codec.decode(codec.encode(x), x.size)
>>> bool((abs(y - x) <= 2**-11 * abs(x)).all())   # (normal range)
True
>>> y = Bf16().decode(Bf16().encode(x), x.size)
>>> bool((abs(y - x) <= 2**-8 * abs(x)).all())
True

Both round to nearest; use them with error feedback so the rounding is carried, not lost.
"""

from __future__ import annotations

import struct

import torch

from ps.core.codecs._common import FORMAT, as_tensor, check_size, host_tensor, pack, pow2_exponent, read_header
from ps.core.codecs.base import Array, Device, Payload, TensorCodec
from ps.core.errors import BadInput

__all__ = ["Fp16", "Bf16"]

_HEAD16 = struct.Struct("<Bxh4xQ")  # format, power-of-two exponent e, numel (16 bytes)
_HEADBF = struct.Struct("<B7xQ")    # format, numel (16 bytes)


class Fp16(TensorCodec):
    """float16 of x * 2**-e, with e chosen per payload so the largest |x| lands near 2**15.

        payload = Fp16().encode(torch.randn(1000, device="cuda"))   # rounds on the GPU
    """

    name = "fp16"

    def encode(self, x: Array) -> bytes:
        x = as_tensor(x)
        e = 0
        if x.numel():
            # aminmax reads x once and allocates no |x| temporary.
            lo, hi = torch.aminmax(x)
            e = pow2_exponent(torch.maximum(hi, -lo).item())
        h = (x * 2.0 ** -e).to(torch.float16)
        return pack(_HEAD16.pack(FORMAT, e, x.numel()), h)

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        e, _ = read_header(payload, _HEAD16, self.name, numel)
        if not -100 <= e <= 113:  # the encoder's range (pow2_exponent); 2**e stays normal
            raise BadInput(f"fp16 payload has scale exponent {e}, outside [-100, 113]")
        check_size(payload, _HEAD16.size + 2 * numel, self.name, numel)
        h = host_tensor(payload, "<f2", _HEAD16.size, numel).to(device)
        return h.float().mul_(2.0 ** e)


class Bf16(TensorCodec):
    """bfloat16 (float32's range, 8 bits of mantissa): no scale needed, round to nearest even.

        Bf16().decode(Bf16().encode(np.ones(3, np.float32)), 3)   # == [1, 1, 1]
    """

    name = "bf16"

    def encode(self, x: Array) -> bytes:
        x = as_tensor(x)
        # numpy has no bfloat16: the payload carries the raw 16-bit patterns.
        return pack(_HEADBF.pack(FORMAT, x.numel()), x.to(torch.bfloat16).view(torch.int16))

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        read_header(payload, _HEADBF, self.name, numel)
        check_size(payload, _HEADBF.size + 2 * numel, self.name, numel)
        bits = host_tensor(payload, "<i2", _HEADBF.size, numel).to(device)
        return bits.view(torch.bfloat16).float()
