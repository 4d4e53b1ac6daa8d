"""Top-k sparsification: the k largest |x| as delta-coded indices and float16 values, zstd'd.

>>> from ps.core.codecs import ErrorFeedback
>>> grad = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
>>> codec = TopK(k=0.01)                         # keep 1% of the elements
>>> ef = ErrorFeedback()                         # what is not sent now is sent later
>>> payload = ef.encode("fc.weight", codec, grad)
>>> dense = codec.decode(payload, grad.numel())
>>> int((dense != 0).sum()), len(payload) < 6 * 1000   # < 6 bytes (int32 gap + fp16) per element
(1000, True)

Selection never runs a full ``torch.topk`` on a large tensor (~300 ms for 16M elements on a
2-core CPU): it estimates the threshold from a random sample of |x|, gathers every element
above it in one scan, and takes an exact top-k of those few candidates (DGC, Lin et al. 2018,
samples the same way). The payload, after a 24-byte header (format, exponent, count, numel),
is one zstd frame over the byte planes of the index gaps (int32) and of the values (float16
times a power of two): a gap's high bytes are almost all zero and zstd removes them.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
import zstandard

from ps.core.codecs._common import FORMAT, Generators, as_tensor, pow2_exponent, read_header, unzstd
from ps.core.codecs.base import Array, Device, Payload, TensorCodec
from ps.core.errors import BadInput

__all__ = ["TopK", "select"]

_HEAD = struct.Struct("<Bxh4xQQ")  # format, exponent e, count, numel (24 bytes); then zstd
MAX_NUMEL = (1 << 31) - 1          # gaps travel as non-negative int32
SMALL = 1 << 16                    # up to here an exact torch.topk costs less than sampling
SAMPLE_MIN, SAMPLE_DIV = 16384, 128  # sample max(16K, n/128) elements (~0.8%)
CPU_BLOCK = 1 << 20                # scan |x| in 4 MiB blocks that stay in cache on a CPU
_ZSTD_LEVEL = 1                    # measured: levels 3 and 6 are slower and no smaller here
# Note: torch's x[idx] measured 15x slower than x.index_select(0, idx) on a CPU (torch 2.13),
# so gathers and scatters below use index_select / index_copy_, which are also deterministic
# on a GPU (no atomics), unlike index_put_ with accumulate.


def _exact(x: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return idx[x.index_select(0, idx) != 0]  # a zero carries nothing: never spend bytes on one


def _threshold(x: torch.Tensor, k: int, gen: torch.Generator) -> float:
    """A |x| level that about k * (1 + 4 / sqrt(k m / n)) elements reach: rarely fewer than k."""
    n = x.numel()
    m = min(n, max(SAMPLE_MIN, n // SAMPLE_DIV))
    sample = x.index_select(0, torch.randint(n, (m,), generator=gen, device=x.device)).abs_()
    want = k * m / n  # sample elements expected above the true k-th largest
    # Aim four standard deviations above k, so undershooting (which costs a full top-k) is a
    # ~1e-4 event and overshooting costs only a top-k over a few percent more candidates.
    rank = min(m, math.ceil(want + 4 * math.sqrt(want) + 1))
    # The rank-th largest: a small top-k beats kthvalue (1.5 ms for 131K on a CPU core).
    return torch.topk(sample, rank, sorted=False).values.min().item()


def _scan(x: np.ndarray, lo: int, hi: int, t: float) -> np.ndarray:
    """Indices in [lo, hi) with |x| >= t (> 0 when t is 0), scanned in cache-sized blocks.

    numpy, not torch, on a CPU: its compare and flatnonzero measured 0.9 + 3.7 ms per 16M
    elements against torch's 5.7 + 12 ms on one core (torch 2.13), index for index the same.
    Blocks, not one pass: a full-size |x| temporary costs page faults (a fresh 64 MiB per call)
    that exceed the scan itself.
    """
    mag = np.empty(min(CPU_BLOCK, hi - lo), np.float32)
    hit = np.empty(mag.size, bool)
    out = []
    for start in range(lo, hi, CPU_BLOCK):
        xb = x[start:min(start + CPU_BLOCK, hi)]
        a, h = mag[:xb.size], hit[:xb.size]
        np.abs(xb, out=a)
        np.greater_equal(a, t, out=h) if t > 0 else np.greater(a, 0, out=h)
        out.append(np.flatnonzero(h) + start)
    return np.concatenate(out)


def _above(x: torch.Tensor, t: float, use_numpy: bool | None = None) -> torch.Tensor:
    """Sorted indices of the elements with |x| >= t (|x| > 0 when t is 0), on x's device."""
    if x.device.type == "cpu" if use_numpy is None else use_numpy:
        # Serial on purpose: splitting the scan over threads measured no faster end to end,
        # as torch's OpenMP workers still spin on the cores after the preceding torch op.
        return torch.from_numpy(_scan(x.numpy(), 0, x.numel(), t))  # zero-copy view of x
    # A GPU: one kernel per op over all of x (its caching allocator makes temporaries free).
    a = x.abs()
    return ((a >= t) if t > 0 else (a > 0)).nonzero().squeeze(1)


