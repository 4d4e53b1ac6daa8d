"""Row-sparse tensors as rows: the indices of the non-zero rows and their float32 values.

>>> import torch
>>> grad = torch.zeros(1000, 512)             # an embedding gradient, 512 floats per row
>>> grad[[3, 700]] = 1.0                         # the batch touched two rows
>>> codec = Rows(width=512)
>>> payload = codec.encode(grad.flatten())       # flat, a whole number of rows
>>> len(payload) // 1024, 4 * grad.numel() // 1024   # KiB: two rows' floats, not the table's
(4, 2000)
>>> dense = codec.decode(payload, grad.numel())  # bit-identical values; absent rows are zero
>>> dense.tobytes() == grad.numpy().tobytes()
True

An ``nn.Embedding(sparse=True)`` gradient, or any gradient whose batch touched few rows of a
table, costs its touched rows, not the table. After a 24-byte header (format, width, count,
numel) come the length of a zstd frame over the byte planes of the row-index gaps (int32; as
in top-k, their high bytes are nearly all zero) and then the rows' float32 values verbatim.
Lossless: every row with a non-zero element travels whole (a -0.0 in an otherwise zero row
arrives as +0.0, which no arithmetic can tell apart). A torch tensor is encoded on its device;
numpy input and ``decode`` need no torch (a relay of a lossless job never imports it), and
both paths make the same bytes and the same values.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from ps.core.codecs._host import FORMAT, is_tensor, read_header, to_numpy, unzstd
from ps.core.codecs.base import Array, Device, Payload, TensorCodec
from ps.core.errors import BadInput

if TYPE_CHECKING:
    import torch

__all__ = ["Rows"]

_HEAD = struct.Struct("<B3xIQQ")  # format, width, count, numel (24 bytes)
_LEN = struct.Struct("<I")        # bytes of the zstd frame of the index gaps
MAX_WIDTH = 1 << 20               # a row is at most one 4 MiB frame


class Rows(TensorCodec):
    """Sends only the rows of width ``width`` that hold a non-zero element (lossless).

        Rows(width=4).encode(np.array([0, 0, 0, 0, 1, 2, 3, 4], np.float32))   # one row
    """

    name = "rows"
    lossless = True
    options = ("width",)

    def __init__(self, width: int = 1) -> None:
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
            raise BadInput(f"rows width={width!r} must be an integer in [1, {MAX_WIDTH}]")
        self.width = width

    def encode(self, x: Array) -> bytes:
        w = self.width
        if is_tensor(x):
            import torch

            from ps.core.codecs._common import as_tensor

            t = as_tensor(x)
            n = t.numel()
            if n % w:
                raise BadInput(f"rows codec: {n} elements are not whole rows of width {w}")
            table = t.view(-1, w)
            idx = (table != 0).any(dim=1).nonzero().squeeze(1)  # on the device; NaN rows count
            gaps = torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32).cpu().numpy()
            values = table.index_select(0, idx).contiguous().cpu().numpy()  # only the rows cross
        else:
            a = to_numpy(x)
            n = a.size
            if n % w:
                raise BadInput(f"rows codec: {n} elements are not whole rows of width {w}")
            rows = a.reshape(-1, w)
            hit = np.flatnonzero((rows != 0).any(axis=1))  # NaN rows count, as on a device
            gaps = np.diff(hit, prepend=0).astype(np.int32)
            values = rows[hit]
        frame = zstandard.ZstdCompressor(level=1).compress(gaps.view(np.uint8).reshape(-1, 4).T.tobytes())
        return b"".join([_HEAD.pack(FORMAT, w, len(gaps), n), _LEN.pack(len(frame)), frame, values])

    def _rows(self, payload: Payload, numel: int) -> tuple[int, np.ndarray, int]:
        """(width, the row indices, where the values start), every length and index checked."""
        w, count, _ = read_header(payload, _HEAD, self.name, numel)
        if not 1 <= w <= MAX_WIDTH or numel % w or count > numel // w:
            raise BadInput(f"rows payload has {count} rows of width {w} for a chunk of {numel} "
                           "elements; the width must divide the chunk and the rows fit in it")
        pos = _HEAD.size + _LEN.size
        if len(payload) < pos:
            raise BadInput(f"rows payload has {len(payload)} bytes, shorter than its header")
        (flen,) = _LEN.unpack_from(payload, _HEAD.size)
        want = pos + flen + 4 * w * count
        if len(payload) != want:
            raise BadInput(f"rows payload has {len(payload)} bytes, expected {want} for {count} rows "
                           f"of width {w}")
        body = unzstd(memoryview(payload)[pos:pos + flen], 4 * count, self.name)
        planes = np.frombuffer(body, np.uint8).reshape(4, count)
        gaps = planes.T.copy().view("<i4").reshape(-1)
        if count and (gaps[0] < 0 or (count > 1 and bool((gaps[1:] < 1).any()))):
            raise BadInput("rows payload has row indices that are not strictly increasing")
        idx = gaps.cumsum(dtype=np.int64)
        if count and idx[-1] >= numel // w:
            raise BadInput(f"rows payload has row {int(idx[-1])} for a chunk of {numel // w} rows")
        return w, idx, pos + flen

    def decode(self, payload: Payload, numel: int) -> np.ndarray:
        w, idx, at = self._rows(payload, numel)
        out = np.zeros((numel // w, w), np.float32)
        out[idx] = np.frombuffer(payload, "<f4", count=len(idx) * w, offset=at).reshape(len(idx), w)
        return out.reshape(-1)

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        import torch

        from ps.core.codecs._common import host_tensor

        w, idx, at = self._rows(payload, numel)
        values = host_tensor(payload, "<f4", at, len(idx) * w).to(device).view(len(idx), w)
        out = torch.zeros(numel // w, w, dtype=torch.float32, device=device)
        return out.index_copy_(0, torch.from_numpy(idx).to(device), values).view(-1)
