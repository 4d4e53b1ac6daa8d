"""Receiving one push within budgets: memory is reserved before it is allocated, and the body
is decoded frame by frame as it arrives (pure: no event loop, no protobuf).

>>> from ps.core.codecs import get_codec
>>> from ps.core.tensors import split
>>> from ps.core.view import KeySpec
>>> layout = Layout([KeySpec("w", (4, 3))])
>>> frames = split(layout, np.ones(12, np.float32), get_codec("fp32"), chunk_elems=6)
>>> budget = ByteBudget(2 << 30, what="zone eu-a")
>>> meta = PushMeta(job="lm", sender="w0", seq=1, base_version=0)
>>> intake = PushIntake(layout, meta, decode=True, budget=budget)   # Exhausted past the budget
>>> budget.used                    # reserved before anything is allocated
48
>>> for chunk in frames:           # as they arrive: BadInput on the first bad chunk
...     intake.add([chunk])
>>> intake.gradient().dense()      # the decoded push (overlaps checked; Pieces), or None
array([1., 1., 1., 1., 1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)
>>> intake.close(); budget.used    # gives the reservation back (idempotent)
0

A push's decoded chunks are its own, so a stream refused or cut halfway changes nothing: the
tier adds it to a round only once the whole stream has arrived and checked out. Before this,
every frame of a push was held before the first was decoded: one 512 MiB push from a
non-member took a zone from 242 to 795 MB and it stayed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np  # noqa: F401  (the examples above use it)

from ps.core.errors import BadInput, Exhausted
from ps.core.pieces import Pieces
from ps.core.tensors import Assembler, Chunk
from ps.core.types import PushMeta
from ps.core.view import Layout

__all__ = ["ByteBudget", "PushIntake", "max_push_bytes"]


def max_push_bytes(numel: int) -> int:
    """The most payload bytes a push of ``numel`` parameters can need with any codec (fp32 is 4
    per element; row and top-k indices add at most 4 more, zstd framing a little)."""
    return 8 * numel + (1 << 20)


class ByteBudget:
    """Bytes a tier may hold for pushes being received at once; a reservation past it is
    refused with RESOURCE_EXHAUSTED (the sender retries with backoff). One push always fits
    when nothing else is held, so a job as large as the budget still trains."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what = limit, what
        self.used = 0

    def reserve(self, n: int) -> None:
        if n and self.used and self.used + n > self.limit:
            raise Exhausted(f"{self.what} is receiving {self.used >> 20} MB of pushes (budget "
                            f"{self.limit >> 20} MB); retry shortly")
        self.used += n

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)


class PushIntake:
    """One push being received: its header already checked, its body decoded as it arrives
    (or, for a retry the tier may answer from its records, only counted: the digest decides)."""

    def __init__(self, layout: Layout, meta: PushMeta, decode: bool, budget: ByteBudget,
                 release: Callable[[], None] = lambda: None) -> None:
        self._keys = len(layout.specs)
        self.late(meta)
        self.nbytes = 0
        self._limit = max_push_bytes(layout.numel)
        self._budget = budget
        self._reserved = 4 * layout.numel if decode else 0
        budget.reserve(self._reserved)
        self._release = release
        self._closed = False
        # lazy: the decoded chunks are the gradient until its batch needs a vector (Pieces)
        self._asm = Assembler(layout, what=f"push {meta.seq} from {meta.sender!r}", lazy=True) if decode else None
        self._chunks = 0

    @property
    def decoded(self) -> bool:
        return self._asm is not None

    def add(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            self.nbytes += len(c.payload)
            self._chunks += 1
            if self.nbytes > self._limit:
                raise BadInput(f"push {self.meta.seq} carries more than {self._limit} payload bytes, more "
                               "than any codec needs for this job")
            if self.meta.contributors == 0:
                raise BadInput("a push with 0 contributors must carry no tensors")
            if self._asm is not None:
                self._asm.add(c)

    def late(self, meta: PushMeta) -> None:
        """The header's fields, or once a streamed push's tail arrived the header with the
        tail's late fields (step information, telemetry). BadInput if they name a key the job
        does not have."""
        if meta.step.absent and meta.step.absent[-1] >= self._keys:
            raise BadInput(f"a push names key index {meta.step.absent[-1]} as absent; job {meta.job} has "
                           f"{self._keys} keys")
        self.meta = meta

    def gradient(self) -> Pieces | None:
        """The decoded gradient, as the chunks it came in (None for a push of 0 contributors,
        which only reports a clock)."""
        if self.meta.contributors == 0:
            return None
        assert self._asm is not None, "a push that was only counted has no gradient"
        return self._asm.finish_pieces()

    def decoded_into_batch(self) -> None:
        """The gradient was added to its batch's sum: its buffer no longer needs the budget (a
        push waiting for its round must not keep others from being received)."""
        self._budget.release(self._reserved)
        self._reserved = 0

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.decoded_into_batch()
            self._release()
