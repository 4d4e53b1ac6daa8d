"""The bounded delta log: ``since(u, v)`` gives d_{u+1..v}, or None when a snapshot is needed (pure).

>>> log = DeltaLog(capacity=2)
>>> for v in (1, 2, 3):
...     log.append(DeltaEntry(version=v, checksum=0, chunks=()))
>>> [d.version for d in log.since(1, upto=3)]
[2, 3]
>>> log.since(0, upto=3) is None       # d_1 left the log: send a snapshot
True

Entries keep the encoded chunks exactly as the root produced them, so a relay forwards the
bytes it received verbatim and decodes nothing twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ps.core.tensors import Chunk

__all__ = ["DeltaEntry", "DeltaLog"]


@dataclass(frozen=True)
class DeltaEntry:
    """d_v: the encoded difference view_v - view_{v-1}, and view_v's checksum."""

    version: int
    checksum: int
    chunks: tuple[Chunk, ...]
    clock_min: int = 0
    contributors: int = 0

    @property
    def nbytes(self) -> int:
        return sum(len(c.payload) for c in self.chunks)


class DeltaLog:
    """The last ``capacity`` deltas of one lineage, contiguous by version, and at most
    ``max_bytes`` of them (the newest is always kept): a child further behind takes a snapshot.
    Counted alone, 64 dense fp32 deltas of a 100M-parameter model held 25.6 GB at the root and
    again at every relay, for children that a 400 MB snapshot serves more cheaply anyway."""

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"delta log capacity must be >= 1, got {capacity}")
        self._entries: deque[DeltaEntry] = deque(maxlen=capacity)
        self.max_bytes = max_bytes
        self.nbytes = 0  # the payload bytes held

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def newest(self) -> int | None:
        return self._entries[-1].version if self._entries else None

    @property
    def oldest_base(self) -> int | None:
        """The oldest version a child can hold and still be served deltas."""
        return self._entries[0].version - 1 if self._entries else None

    def append(self, entry: DeltaEntry) -> None:
        if self._entries and entry.version != self._entries[-1].version + 1:
            # A gap means a new base (snapshot); the old entries no longer lead to it.
            self.clear()
        if len(self._entries) == self._entries.maxlen:
            self.nbytes -= self._entries.popleft().nbytes
        self._entries.append(entry)
        self.nbytes += entry.nbytes
        while self.max_bytes is not None and self.nbytes > self.max_bytes and len(self._entries) > 1:
            self.nbytes -= self._entries.popleft().nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def since(self, version: int, upto: int) -> list[DeltaEntry] | None:
        """Deltas taking a view from ``version`` to ``upto``; None if the log cannot."""
        if version == upto:
            return []
        if not self._entries or version > upto:
            return None
        first = self._entries[0].version
        if version < first - 1 or upto > self._entries[-1].version:
            return None
        return [self._entries[v - first] for v in range(version + 1, upto + 1)]
