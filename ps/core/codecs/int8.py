"""int8 with one float32 scale per chunk and stochastic rounding (lossy, ~1 byte per element).

>>> import numpy as np
>>> x = np.linspace(-1, 1, 10_000, dtype=np.float32)
>>> codec = Int8(chunk=4096, seed=0)
>>> payload = codec.encode(x)
>>> len(payload)                             # a 16-byte header, 3 scales, one byte per element
10028
>>> y = codec.decode(payload, x.size)
>>> bool((abs(y - x) < 1 / 127).all())       # |y - x| < scale of x's chunk, E[y] = x
True

Each chunk of ``chunk`` elements is scaled so its largest |x| maps to 127 and rounded up or
down at random with the probability that makes the rounding unbiased (QSGD, Alistarh et al.
2017). The noise comes from the codec's own seeded generator, so a run is reproducible.
"""

from __future__ import annotations

import struct

import torch

from ps.core.codecs._common import FORMAT, Generators, as_tensor, check_size, host_tensor, pack, read_header
from ps.core.codecs.base import Array, Device, Payload, TensorCodec
from ps.core.errors import BadInput

__all__ = ["Int8", "quantize", "dequantize_"]

_HEAD = struct.Struct("<B3xIQ")  # format, chunk, numel (16 bytes); then float32 scales, int8s
MAX_CHUNK = 1 << 20              # bounds what a hostile header can make a decoder compute over


def _parts(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """``x`` as 2-D views of whole chunks and the ragged tail, with no padded copy."""
    full = x.numel() // chunk * chunk
    parts = [x[:full].view(-1, chunk)] if full else []
    return parts + ([x[full:].view(1, -1)] if full < x.numel() else [])


def quantize(x: torch.Tensor, chunk: int, levels: int,
             gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-chunk scales (absmax / ``levels``) and the chunks' values in [-levels, levels],
    rounded stochastically (float32, integral), on ``x``'s device."""
    scales, qs = [], []
    for part in _parts(x, chunk):
        lo, hi = torch.aminmax(part, dim=1)
        scale = torch.maximum(hi, -lo) / levels
        # Divided, not multiplied by 1 / scale: a chunk of subnormal values has a scale whose
        # reciprocal overflows to inf, which made 0 * inf = NaN (int8 sent the chunk as zeros,
        # int4 its zeros as level -8). An all-zero chunk (scale 0) is divided by 1.
        v = part / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        # floor(v + u), u ~ U[0, 1): rounds up with probability frac(v), so E[q] = v.
        v.add_(torch.rand(v.shape, generator=gen, device=v.device)).floor_()
        # v + u can round up to exactly levels + 1 in float32 when v is levels - tiny.
        qs.append(v.clamp_(-levels, levels))
        scales.append(scale)
    return scales, qs


def dequantize_(out: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
    """``out`` (the decoded levels, float32) times its chunks' scales, in place."""
    parts = _parts(out, chunk)
    for part, s in zip(parts, scale.split([p.shape[0] for p in parts])):
        part.mul_(s[:, None])  # in place through the view: one float32 product per element
    return out


class Int8(TensorCodec):
    """Per-chunk absmax int8 with stochastic rounding; run it under error feedback.

        payload = Int8(seed=1).encode(grad.cuda())   # scales, noise and rounding on the GPU
    """

    name = "int8"
    options = ("chunk", "seed")

    def __init__(self, chunk: int = 4096, seed: int = 0) -> None:
        if not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
            raise BadInput(f"{self.name} chunk={chunk!r} must be an integer in [1, {MAX_CHUNK}]")
        self.chunk = chunk
        self.seed = seed
        self._rng = Generators(seed)

    def encode(self, x: Array) -> bytes:
        x = as_tensor(x)
        scales, qs = quantize(x, self.chunk, 127, self._rng.get(x.device))
        head = _HEAD.pack(FORMAT, self.chunk, x.numel())
        return pack(head, *scales, *(q.to(torch.int8).reshape(-1) for q in qs))

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        chunk, _ = read_header(payload, _HEAD, self.name, numel)
        if not 1 <= chunk <= MAX_CHUNK:
            raise BadInput(f"int8 payload has chunk {chunk}, outside [1, {MAX_CHUNK}]")
        nchunks = -(-numel // chunk)
        check_size(payload, _HEAD.size + 4 * nchunks + numel, self.name, numel)
        scale = host_tensor(payload, "<f4", _HEAD.size, nchunks).to(device)
        out = host_tensor(payload, "i1", _HEAD.size + 4 * nchunks, numel).to(device).float()
        return dequantize_(out, scale, chunk)