def select(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted int64 indices of the k largest |x| (all non-zeros if fewer), on x's device.

        idx = select(torch.randn(1 << 24), 167772, torch.Generator().manual_seed(0))
    """
    n = x.numel()
    if k <= 0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if k >= n:
        return (x != 0).nonzero().squeeze(1)
    if n <= SMALL:
        return _exact(x, k)
    t = _threshold(x, k, gen)
    if not math.isfinite(t):
        return _exact(x, k)  # NaN/Inf in the sample: let the receiver see and refuse them
    idx = _above(x, t)
    c = idx.numel()
    if c > k:
        # Exact correction over the ~1.1k candidates only; a mask keeps their sorted order.
        top = torch.topk(x.index_select(0, idx).abs_(), k, sorted=False).indices
        keep = torch.zeros(c, dtype=torch.bool, device=x.device).index_fill_(0, top, True)
        idx = torch.masked_select(idx, keep)
    elif c < k and t > 0:
        idx = _exact(x, k)  # the sample overshot (rare): pay for one full top-k
    return idx


def _unplanes(body: bytes, offset: int, count: int, dtype: str) -> torch.Tensor:
    """``count`` items of ``dtype`` stored as byte planes at ``offset`` of ``body`` (host)."""
    width = np.dtype(dtype).itemsize
    planes = np.frombuffer(body, np.uint8, width * count, offset).reshape(width, count)
    return torch.from_numpy(planes.T.copy().view(dtype).reshape(-1))  # copy: C order, writable


class TopK(TensorCodec):
    """Keeps the fraction ``k`` of elements with the largest |x|; decode is deterministic.

        codec = get_codec("topk", k=0.001).with_k(dgc_density(step, 0.001, warmup_steps=1000))
    """

    name = "topk"
    options = ("k", "seed")

    def __init__(self, k: float = 0.01, seed: int = 0) -> None:
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= 1:
            raise BadInput(f"top-k fraction k={k!r} must be a number in (0, 1]")
        self.k = float(k)
        self.seed = seed
        self._rng = Generators(seed)

    def with_k(self, k: float) -> TopK:
        """The same codec at density ``k``, sharing this one's sampling generator."""
        other = TopK(k, self.seed)
        other._rng = self._rng
        return other

    def count(self, numel: int) -> int:
        """How many elements a tensor of ``numel`` keeps: round(k * numel), at least one."""
        return min(numel, max(1, round(self.k * numel))) if numel else 0

    def encode(self, x: Array) -> bytes:
        x = as_tensor(x)
        n = x.numel()
        if n > MAX_NUMEL:
            raise BadInput(f"top-k encodes at most {MAX_NUMEL} elements at once, not {n}; "
                           "split the tensor into chunks")
        idx = select(x, self.count(n), self._rng.get(x.device))
        vals = x.index_select(0, idx)
        e = pow2_exponent(vals.abs().max().item()) if idx.numel() else 0
        # Only the compact parts leave the device: int32 gaps and float16 values.
        gaps = torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32).cpu().numpy()
        h = (vals * 2.0 ** -e).to(torch.float16).cpu().numpy()
        # Byte planes: every gap's low byte, then every gap's next byte, ...; then the values'.
        body = np.concatenate([gaps.view(np.uint8).reshape(-1, 4).T.ravel(),
                               h.view(np.uint8).reshape(-1, 2).T.ravel()])
        frame = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(memoryview(body))
        return _HEAD.pack(FORMAT, e, idx.numel(), n) + frame

    def decode_sparse(self, payload: Payload, numel: int, device: Device = "cpu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted int64 indices, float32 values) on ``device``; BadInput on a malformed payload."""
        e, count, _ = read_header(payload, _HEAD, self.name, numel)
        if count > numel or not -100 <= e <= 113:
            raise BadInput(f"top-k payload keeps {count} of {numel} elements with scale exponent "
                           f"{e}; at most {numel} and an exponent in [-100, 113] are valid")
        body = unzstd(memoryview(payload)[_HEAD.size:], 6 * count, self.name)
        gaps = _unplanes(body, 0, count, "<i4")
        if count and (gaps[0] < 0 or (count > 1 and bool((gaps[1:] < 1).any()))):
            raise BadInput("top-k payload has indices that are not strictly increasing")
        idx = gaps.cumsum(0, dtype=torch.int64)
        if count and idx[-1] >= numel:
            raise BadInput(f"top-k payload has index {int(idx[-1])} for a chunk of {numel} elements")
        vals = _unplanes(body, 4 * count, count, "<f2").to(device).float().mul_(2.0 ** e)
        return idx.to(device), vals

    def decode_tensor(self, payload: Payload, numel: int, device: Device = "cpu") -> torch.Tensor:
        idx, vals = self.decode_sparse(payload, numel, device)
        return torch.zeros(numel, dtype=torch.float32, device=device).index_copy_(0, idx, vals)

    def subtract_decoded_(self, y: torch.Tensor, payload: Payload) -> None:
        # Only the sent elements change: y - 0 is y, so this equals the dense subtraction.
        idx, vals = self.decode_sparse(payload, y.numel(), y.device)
        y.index_copy_(0, idx, y.index_select(0, idx).sub_(vals))
