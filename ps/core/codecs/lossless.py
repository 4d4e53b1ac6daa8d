"""Lossless codecs: raw float32, and float32 behind a zstandard stage.

>>> x = np.zeros(1000, np.float32)
>>> len(Fp32().encode(x)), len(Fp32Zstd(level=1).encode(x))   # zeros compress, gradients little
(4000, 19)
>>> Fp32Zstd().decode(Fp32Zstd().encode(x), x.size).tobytes() == x.tobytes()   # bit for bit
True
"""

from __future__ import annotations

import numpy as np
import zstandard

from ps.core.codecs._host import to_numpy, unzstd
from ps.core.codecs.base import Array, Payload
from ps.core.errors import BadInput

__all__ = ["Fp32", "Fp32Zstd"]


class Fp32:
    """Little-endian float32 bytes, zero-copy on decode.

        Fp32().decode(Fp32().encode(x), x.size)  # == x, bit for bit
    """

    name = "fp32"
    lossless = True

    def encode(self, x: Array) -> bytes:
        return to_numpy(x).tobytes()

    def decode(self, payload: Payload, numel: int) -> np.ndarray:
        if len(payload) != 4 * numel:
            raise BadInput(
                f"fp32 payload has {len(payload)} bytes, expected {4 * numel} for {numel} elements"
            )
        return np.frombuffer(payload, dtype="<f4")


class Fp32Zstd:
    """float32 bytes compressed with zstandard (level 1: fast; gradients compress little)."""

    name = "fp32+zstd"
    lossless = True
    options = ("level",)

    def __init__(self, level: int = 1) -> None:
        self._level = level

    def encode(self, x: Array) -> bytes:
        raw = to_numpy(x).tobytes()
        # zstd contexts are not thread-safe; a fresh compressor per call is cheap next to the data.
        return zstandard.ZstdCompressor(level=self._level).compress(raw)

    def decode(self, payload: Payload, numel: int) -> np.ndarray:
        # The frame must declare its size (this encoder always writes it), checked before
        # anything is allocated: a frame without one made the decompressor allocate
        # max_output_size up front, and a 16-byte payload for 2**40 elements raised MemoryError.
        return Fp32().decode(unzstd(payload, 4 * numel, self.name), numel)
