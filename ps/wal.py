"""The root's write-ahead log of applied updates (sync file I/O, no event loop).

    wal = WriteAheadLog("/var/lib/hps/lm")
    wal.append(WalRecord(version=7, contributors=4, clock_min=6, grad=avg_grad))  # durable on return
    for rec in wal.records(after=4): ...      # replay on start, after the newest checkpoint
    wal.rotate(next_version=9); wal.drop_upto(8)   # after checkpoint 8 is durable

A round is acknowledged only after its record is fsync'ed, so a kill -9 of the root loses no
acknowledged version: on restart it loads the newest checkpoint and replays the records after
it. Replay is exact because the optimizer and the publication of deltas are deterministic.
A record cut short by the crash (torn write) fails its CRC and ends the replay there.

Record: b"HPSW" | u64 version | u32 contributors | u64 clock_min | f64 lr scale | u64 nbytes |
u32 crc32 | payload
(payload: the averaged gradient as little-endian float32). Files: wal-<first version>.log.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

__all__ = ["WalRecord", "WriteAheadLog"]

_HEAD = struct.Struct("<4sQIQdQI")
_MAGIC = b"HPSW"


@dataclass(frozen=True)
class WalRecord:
    version: int
    contributors: int
    clock_min: int           # the version's SSP clock floor
    grad: np.ndarray | None  # None: a batch with no contributors (nothing applied)
    scale: float = 1.0       # learning-rate scale (async/ssp damping by staleness)


class WriteAheadLog:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = None
        self._lock = threading.Lock()  # appends run in a thread; rotation on the event loop

    def segments(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.dir.glob("wal-*.log"):
            try:
                out.append((int(p.stem[4:]), p))
            except ValueError:
                continue
        return sorted(out)

    def rotate(self, next_version: int) -> None:
        """Start a new segment whose first record will be ``next_version``."""
        with self._lock:
            self._close()
            self._file = open(self.dir / f"wal-{next_version:012d}.log", "ab")

    def append(self, rec: WalRecord) -> None:
        if self._file is None:
            self.rotate(rec.version)
        payload = b"" if rec.grad is None else np.ascontiguousarray(rec.grad, "<f4").tobytes()
        head = _HEAD.pack(_MAGIC, rec.version, rec.contributors, rec.clock_min, rec.scale, len(payload),
                          zlib.crc32(payload) & 0xFFFFFFFF)
        with self._lock:
            self._file.write(head + payload)
            self._file.flush()
            os.fsync(self._file.fileno())

    def records(self, after: int) -> Iterator[WalRecord]:
        """Records with version > ``after``, in order, stopping at the first torn one."""
        for _, path in self.segments():
            size = path.stat().st_size
            with open(path, "rb") as f:
                while True:
                    head = f.read(_HEAD.size)
                    if len(head) < _HEAD.size:
                        break
                    magic, version, contributors, clock_min, scale, n, crc = _HEAD.unpack(head)
                    if magic != _MAGIC or n > size - f.tell():
                        return  # a damaged length must not make us read (allocate) past the file
                    payload = f.read(n)
                    if magic != _MAGIC or len(payload) < n or zlib.crc32(payload) & 0xFFFFFFFF != crc:
                        return  # torn by the crash: nothing after it was acknowledged
                    if version > after:
                        grad = np.frombuffer(payload, "<f4").copy() if n else None
                        yield WalRecord(version, contributors, clock_min, grad, scale)

    def drop_upto(self, version: int) -> None:
        """Delete segments holding only versions <= ``version`` (a checkpoint covers them)."""
        segs = self.segments()
        for (first, path), (nxt, _) in zip(segs, segs[1:]):
            if nxt <= version + 1:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
