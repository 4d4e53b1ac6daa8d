"""The codec interface."""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["Codec"]


class Codec(Protocol):
    """Encodes a 1-D float32 array into bytes and decodes it back.

        payload = codec.encode(np.ones(4, np.float32))
        codec.decode(payload, 4)
    """

    name: str
    lossless: bool

    def encode(self, x: np.ndarray) -> bytes:
        """Payload bytes for ``x`` (1-D, float32, C-contiguous)."""

    def decode(self, payload: memoryview | bytes, numel: int) -> np.ndarray:
        """A float32 array of ``numel`` elements; raises BadInput on a malformed payload."""
