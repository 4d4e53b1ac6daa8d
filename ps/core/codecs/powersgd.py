"""PowerSGD: a matrix as two rank-r factors, P (rows x r) and Q (cols x r) (Vogels et al. 2019).

>>> g = torch.Generator().manual_seed(0)
>>> m = torch.randn(64, 2, generator=g) @ torch.randn(2, 48, generator=g)   # a rank-2 matrix
>>> codec = PowerSGD(rank=2, width=48)               # rank r; rows of 48 elements
>>> payload = codec.encode(m.flatten())
>>> len(payload), 4 * m.numel()                      # 32-byte header, P and Q in float32
(928, 12288)
>>> y = codec.decode(payload, m.numel())             # P Q^T: a rank-2 matrix comes back
>>> bool(abs(torch.from_numpy(y) - m.flatten()).max() < 1e-4)
True
>>> q = codec.factors(payload, m.numel())[1]         # the sender keeps Q: next step's warm start
>>> payload = codec.warm(q).encode(m.flatten())      # one power iteration from there

One power iteration per step, as torch's ``powerSGD_hook`` does: P = M Q with the Q of the
previous step (warm start; a seeded random one the first time), P orthonormalised (QR), then
Q = M^T P, and the receiver decodes P Q^T, M projected onto P's columns. The sender keeps Q
(``ps.core.encoder.Encoder``) and, like every lossy codec here, runs under error feedback: what
the projection misses is added to the next step (design invariant 6). A relay decodes its
children's factors to dense matrices, sums them and compresses the sum with its own Q and
residual.

The codec needs the matrix's shape: ``width`` is the row length (``ps.core.tensors.split``
gives each key of two or more dimensions its own, viewing it as shape[0] x the rest, as torch
does), and a payload records rows, columns and rank, so any instance decodes any payload. Keys
where factors would not save at least ``MIN_COMPRESSION_RATE`` (1-D keys, small matrices)
travel as fp32 instead (torch's ``min_compression_rate``).

The payload, after a 32-byte header (format, rank, rows, cols, numel), holds P^T and Q^T as
little-endian float32. Decoding sums the r outer products in a fixed order with one rounding
per product and per sum (no matmul, whose summation order varies by device and library), so
every tier that decodes the same bytes gets the same numbers, on a CPU or a GPU.
"""

from __future__ import annotations

import struct

import torch

from ps.core.codecs._common import FORMAT, Generators, as_tensor, check_size, host_tensor, read_header
from ps.core.codecs.base import Array, Device, Payload, TensorCodec
from ps.core.config import POWERSGD_MAX_RANK as MAX_RANK
from ps.core.errors import BadInput

__all__ = ["PowerSGD", "MAX_RANK", "MIN_COMPRESSION_RATE"]

_HEAD = struct.Struct("<B3xIQQQ")  # format, rank, rows, cols, numel (32 bytes); then P^T, Q^T
# Compress a matrix only if P and Q are at least this many times smaller than it (torch's
# PowerSGDState.min_compression_rate default): below it the factors save little and lose much.
MIN_COMPRESSION_RATE = 2.0


class PowerSGD(TensorCodec):
    """Rank-``rank`` factors of a matrix of rows ``width`` long (0: the whole input is one row).

        codec = get_codec("powersgd", rank=4, width=768)       # a (n, 768) weight's gradient
        payload = codec.warm(q).encode(grad)                   # q: this key's Q from last step
    """

    name = "powersgd"
    options = ("rank", "width", "seed")

    def __init__(self, rank: int = 4, width: int = 0, seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
            raise BadInput(f"powersgd rank={rank!r} must be an integer in [1, {MAX_RANK}]")
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise BadInput(f"powersgd width={width!r} must be an integer >= 0")
        self.rank, self.width, self.seed = rank, width, seed
        self._rng = Generators(seed)
        self._q: torch.Tensor | None = None

    def gains(self, rows: int, cols: int) -> bool:
        """Whether a rows x cols matrix is worth factoring at this rank (torch's rule)."""
        return rows >= 2 and cols >= 2 and (rows + cols) * self.rank * MIN_COMPRESSION_RATE < rows * cols

    def for_width(self, width: int) -> PowerSGD:
        """The same codec for matrices with rows of ``width``, sharing the random generator."""
        other = PowerSGD(self.rank, width, self.seed)
        other._rng = self._rng
        return other

    def warm(self, q: torch.Tensor | None) -> PowerSGD:
        """This codec for one encode that starts its power iteration from ``q`` (cols x r)."""
        other = self.for_width(self.width)
        other._q = q
        return other

    def encode(self, x: Array) -> bytes:
        x = as_tensor(x)
        n = x.numel()
        cols = self.width or n
        if n == 0:
            return _HEAD.pack(FORMAT, 0, 0, 0, 0)
        if n % cols:
            raise BadInput(f"powersgd: {n} elements are not whole rows of width {cols}")
        rows = n // cols
        r = min(self.rank, rows, cols)
        m = x.view(rows, cols)
        q = self._q
        if q is None or q.shape != (cols, r):
            q = torch.randn(cols, r, generator=self._rng.get(x.device), device=x.device)
        p = torch.linalg.qr(m @ q.to(x.device)).Q  # orthonormal columns: decode is P P^T M
        q = m.t() @ p
        return b"".join([_HEAD.pack(FORMAT, r, rows, cols, n),
                         p.t().contiguous().cpu().numpy(), q.t().contiguous().cpu().numpy()])

    def factors(self, payload: Payload, numel: int, device: Device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(P, Q) as (rows x r) and (cols x r) float32 tensors on ``device``; BadInput if malformed."""
        r, rows, cols, _ = read_header(payload, _HEAD, self.name, numel)
        if numel == 0:
            if (r, rows, cols) != (0, 0, 0):
                raise BadInput(f"powersgd payload of an empty chunk declares rank {r}, {rows} x {cols}")
        elif not (rows and cols and rows * cols == numel and 1 <= r <= min(MAX_RANK, rows, cols)):
            raise BadInput(f"powersgd payload declares a {rows} x {cols} matrix of rank {r} for a chunk "
                           f"of {numel} elements; rows x cols must equal it and the rank lie in "
                           f"[1, min({MAX_RANK}, rows, cols)]")
        check_size(payload, _HEAD.size + 4 * r * (rows + cols), self.name, numel)
        p = host_tensor(payload, "<f4", _HEAD.size, r * rows).to(device).view(r, rows).t()
        q = host_tensor(payload, "<f4", _HEAD.size + 4 * r * rows, r * cols).to(device).view(r, cols).t()
        return p, q

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        p, q = self.factors(payload, numel, device)
        rows, r = p.shape
        out = torch.empty(rows, q.shape[0], dtype=torch.float32, device=device)
        if r == 0:
            return out.view(-1)  # an empty chunk
        torch.mul(p[:, :1], q[:, 0], out=out)
        tmp = torch.empty_like(out) if r > 1 else out
        for k in range(1, r):  # out += p_k q_k^T, in order: bit-identical on every device
            torch.mul(p[:, k:k + 1], q[:, k], out=tmp)
            out.add_(tmp)
        return out.view(-1)
