"""Helpers shared by the lossy codecs: torch input coercion, packing, host tensors, seeded noise (pure).

>>> HEAD = struct.Struct("<Bxh4xQ")                    # fp16's: format, exponent e, numel
>>> x = as_tensor(np.full(4, 8, np.float32))          # numpy (zero-copy) or torch -> 1-D float32
>>> e = pow2_exponent(float(x.abs().max()))
>>> payload = pack(HEAD.pack(FORMAT, e, x.numel()), (x * 2.0**-e).half())   # one host copy
>>> read_header(payload, HEAD, "fp16", 4)             # the fields after the format byte
(-11, 4)
>>> read_header(payload, HEAD, "fp16", 5)
Traceback (most recent call last):
ps.core.errors.BadInput: fp16 payload encodes 4 elements, the chunk declares 5

Every lossy payload starts with a fixed little-endian header whose first byte is the payload
format and which records the element count, so a payload describes itself and a decoder can
check every length before it allocates anything. The helpers that need no torch (headers,
exact zstd, scales) are in ``_host``, re-exported here.
"""

from __future__ import annotations

import struct  # noqa: F401  (the example above uses it)
import warnings

import numpy as np
import torch

from ps.core.codecs._host import (
    FORMAT,
    ZSTD_MAX_RATIO,
    check_size,
    is_tensor,
    pow2_exponent,
    read_header,
    to_numpy,
    unzstd,
)
from ps.core.errors import BadInput

__all__ = [
    "FORMAT", "as_tensor", "to_numpy", "pack", "read_header", "check_size", "host_tensor",
    "unzstd", "ZSTD_MAX_RATIO", "pow2_exponent", "Generators", "is_tensor",
]


def as_tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat float32 view of ``x`` on its own device (copies only to flatten or convert)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
    elif isinstance(x, np.ndarray):
        arr = np.ascontiguousarray(x, dtype=np.float32)
        if arr.flags.writeable:
            t = torch.from_numpy(arr)
        else:
            # Codecs only read their input, so a read-only view is safe; torch warns regardless.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(arr)
    else:
        raise BadInput(f"a codec encodes a numpy array or a torch tensor, not {type(x).__name__}")
    t = t.reshape(-1)
    return t if t.dtype == torch.float32 else t.float()


def pack(header: bytes, *parts: torch.Tensor) -> bytes:
    """``header`` followed by the raw bytes of each part, each copied to the host once."""
    return b"".join([header, *(p.contiguous().cpu().numpy() for p in parts)])


def host_tensor(buf: memoryview | bytes, dtype: str, offset: int, count: int) -> torch.Tensor:
    """A CPU tensor holding ``count`` items of ``dtype`` at ``offset`` of ``buf``.

    It copies: the buffer may be read-only (bytes, a gRPC message) and torch refuses to view
    read-only memory; what is copied is the compact payload, never the decoded tensor.
    """
    return torch.from_numpy(np.frombuffer(buf, dtype=dtype, count=count, offset=offset).copy())


class Generators:
    """One seeded ``torch.Generator`` per device, created on first use (reproducible noise)."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._by_device: dict[torch.device, torch.Generator] = {}

    def get(self, device: torch.device) -> torch.Generator:
        gen = self._by_device.get(device)
        if gen is None:
            gen = self._by_device[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen
