"""One record of the root's write-ahead log: its bytes, and finding the valid ones in a file.

    >>> import io
    >>> import numpy as np
    >>> from ps.tiers.walrecord import WalRecord, encode, scan_file
    >>> head, parts, checksum = encode(WalRecord(7, contributors=2, clock_min=0,
    ...                                          grad=np.ones(3, np.float32), keys=b"w0:1"))
    >>> data = head + b"".join(parts)
    >>> len(data), data[:4]            # 56-byte header, 4 bytes of keys, 3 float32
    (72, b'HPS2')
    >>> sparse = WalRecord(8, 2, 0, grad=np.array([0, 0, -0.0, 0, 0, 2.5], np.float32))
    >>> head, parts, _ = encode(sparse)   # two entries set (-0.0 is one): 8 + 2 * (4 + 4) bytes
    >>> head[:4], sum(p.nbytes for p in parts)
    (b'HPS3', 24)
    >>> found = scan_file(io.BytesIO(data + data[:30]), len(data) + 30)   # a torn second record
    >>> [e.version for e in found.entries], found.end, found.why
    ([7], 72, 'a header cut short (30 of 56 bytes)')

Record (little-endian): a 56-byte header
    magic | u64 version | u64 contributors | u64 clock_min | f64 lr scale |
    u32 keys length | u64 payload length | u64 checksum
then the keys (opaque bytes from the root), then the payload, empty when there is no gradient.
The payload is the averaged gradient, in whichever of two forms is smaller (issue 18: a record
sized like the update that arrived, not a dense fp32 copy of it):
    b"HPS2": dense, numel float32;
    b"HPS3": sparse, u64 numel | u32 index * n | float32 value * n, the indices ascending and
             exactly the entries whose bits are not zero (so -0.0 is kept: replay is bit for bit).
A top-k job's aggregate is a few percent of its entries: its record is that share of a dense one.
The checksum is XXH3-64 of the header's first 48 bytes, the keys and the payload, hashed
incrementally so a large payload is never copied. Segments are files
``wal-<version of their first record:012d>.log``; ``rotate`` ends one and the next append
creates the next (a log that never writes holds no file descriptor).

The policy (what recovery keeps, cuts or refuses, and appends) is ``ps.tiers.wal``'s.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

__all__ = ["WalRecord", "Entry", "Scan", "encode", "to_bytes", "from_bytes", "scan", "scan_file", "load", "cut",
           "MAGIC", "SPARSE_MAGIC", "OLD_MAGIC", "HEAD"]

MAGIC = b"HPS2"         # a dense payload
SPARSE_MAGIC = b"HPS3"  # a sparse one
OLD_MAGIC = b"HPSW"  # the first format (u32 contributors, CRC-32, no keys): refused, not read
# magic, version, contributors, clock_min, lr scale, keys length, payload length
_FIELDS = struct.Struct("<4sQQQdIQ")
_SUM = struct.Struct("<Q")
_NUMEL = struct.Struct("<Q")  # a sparse payload's first field
HEAD = _FIELDS.size + _SUM.size  # 56 bytes
_CHUNK = 1 << 20  # recovery hashes payloads in pieces: no allocation as large as a record


@dataclass(frozen=True)
class WalRecord:
    version: int
    contributors: int
    clock_min: int           # the version's SSP clock floor
    grad: np.ndarray | None  # None: a batch with no contributors (nothing applied)
    scale: float = 1.0       # learning-rate scale (async/ssp damping by staleness)
    keys: bytes = b""        # identities of the pushes applied (opaque to the log)

    @cached_property
    def payload(self) -> tuple[bytes, tuple[memoryview, ...]]:
        """The magic and the payload's pieces (``grad``'s own memory when dense), computed once
        per record: the log and a standby both use it."""
        return _payload(self.grad)


def _payload(grad: np.ndarray | None) -> tuple[bytes, tuple[memoryview, ...]]:
    if grad is None or grad.size == 0:
        return MAGIC, ()
    grad = np.ascontiguousarray(grad, "<f4")
    if grad.ndim != 1:
        grad = grad.reshape(-1)
    # A sparse entry costs 8 bytes against 4: worth it below half the entries set (by bits:
    # -0.0 is an entry). Counting them costs ~50 ms at 100M entries and allocates nothing (a
    # dense gradient, the common case, pays only that against ~1.2 s to write it); the sparse
    # form another ~250 ms at 4% set (benchmarks/wal_fsync.py).
    bits = grad.view("<u4")
    if grad.size <= 0xFFFFFFFF and 2 * np.count_nonzero(bits) < grad.size:
        where = np.flatnonzero(bits != 0)
        vals = grad[where]
        return SPARSE_MAGIC, (memoryview(_NUMEL.pack(grad.size)), memoryview(where.astype("<u4")).cast("B"),
                              memoryview(vals).cast("B"))
    return MAGIC, (memoryview(grad).cast("B"),)


class Entry(NamedTuple):  # a valid record: where it lies and what it hashes to
    version: int
    offset: int
    size: int
    checksum: int


class Scan(NamedTuple):
    entries: list[Entry]
    end: int   # where the valid records end
    size: int
    why: str     # why the bytes at ``end`` are not a record ("" when end == size)
    old: bool    # they are a record of another format of ours (b"HPS" and a magic this build does not read)
    beyond: int  # bytes after a damaged record whose lengths fit the file


def encode(rec: WalRecord) -> tuple[bytes, tuple[memoryview, ...], int]:
    """The record's header and keys, its payload's pieces (the gradient's own memory when dense:
    not a copy) and its checksum. ValueError when a field does not fit (u64 counts, u32 keys
    length)."""
    magic, parts = rec.payload
    keys = bytes(rec.keys)
    try:
        fields = _FIELDS.pack(magic, rec.version, rec.contributors, rec.clock_min, rec.scale,
                              len(keys), sum(p.nbytes for p in parts))
    except struct.error as exc:
        raise ValueError(f"version {rec.version}: a field does not fit the write-ahead log's "
                         f"record (u64 counts, u32 keys length): {exc}") from None
    h = xxhash.xxh3_64(fields)
    h.update(keys)
    for part in parts:
        h.update(part)
    checksum = h.intdigest()
    return fields + _SUM.pack(checksum) + keys, parts, checksum


def to_bytes(rec: WalRecord) -> bytes:
    """The record's bytes as the log holds them (what a primary sends its standby)."""
    head, parts, _ = encode(rec)
    return b"".join((head, *parts))


