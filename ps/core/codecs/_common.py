"""Helpers shared by the codecs: input coercion, payload headers, exact zstd, scales (pure).

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
check every length before it allocates anything.
"""

from __future__ import annotations

import math
import struct
import sys
import warnings

import numpy as np
import torch
import zstandard

from ps.core.errors import BadInput

__all__ = [
    "FORMAT", "as_tensor", "to_numpy", "pack", "read_header", "check_size", "host_tensor",
    "unzstd", "ZSTD_MAX_RATIO", "pow2_exponent", "Generators",
]

# Payloads are little-endian on the wire, and torch's ``.view(dtype)`` reinterprets bytes in
# the host's order; every machine torch ships for is little-endian, so say so once.
assert sys.byteorder == "little", "hps codecs assume a little-endian host"

FORMAT = 1  # payload format written by this build; a decoder refuses any other


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


def to_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    """A contiguous float32 numpy array of ``x`` on the host (what the dense codecs send)."""
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).to("cpu", torch.float32).numpy()
    return np.ascontiguousarray(x, dtype="<f4").reshape(-1)


def pack(header: bytes, *parts: torch.Tensor) -> bytes:
    """``header`` followed by the raw bytes of each part, each copied to the host once."""
    return b"".join([header, *(p.contiguous().cpu().numpy() for p in parts)])


def read_header(payload: memoryview | bytes, fmt: struct.Struct, what: str, numel: int) -> tuple:
    """The header's fields after the format byte; BadInput when short, newer, or for another size.

    The last field of every header is the element count the encoder saw.
    """
    if len(payload) < fmt.size:
        raise BadInput(f"{what} payload has {len(payload)} bytes, shorter than its "
                       f"{fmt.size}-byte header")
    version, *fields = fmt.unpack_from(payload, 0)
    if version != FORMAT:
        raise BadInput(f"{what} payload has format {version}; this build reads format {FORMAT}")
    if fields[-1] != numel:
        raise BadInput(f"{what} payload encodes {fields[-1]} elements, the chunk declares {numel}")
    return tuple(fields)


def check_size(payload: memoryview | bytes, want: int, what: str, numel: int) -> None:
    if len(payload) != want:
        raise BadInput(f"{what} payload has {len(payload)} bytes, expected {want} for "
                       f"{numel} elements")


def host_tensor(buf: memoryview | bytes, dtype: str, offset: int, count: int) -> torch.Tensor:
    """A CPU tensor holding ``count`` items of ``dtype`` at ``offset`` of ``buf``.

    It copies: the buffer may be read-only (bytes, a gRPC message) and torch refuses to view
    read-only memory; what is copied is the compact payload, never the decoded tensor.
    """
    return torch.from_numpy(np.frombuffer(buf, dtype=dtype, count=count, offset=offset).copy())


# No zstd frame decompresses to more than this many times its own size: a block regenerates
# at most 128 KiB and takes at least 4 bytes (an RLE block: a 3-byte header and the byte it
# repeats; RFC 8878, 3.1.1.2). A size past this is a lie, refused before anything is allocated.
ZSTD_MAX_RATIO = 1 << 15


def unzstd(frame: memoryview | bytes, size: int, what: str) -> bytes:
    """Decompress one zstd frame that must hold exactly ``size`` bytes; BadInput otherwise.

    The size is checked before decompressing, against the chunk (the frame must declare exactly
    ``size``) and against the frame's own length (``ZSTD_MAX_RATIO``), so a few hostile bytes
    cannot make the receiver allocate what a huge declared element count implies: a 39-byte
    top-k payload claiming 2**38 of 2**40 elements raised MemoryError (it allocated first).
    """
    if size > ZSTD_MAX_RATIO * len(frame):
        raise BadInput(f"{what} payload of {len(frame)} bytes cannot decompress to the {size} bytes "
                       "its element count needs")
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != size:
            said = "does not declare its size" if declared == -1 else f"declares {declared} bytes"
            raise BadInput(f"{what} payload's zstd frame {said}; its element count needs {size}")
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise BadInput(f"{what} payload does not decompress: {exc}") from None
    if len(out) != size:
        raise BadInput(f"{what} payload decompresses to {len(out)} bytes, expected {size}")
    return out


def pow2_exponent(amax: float) -> int:
    """e such that amax * 2**-e lies in [2**14, 2**15): float16's range with headroom.

    A power of two scales exactly (no rounding of its own), so float16 keeps its 11 bits of
    precision for any gradient magnitude instead of overflowing above 65504 or flushing small
    gradients to zero. e is clamped so 2**e and 2**-e are normal float32 numbers.
    """
    if not math.isfinite(amax) or amax <= 0:
        return 0  # zeros need no scale; a non-finite input stays non-finite for the receiver
    return max(-100, math.frexp(amax)[1] - 15)


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
