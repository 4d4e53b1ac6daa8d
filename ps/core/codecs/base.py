"""The codec interface, and the base class of the torch-implemented (lossy) codecs.

>>> from ps.core.codecs import get_codec
>>> codec = get_codec("fp16")                      # a LossyCodec (a TensorCodec underneath)
>>> payload = codec.encode(np.ones(4, np.float32))  # or a torch tensor, on any device
>>> codec.decode(payload, 4)                        # float32 numpy array on the host
array([1., 1., 1., 1.], dtype=float32)
>>> import torch
>>> y = torch.full((4,), 3.0)
>>> codec.subtract_decoded_(y, payload); y          # what error feedback keeps, on y's device
tensor([2., 2., 2., 2.])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeAlias

import numpy as np

if TYPE_CHECKING:  # the interface needs no torch: a lossless codec runs without it
    import torch

__all__ = ["Codec", "LossyCodec", "TensorCodec", "Array", "Payload", "Device"]

Array: TypeAlias = "np.ndarray | torch.Tensor"  # what a codec encodes: a flat float32 tensor
Payload: TypeAlias = "bytes | memoryview"       # what it decodes: bytes it made (or a slice of a frame)
Device: TypeAlias = "torch.device | str"


class Codec(Protocol):
    """Encodes a flat float32 tensor into bytes and decodes it back.

        payload = codec.encode(np.ones(4, np.float32))   # or a torch tensor, on any device
        codec.decode(payload, 4)                          # float32 numpy array on the host
    """

    name: str
    lossless: bool

    def encode(self, x: np.ndarray | torch.Tensor) -> bytes:
        """Payload bytes for ``x`` (flattened, as float32)."""

    def decode(self, payload: memoryview | bytes, numel: int) -> np.ndarray:
        """A float32 array of ``numel`` elements; raises BadInput on a malformed payload."""


class LossyCodec(Codec, Protocol):
    """A codec whose sender keeps the error (``ps.core.codecs.feedback.ErrorFeedback``).

        y -= decode(payload)      # as codec.subtract_decoded_(y, payload), on y's device
    """

    def decode_tensor(self, payload: memoryview | bytes, numel: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
        """The decoded float32 tensor on ``device``; bit-identical to ``decode`` on every device."""

    def subtract_decoded_(self, y: torch.Tensor, payload: memoryview | bytes) -> None:
        """``y -= decode(payload)`` in place, on ``y``'s device."""


class TensorCodec:
    """Shared plumbing: one decode path (``decode_tensor``) serves the host and the device.
    Subclasses define ``name``, ``encode`` and ``decode_tensor``.

    Decoding uses only exact operations (widening casts, products with a power of two or one
    float32 scale, scatters), which IEEE float32 makes identical on CPU and GPU: every tier
    that decodes the same bytes holds the same numbers (invariant 6).
    """

    name: str
    lossless = False
    options: tuple[str, ...] = ()  # keyword options ``get_codec(name, **options)`` accepts

    def encode(self, x: Array) -> bytes:
        raise NotImplementedError

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        raise NotImplementedError

    def decode(self, payload: memoryview | bytes, numel: int) -> np.ndarray:
        return self.decode_tensor(payload, numel, "cpu").numpy()

    def subtract_decoded_(self, y: torch.Tensor, payload: memoryview | bytes) -> None:
        y.sub_(self.decode_tensor(payload, y.numel(), y.device))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.options)
        return f"{type(self).__name__}({opts})"