def from_bytes(data: bytes) -> WalRecord:
    """The one whole record ``data`` holds (``to_bytes``); ValueError when it is not one."""
    f = io.BytesIO(data)
    found = scan_file(f, len(data))
    rec = load(f, found.entries[0]) if len(found.entries) == 1 and found.end == len(data) else None
    if rec is None:
        raise ValueError(f"not one whole write-ahead log record ({found.why or 'several records'})")
    return rec


def _check_head(head: bytes, pos: int, size: int) -> tuple[str, tuple | None]:
    if len(head) < HEAD:
        return f"a header cut short ({len(head)} of {HEAD} bytes)", None
    fields = _FIELDS.unpack_from(head)
    if fields[0] not in (MAGIC, SPARSE_MAGIC):
        return f"a bad magic {fields[0]!r}", None
    nkeys, npay = fields[5], fields[6]
    if nkeys + npay > size - pos - HEAD:  # a damaged length must not make us allocate
        return f"lengths ({nkeys} + {npay} bytes) past the end of the file", fields
    if fields[0] == MAGIC and npay % 4:
        return f"a payload of {npay} bytes, not float32", fields
    if fields[0] == SPARSE_MAGIC and (npay < _NUMEL.size or (npay - _NUMEL.size) % 8):
        return f"a sparse payload of {npay} bytes, not a count and (u32, float32) pairs", fields
    return "", fields


def scan_file(f, size: int) -> Scan:
    """The valid records from the start of ``f`` (``size`` bytes) up to the first that is not
    one, and why it is not. Memory stays one piece of ``_CHUNK`` bytes whatever the records."""
    entries: list[Entry] = []
    pos = 0
    buf = memoryview(bytearray(_CHUNK))
    while pos < size:
        head = f.read(HEAD)
        why, fields = _check_head(head, pos, size)
        if why:  # another format of ours (older, or newer than this build) is refused, never cut
            other = head[:3] == b"HPS" and head[:4] not in (MAGIC, SPARSE_MAGIC)
            # A crash tears only the record being appended: a whole valid record after this
            # one means damage in the middle of the log, whose cut would drop acknowledged ones.
            later = None if other or len(head) < HEAD else _whole_record_after(f, pos + 1, size)
            return Scan(entries, pos, size, why if later is None else f"{why} (and a whole record at offset {later})",
                        other, 0 if later is None else size - pos)
        h = xxhash.xxh3_64(head[:_FIELDS.size])
        left = fields[5] + fields[6]
        while left:
            n = f.readinto(buf[:min(left, _CHUNK)])
            if not n:
                break
            h.update(buf[:n])
            left -= n
        (checksum,) = _SUM.unpack_from(head, _FIELDS.size)
        n = HEAD + fields[5] + fields[6]
        if left or h.intdigest() != checksum:
            return Scan(entries, pos, size, "a checksum mismatch", False, max(0, size - pos - n))
        entries.append(Entry(fields[1], pos, n, checksum))
        pos += n
    return Scan(entries, pos, size, "", False, 0)


