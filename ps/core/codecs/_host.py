"""The codecs' helpers that need no torch: payload headers, exact zstd, scales, host arrays.

>>> HEAD = struct.Struct("<Bxh4xQ")                    # fp16's: format, exponent e, numel
>>> read_header(HEAD.pack(FORMAT, -11, 4), HEAD, "fp16", 4)   # the fields after the format byte
(-11, 4)
>>> unzstd(b"not zstd", 8, "rows")
Traceback (most recent call last):
ps.core.errors.BadInput: rows payload does not decompress: error when determining content size

A relay of lossless jobs (fp32, fp32+zstd, rows) decodes and encodes with these alone, so it
never imports torch: a zone serves 0.38 s after it starts instead of 2.33 s and holds 57 MB
instead of 239 MB (``benchmarks/start.py``). The torch helpers of the lossy codecs are in
``_common``.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import TYPE_CHECKING, cast

import numpy as np
import zstandard

from ps.core.errors import BadInput

if TYPE_CHECKING:
    import torch

__all__ = ["FORMAT", "is_tensor", "to_numpy", "read_header", "check_size", "unzstd", "ZSTD_MAX_RATIO",
           "pow2_exponent"]

# Payloads are little-endian on the wire, and torch's ``.view(dtype)`` reinterprets bytes in
# the host's order; every machine torch ships for is little-endian, so say so once.
assert sys.byteorder == "little", "hps codecs assume a little-endian host"

FORMAT = 1  # payload format written by this build; a decoder refuses any other


def is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch: a process that never imported
    it (a relay of lossless jobs) holds no tensor.

    >>> is_tensor(np.zeros(2))
    False
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    """A contiguous float32 numpy array of ``x`` on the host (what the dense codecs send)."""
    if is_tensor(x):
        import torch  # loaded already: x is a tensor

        return cast(torch.Tensor, x).detach().reshape(-1).to("cpu", torch.float32).numpy()
    return np.ascontiguousarray(x, dtype="<f4").reshape(-1)


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
        # allow_extra_data=False: bytes after the frame are refused, not ignored.
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size, allow_extra_data=False)
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
