"""The root's write-ahead log of applied versions: durable appends, crash recovery, exact replay.

    >>> import shutil, tempfile
    >>> import numpy as np
    >>> from ps.tiers.wal import WalRecord, WriteAheadLog
    >>> d = tempfile.mkdtemp()
    >>> wal = WriteAheadLog(d)              # recovers what a crash left; opens no file yet
    >>> wal.append(WalRecord(1, contributors=4, clock_min=0, grad=np.ones(3, np.float32), keys=b"w0:1"))
    >>> wal.append(WalRecord(2, 4, 1, None))  # durable on return; no gradient: nothing applied
    >>> wal.rotate(next_version=3)          # a checkpoint of version 2 starts ...
    >>> wal.drop_upto(2)                    # ... and is durable: the segments it covers go
    >>> wal.append(WalRecord(3, 4, 2, np.zeros(3, np.float32), scale=0.5))
    >>> wal.close()
    >>> [(r.version, r.scale) for r in WriteAheadLog(d).records(after=2)]  # a restart replays
    [(3, 0.5)]
    >>> wal.stats.appends, wal.stats.append_failures
    (3, 0)
    >>> shutil.rmtree(d)

Why: the root acknowledges a version only once its record is fsync'ed (DESIGN.md, invariant 8),
so after a kill -9 it loads the newest checkpoint and replays the records after it; replay is
exact because the optimizer and the publication of deltas are deterministic. ``keys`` are the
identities of the pushes a version applied, so exactly-once holds across root restarts.

The record format (and reading one) is ``ps.tiers.walrecord``; this module is the log: its
segments, what recovery keeps and cuts, and appends.

Recovery (``WriteAheadLog(dir)`` calls ``recover()``) reads every segment in order. The first
record that is short, has a bad magic, lengths past the end of the file (checked before anything
is allocated) or a bad checksum ends the segment's valid data, and the rest is cut off
(truncate + fsync, with a warning naming the segment, offset and version):
  * in the last segment, because that is what a crash during an append leaves, and it was never
    acknowledged: an acknowledgement waits for the record's fsync, one record at a time;
  * in an earlier segment only when the next segment continues right after its last valid record
    (a failed append whose undo failed too, or a torn tail an older build wrote past); otherwise
    the damaged bytes may have held acknowledged versions, and recovery refuses.
A whole record that fails its checksum with bytes after it is refused too, in any segment, and
so is a bad header (magic, lengths) with a whole valid record somewhere after it: a crash tears
only the record being appended, so one followed by more was acknowledged.
Versions must be contiguous across the whole log: a gap, or the same version twice with
different contents (a fork), raises ``WalCorrupt`` and changes nothing on disk, because guessing
would silently lose acknowledged versions. ``records(after=v)`` also refuses when the log
resumes after v + 1.

A failed append (ENOSPC, EIO) is cut back out of the segment and raises ``WalWriteError``; the
same version can be appended again later. If even the cut fails, that segment is abandoned and
the next append starts a new segment named after its version (recovery then cuts the remains).

Threads: appends run in a worker thread, rotation and cleanup elsewhere; one lock orders them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ps.tiers.walrecord import OLD_MAGIC, Entry, Scan, WalRecord, cut, encode, load
from ps.tiers.walrecord import scan as scan_segment

__all__ = ["WalCorrupt", "WalRecord", "WalStats", "WalWriteError", "WriteAheadLog"]

log = logging.getLogger("hps.wal")


class WalCorrupt(Exception):
    """The log cannot be replayed without losing or inventing versions (a gap, a fork, damage
    in the middle). Recovery changed nothing; the message says what to do."""


class WalWriteError(OSError):
    """A record could not be made durable; it is not in the log (``errno`` is the cause's)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


# fsync latency buckets (seconds): an SSD answers in well under a millisecond, a network
# volume in a few, a sick disk in seconds; each acknowledgement waits for one.
FSYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class WalStats:
    """Counters for metrics; plain numbers, updated under the log's lock."""
    appends: int = 0
    bytes_written: int = 0
    append_failures: int = 0
    last_fsync_s: float = 0.0
    total_fsync_s: float = 0.0
    recovery_truncations: int = 0
    # fsyncs at or under each of FSYNC_BUCKETS (not cumulative; the metric sums them)
    fsync_buckets: list[int] = field(default_factory=lambda: [0] * len(FSYNC_BUCKETS))

    def fsynced(self, dt: float) -> None:
        self.last_fsync_s = dt
        self.total_fsync_s += dt
        for i, le in enumerate(FSYNC_BUCKETS):
            if dt <= le:
                self.fsync_buckets[i] += 1
                break


@dataclass(eq=False)
class _Segment:
    first: int
    path: Path
    entries: list[Entry] = field(default_factory=list)
    end: int = 0          # bytes of valid records (the file's size once clean)
    dirty: bool = False   # the file may hold garbage past ``end`` (cutting it failed)
    named: bool = True    # its directory entry is durable

    def top(self) -> int:
        """The newest version it holds (first - 1 when empty)."""
        return self.entries[-1].version if self.entries else self.first - 1


class WriteAheadLog:
    """The log in one directory: recovered on construction, appended to from one thread at a
    time, rotated and trimmed as checkpoints become durable (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = WalStats()
        self._lock = threading.Lock()  # appends run in a thread; rotation on the event loop
        self._file = None              # the open segment's file (unbuffered), None until an append
        self._cur: _Segment | None = None   # the segment ``_file`` writes
        self._segs: list[_Segment] = []     # every segment, by first version: the validated index
        self._last: int | None = None       # the newest durable version
        self._rotated = False               # the next append starts a new segment
        self.recover()

    # -- recovery --------------------------------------------------------------------------
    def segments(self) -> list[tuple[int, Path]]:
        """The segment files on disk, by first version."""
        out = []
        for p in self.dir.glob("wal-*.log"):
            try:
                out.append((int(p.stem[4:]), p))
            except ValueError:
                continue
        return sorted(out)

    def recover(self) -> None:
        """Validate every segment and cut torn tails (see the module docstring for the rules).
        Raises ``WalCorrupt`` without changing anything when the log has a gap or a fork."""
        with self._lock:
            self._close()
            found = self.segments()
            segs, cuts = self._validate(found, [scan_segment(p) for _, p in found])
            for seg, scan, version, _ in cuts:
                if scan.beyond:
                    # A whole record, damaged, with bytes after it: a crash tears only the record
                    # being appended, and the next append starts after its fsync, so this one
                    # was acknowledged, and perhaps the ones after it too. Disk damage, not a tear.
                    raise self._corrupt(
                        f"{scan.why} in the record of version {version} at offset {scan.end} of "
                        f"{seg.path.name}, and {scan.beyond} bytes follow it: not what a crash leaves "
                        "(it tears only the last record, never acknowledged), so acknowledged versions "
                        "may be there")
            for seg, scan, version, last in cuts:
                what = ("the tail of the newest segment, torn by a crash during an append: never "
                        "acknowledged" if last else "left by a failed append or an older build; the "
                        "next segment continues without it")
                log.warning("write-ahead log %s: %s at offset %d of %s (%d bytes); cutting it there, "
                            "at version %d (%s)", self.dir, scan.why, scan.end, seg.path.name,
                            scan.size - scan.end, version, what)
                try:
                    cut(seg.path, seg.end)
                    self.stats.recovery_truncations += 1
                except OSError as exc:  # replay still skips it; the next append retries the cut
                    seg.dirty = True
                    log.error("write-ahead log %s: could not cut %s at offset %d: %s",
                              self.dir, seg.path.name, seg.end, exc)
            self._segs = segs
            self._last = next((s.top() for s in reversed(segs) if s.entries), None)
            self._rotated = False

    def _validate(self, found: list[tuple[int, Path]], scans: list[Scan]):
        segs: list[_Segment] = []
        cuts = []
        flat: list[tuple[Entry, Path]] = []  # the accepted records, contiguous versions
        for i, ((first, path), scan) in enumerate(zip(found, scans)):
            # Not known to be named durably: a crash may have come between creating the file and
            # fsyncing its directory. The first append to it fsyncs the directory (once).
            seg = _Segment(first, path, end=scan.end, named=False)
            if scan.entries and scan.entries[0].version != first:
                raise self._corrupt(f"segment {path.name} is named for version {first} but its first "
                                    f"record is version {scan.entries[0].version}")
            for e in scan.entries:
                last = flat[-1][0] if flat else None
                if last is None or e.version == last.version + 1:
                    seg.entries.append(e)
                    flat.append((e, path))
                elif e.version <= last.version and e.version >= flat[0][0].version:
                    prev, prev_path = flat[e.version - flat[0][0].version]
                    if prev.checksum != e.checksum:
                        raise self._corrupt(
                            f"version {e.version} appears twice with different contents (a fork): in "
                            f"{prev_path.name} at offset {prev.offset} and in {path.name} at offset "
                            f"{e.offset}")
                    # The same record twice: an append whose bytes reached the disk although its
                    # write or fsync reported a failure, then went again to a new segment because
                    # cutting it back out failed too. Identical bytes: replaying it once is exact.
                else:
                    raise self._corrupt(
                        f"version {e.version} in {path.name} (offset {e.offset}) follows version "
                        f"{last.version} in {flat[-1][1].name}: versions {last.version + 1}.."
                        f"{e.version - 1} are missing (a gap)" if e.version > last.version else
                        f"version {e.version} in {path.name} (offset {e.offset}) is older than the "
                        f"log's first version {flat[0][0].version}")
            if scan.old:  # cutting it would silently drop what another build acknowledged
                with open(path, "rb") as f:
                    f.seek(scan.end)
                    magic = f.read(4)
                which = "an older format" if magic == OLD_MAGIC else "a format this build does not know"
                raise self._corrupt(
                    f"segment {path.name} holds records of {which} (magic {magic!r} at offset "
                    f"{scan.end}), which this build does not read",
                    "Start the build that wrote it once and stop it cleanly (a clean stop "
                    "checkpoints and empties the log), then start this one.")
            if scan.end < scan.size:
                expected = flat[-1][0].version + 1 if flat else first
                if i + 1 < len(found) and found[i + 1][0] > expected:
                    nxt = found[i + 1]
                    raise self._corrupt(
                        f"segment {path.name} has {scan.why} at offset {scan.end} and the next segment "
                        f"{nxt[1].name} starts at version {nxt[0]}: versions {expected}..{nxt[0] - 1} "
                        f"are damaged or missing, and may have been acknowledged")
                cuts.append((seg, scan, expected, i + 1 == len(found)))
            segs.append(seg)
        return segs, cuts

    def _corrupt(self, what: str, advice: str = "") -> WalCorrupt:
        return WalCorrupt(
            f"the write-ahead log in {self.dir} cannot be replayed: {what}. Nothing was changed. "
            + (advice or "Restore the missing or damaged segment files from a backup; or, to accept "
               "losing the versions from that point on, move the segment files from there on out "
               "of the directory and restart (the job resumes from its newest checkpoint plus the "
               "log before that point)."))

    # -- replay ----------------------------------------------------------------------------
    def records(self, after: int) -> Iterator[WalRecord]:
        """Every record with version > ``after``, in order (not while an append is in flight).
        Raises ``WalCorrupt`` when the log resumes after ``after + 1``: the versions between the
        state being replayed onto and the log are in neither."""
        with self._lock:
            plan = [(s.path, [e for e in s.entries if e.version > after]) for s in self._segs]
        plan = [(p, es) for p, es in plan if es]
        if plan and plan[0][1][0].version != after + 1:
            first = plan[0][1][0].version
            raise self._corrupt(
                f"it resumes at version {first} (segment {plan[0][0].name}) but the state it is "
                f"replayed onto is at version {after}: versions {after + 1}..{first - 1} are in "
                "neither the checkpoint nor the log")
        return self._read(plan)

    def _read(self, plan: list[tuple[Path, list[Entry]]]) -> Iterator[WalRecord]:
        for path, entries in plan:
            with open(path, "rb") as f:
                for e in entries:
                    yield self._load(f, path, e)

    def _load(self, f, path: Path, e: Entry) -> WalRecord:
        try:
            rec = load(f, e)
        except ValueError as exc:
            raise self._corrupt(f"the record of version {e.version} at offset {e.offset} of {path.name}: "
                                f"{exc}") from None
        if rec is None:
            raise self._corrupt(f"the record of version {e.version} at offset {e.offset} of "
                                f"{path.name} changed after recovery validated it")
        return rec

    # -- appends ---------------------------------------------------------------------------
    def append(self, rec: WalRecord) -> None:
        """Write ``rec`` and return once it is durable (fsync'ed). On failure nothing of it stays
        in the log and ``WalWriteError`` says why; the same version may be appended again."""
        head, parts, checksum = encode(rec)  # a dense payload is the gradient's memory: no copy
        size = len(head) + sum(p.nbytes for p in parts)
        with self._lock:
            if self._last is not None and rec.version != self._last + 1:
                raise ValueError(f"version {rec.version} cannot follow version {self._last} in the "
                                 f"write-ahead log in {self.dir}: the log must stay contiguous")
            seg = self._open(rec.version)
            start = seg.end
            try:
                _write_all(self._file, head)
                for part in parts:
                    _write_all(self._file, part)
                t0 = time.perf_counter()
                os.fsync(self._file.fileno())
                dt = time.perf_counter() - t0
            except BaseException as exc:
                self.stats.append_failures += 1
                undo = self._undo(seg, start)
                if not isinstance(exc, OSError):
                    raise
                raise WalWriteError(f"version {rec.version} of the write-ahead log in {self.dir} "
                                    f"could not be made durable: {exc}{undo}", exc.errno) from exc
            seg.entries.append(Entry(rec.version, start, size, checksum))
            seg.end = start + size
            self._last = rec.version
            s = self.stats
            s.appends += 1
            s.bytes_written += size
            s.fsynced(dt)

    def _open(self, version: int) -> _Segment:
        """The segment the record of ``version`` goes to, its file open (lock held)."""
        if self._file is not None:
            return self._cur
        tail = self._segs[-1] if self._segs else None
        if not self._rotated and tail is not None and tail.top() + 1 == version:
            seg = tail  # continue it (after a restart that did not rotate, or a failed append)
        else:
            path = self.dir / f"wal-{version:012d}.log"
            seg = next((s for s in self._segs if s.path == path), None)
            if seg is None:
                if path.exists():
                    raise self._corrupt(f"{path.name} appeared after recovery (is another root "
                                        "writing this log?)")
                seg = _Segment(version, path, named=False)
            elif seg.entries:
                raise self._corrupt(f"{path.name} already holds versions {seg.first}..{seg.top()}")
        for other in self._segs:  # retry cutting what earlier failures left (best effort)
            if other.dirty and other is not seg:
                try:
                    cut(other.path, other.end)
                    other.dirty = False
                except OSError:
                    pass
        try:
            f = open(seg.path, "ab", buffering=0)
        except OSError as exc:
            self.stats.append_failures += 1
            raise WalWriteError(f"version {version} of the write-ahead log in {self.dir} could not "
                                f"be made durable: {exc}", exc.errno) from exc
        if seg not in self._segs:
            self._segs.append(seg)
            self._segs.sort(key=lambda s: s.first)
        try:
            size = os.fstat(f.fileno()).st_size
            if size < seg.end:
                f.close()
                raise self._corrupt(f"{seg.path.name} shrank to {size} bytes after recovery "
                                    f"validated {seg.end}")
            if size > seg.end:  # remains of a failed append that could not be cut then
                os.ftruncate(f.fileno(), seg.end)
                os.fsync(f.fileno())
            seg.dirty = False
            if not seg.named:  # a new file: its directory entry must be durable too
                _fsync_dir(self.dir)
                seg.named = True
        except OSError as exc:
            f.close()
            self.stats.append_failures += 1
            raise WalWriteError(f"version {version} of the write-ahead log in {self.dir} could not "
                                f"be made durable: {exc}", exc.errno) from exc
        self._file, self._cur, self._rotated = f, seg, False
        return seg

    def _undo(self, seg: _Segment, start: int) -> str:
        """Cut a failed append back out of ``seg`` (lock held); a note for the error message."""
        try:
            os.ftruncate(self._file.fileno(), start)
            os.fsync(self._file.fileno())
            return ""
        except OSError as exc:
            seg.dirty = True
            self._close(quiet=True)
            self._rotated = True  # never write after the remains: the next append starts anew
            log.error("write-ahead log %s: could not cut a failed append back out of %s at offset "
                      "%d (%s); the next append starts a new segment, and recovery cuts the remains",
                      self.dir, seg.path.name, start, exc)
            return (f"; cutting it back out of {seg.path.name} failed too ({exc}), so the next "
                    "append starts a new segment")

    # -- segments --------------------------------------------------------------------------
    def rotate(self, next_version: int) -> None:
        """End the current segment: the next append (normally of ``next_version``) starts a new
        one, named after the version it holds first. Opens nothing, and raises nothing: every
        record in the segment was fsync'ed when it was appended, so a failed close loses none."""
        with self._lock:
            self._close(quiet=True)
            self._rotated = True

    def drop_upto(self, version: int) -> None:
        """Delete segments holding only versions <= ``version`` (a durable checkpoint covers
        them), never the one being written. Oldest first, and none after one that could not be
        deleted: what stays is contiguous (recovery refuses a log with a gap, and one kept
        behind a deleted one was one)."""
        with self._lock:
            keep, failed = [], False
            for seg in self._segs:
                if not failed and seg is not self._cur and seg.top() <= version:
                    try:
                        seg.path.unlink(missing_ok=True)
                        continue
                    except OSError as exc:  # harmless: replay skips what a checkpoint covers
                        failed = True
                        log.warning("write-ahead log %s: could not delete %s: %s (the segments after it "
                                    "stay too)", self.dir, seg.path.name, exc)
                keep.append(seg)
            self._segs = keep

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self, quiet: bool = False) -> None:
        f, self._file, self._cur = self._file, None, None
        if f is not None:
            try:
                f.close()
            except OSError:
                if not quiet:
                    raise


def _write_all(f, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = f.write(view)
        view = view[n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
