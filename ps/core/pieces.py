"""A push's gradient as the chunks it arrived in (pure, numpy only: the torch-free core uses it).

>>> parts = ((0, np.ones(2, np.float32)), (3, np.full(1, 2.0, np.float32)))
>>> p = Pieces(4, parts, gaps=((2, 3),), chunks=())
>>> p.dense()
array([1., 1., 0., 2.], dtype=float32)
>>> total = np.full(4, -0.0, np.float32); p.add_to(total); total     # -0.0 + 0.0 is +0.0
array([1., 1., 0., 2.], dtype=float32)
>>> p.plus(total, out=np.empty(4, np.float32))
array([2., 2., 0., 4.], dtype=float32)
"""

from __future__ import annotations

import numpy as np

from ps.core.types import Chunk

__all__ = ["Pieces"]


class Pieces:
    """A push's gradient as the chunks it arrived in: decoded and checked (``Assembler(...,
    lazy=True)``), not laid out as one vector.

        p = assembler.finish_pieces()
        total = p.dense()                 # the vector ``finish`` would have made
        p.add_to(total)                   # total += the vector, straight from the chunks

    A batch's first push stays this way (ps.core.consistency); a second one lays the sum out
    once and adds itself from its chunks, with no vector of its own; a relay whose batch is
    one push of lossless chunks forwards them as they came (ps.tiers.relay). Before, every
    push was copied into a vector of its own as it arrived: one 400 MB pass per push per tier
    that only a batch of several needs, and a second (the frames) at a relay that forwards it.
    fp32 parts are views of the received frames, which this keeps alive.
    """

    __slots__ = ("chunks", "gaps", "numel", "parts")

    def __init__(self, numel: int, parts: tuple[tuple[int, np.ndarray], ...],
                 gaps: tuple[tuple[int, int], ...], chunks: tuple[Chunk, ...]) -> None:
        self.numel = numel
        self.parts = parts    # (start in the flat vector, decoded values), in arrival order
        self.gaps = gaps      # (start, stop) spans no chunk covered: zero
        self.chunks = chunks  # as received

    def dense(self, divisor: float | None = None) -> np.ndarray:
        """The flat vector, in a fresh array (``divisor``: each value divided by it, in the
        same pass: the root's average of one push)."""
        out = np.empty(self.numel, dtype=np.float32)
        for start, values in self.parts:
            dst = out[start:start + values.size]
            if divisor is None:
                np.copyto(dst, values)
            else:
                np.divide(values, np.float32(divisor), out=dst)
        for start, stop in self.gaps:
            out[start:stop] = 0.0
        return out

    def plus(self, base: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``base + self.dense()`` into ``out``, bit for bit, in one pass (a replica's next
        version from its last and a pulled delta: no delta vector is laid out first)."""
        for start, values in self.parts:
            stop = start + values.size
            np.add(base[start:stop], values, out=out[start:stop])
        for start, stop in self.gaps:  # + 0.0, not a copy: -0.0 becomes +0.0 as in a dense add
            np.add(base[start:stop], np.float32(0.0), out=out[start:stop])
        return out

    def add_to(self, total: np.ndarray) -> None:
        """``total += self.dense()``, bit for bit, without making the dense vector."""
        with np.errstate(over="ignore"):  # an overflow is refused when the batch closes
            for start, values in self.parts:
                dst = total[start:start + values.size]
                np.add(dst, values, out=dst)
            for start, stop in self.gaps:  # -0.0 + 0.0 is +0.0, as the dense add makes it
                dst = total[start:stop]
                np.add(dst, np.float32(0.0), out=dst)