def _whole_record_after(f, start: int, size: int) -> int | None:
    """The offset of the first whole, valid record at or after ``start`` in ``f``, or None.
    Reads what follows once, in pieces (only when recovery met a bad header)."""
    overlap = len(MAGIC) - 1
    pos, carry = start, b""
    while pos < size:
        f.seek(pos)
        data = f.read(min(_CHUNK, size - pos))
        if not data:  # (shorter than it said)
            break
        piece = carry + data
        base = pos - len(carry)
        for magic in (MAGIC, SPARSE_MAGIC):
            i = piece.find(magic)
            while i >= 0:
                if _valid_at(f, base + i, size):
                    return base + i
                i = piece.find(magic, i + 1)
        pos += len(piece) - len(carry)
        carry = piece[-overlap:]
    return None


def _valid_at(f, offset: int, size: int) -> bool:
    f.seek(offset)
    head = f.read(HEAD)
    why, fields = _check_head(head, offset, size)
    if why or fields is None:
        return False
    h = xxhash.xxh3_64(head[:_FIELDS.size])
    left = fields[5] + fields[6]
    while left:
        data = f.read(min(left, _CHUNK))
        if not data:
            return False
        h.update(data)
        left -= len(data)
    return h.intdigest() == _SUM.unpack_from(head, _FIELDS.size)[0]


def scan(path: Path) -> Scan:
    with open(path, "rb") as f:
        return scan_file(f, os.fstat(f.fileno()).st_size)


def load(f, e: Entry) -> WalRecord | None:
    """The record ``e`` locates in ``f``, or None when its bytes no longer match ``e``.
    ValueError when they match but do not make a gradient (a sparse payload's indices out of
    order or past its size: a writer's bug, since the checksum holds)."""
    f.seek(e.offset)
    head = f.read(HEAD)
    fields = _FIELDS.unpack_from(head) if len(head) == HEAD else None
    if not (fields is not None and fields[0] in (MAGIC, SPARSE_MAGIC) and fields[1] == e.version
            and HEAD + fields[5] + fields[6] == e.size):
        return None
    magic, version, contributors, clock_min, scale, nkeys, npay = fields
    keys = f.read(nkeys)
    payload = np.empty(npay, np.uint8)
    got = f.readinto(memoryview(payload)) if npay else 0
    h = xxhash.xxh3_64(head[:_FIELDS.size])
    h.update(keys)
    h.update(memoryview(payload))
    if len(keys) != nkeys or got != npay or h.intdigest() != e.checksum:
        return None
    grad = None
    if npay and magic == MAGIC:
        grad = payload.view("<f4")
    elif npay:
        (numel,) = _NUMEL.unpack_from(payload)
        n = (npay - _NUMEL.size) // 8
        idx = payload[_NUMEL.size:_NUMEL.size + 4 * n].view("<u4")
        vals = payload[_NUMEL.size + 4 * n:].view("<f4")
        if numel > 0xFFFFFFFF or (n and (int(idx[-1]) >= numel or not bool(np.all(idx[1:] > idx[:-1])))):
            raise ValueError(f"the sparse gradient of version {version} has indices out of order or "
                             f"past its {numel} entries (a writer writes at most 2^32 - 1 sparse)")
        grad = np.zeros(numel, np.float32)
        grad[idx] = vals
    return WalRecord(version, contributors, clock_min, grad, scale, keys)


def cut(path: Path, size: int) -> None:
    """Truncate ``path`` to ``size`` bytes, durably."""
    with open(path, "r+b") as f:
        os.ftruncate(f.fileno(), size)
        os.fsync(f.fileno())
