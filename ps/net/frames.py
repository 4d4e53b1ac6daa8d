"""Frames: how every streamed message of hps is cut, and how a streamed body proves it is whole.

    >>> from ps.net.frames import BodyReader, decode_frame, encode_frame, with_end
    >>> from ps.net.proto import hps_pb2 as pb
    >>> body = with_end([encode_frame(pb.FrameHeader(push=pb.PushHeader(job="lm", seq=1))),
    ...                  encode_frame(pb.FrameHeader(chunks=pb.ChunkBatch()), bytes(8))])
    >>> reader = BodyReader("push", what="push")
    >>> [reader.feed(f)[0] for f in body]            # header, chunks, end marker
    ['push', 'chunks', 'end']
    >>> len(reader.finish())                         # the body's XXH3-128 digest: its identity
    16
    >>> cut = BodyReader("push", what="push")
    >>> _ = cut.feed(body[0])
    >>> cut.finish()                                 # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ps.core.errors.BadInput: push stream ended after 1 frames without its end marker: it was cut ...

A frame is the protobuf encoding of ``hps.v1.Frame`` written by hand:
``0x0a varint(len(header)) header 0x12 varint(len(payload)) payload``. Decoding parses the
small header with protobuf and slices the payload without copying it (a protobuf ``bytes``
field would copy on access: measured 0.41x of raw TCP against 0.91x for raw frames).

A payload starts at a multiple of ``ALIGN`` (16) bytes into its frame: the header carries as
many zero bytes in its ``pad`` field as that takes (the field at most 17 bytes). A received
frame is a fresh ``bytes`` object, whose data is 16-byte aligned, so fp32 values sliced from
it are aligned: numpy reads them where they lie. Unaligned (a chunk frame's payload used to
start 33 bytes in), every pass over a received chunk took numpy's unaligned path: the
finiteness check every tier makes of an arriving chunk (a dot product) ~20x slower, and each
add copied its input through a buffer first (``benchmarks/copies.py`` counted one
full-vector copy per pull that way; ``benchmarks/frame_align.py`` times the passes).

    >>> from ps.net.frames import ALIGN
    >>> frame = encode_frame(pb.FrameHeader(chunks=pb.ChunkBatch()), bytes(8))
    >>> (len(frame) - 8) % ALIGN, decode_frame(frame)[1].nbytes
    (0, 8)

Client-streamed bodies (Push, CreateJob) end with a ``StreamEnd`` frame that counts and digests
the frames before it (XXH3-128). ``BodyReader`` checks the order of the frames and the end
as they arrive, so a receiver can act on the header first and never takes a cut stream for a
whole one: gRPC ends a server's request iterator normally when the client is cancelled, times
out or disconnects mid-stream. Server-streamed replies (Pull) need no marker: the client sees
the call's status, and every version's checksum is verified before it is applied.

A push sent again after its answer was lost says so in its end marker (``as_resend``), outside
the digest, with the tier incarnation it went to: the same push, which a tier of another
incarnation that does not hold it must not take for a new one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import xxhash
from google.protobuf.message import DecodeError

from ps.core.errors import BadInput
from ps.net.proto import hps_pb2 as pb

__all__ = ["ALIGN", "MAX_FRAME_PAYLOAD", "encode_frame", "decode_frame", "with_end", "as_resend", "BodyReader"]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise BadInput("malformed frame: truncated length prefix")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


ALIGN = 16  # a payload's offset in its frame is a multiple of this
_PAD_TAG = b"\x7a"  # FrameHeader.pad: field 15, length-delimited


def encode_frame(header: pb.FrameHeader, payload: bytes | memoryview | list[bytes | memoryview] = b"") -> bytes:
    """One frame: ``header`` and ``payload`` (or the concatenation of a list of parts, joined
    with the rest in one copy), the payload at a multiple of ``ALIGN`` bytes into the frame."""
    h = header.SerializeToString()
    parts = payload if isinstance(payload, list) else [payload]
    n = sum(len(p) for p in parts)
    if n:
        h += _padding(len(h), len(_varint(n)))
    return b"".join((b"\x0a", _varint(len(h)), h, b"\x12", _varint(n), *parts))


def _padding(header: int, payload_prefix: int) -> bytes:
    """The ``pad`` field (appended to a serialized header of ``header`` bytes) that puts the
    payload, after its ``payload_prefix``-byte length, at a multiple of ALIGN."""
    def offset(h: int) -> int:  # where the payload starts, for a header of h bytes
        return 1 + len(_varint(h)) + h + 1 + payload_prefix

    if offset(header) % ALIGN == 0:
        return b""
    for k in range(2 * ALIGN + 2):  # the field's own tag and length take 2 bytes
        field = _PAD_TAG + _varint(k) + bytes(k)
        if offset(header + len(field)) % ALIGN == 0:
            return field
    raise AssertionError("unreachable: some pad length aligns the payload")


def decode_frame(data: bytes) -> tuple[pb.FrameHeader, memoryview]:
    buf = memoryview(data)
    if len(buf) < 2 or buf[0] != 0x0A:
        raise BadInput(f"malformed frame: {len(buf)} bytes not starting with a header field")
    n, pos = _read_varint(buf, 1)
    if pos + n > len(buf):
        raise BadInput(f"malformed frame: header of {n} bytes overruns the {len(buf)}-byte frame")
    header = pb.FrameHeader()
    try:
        header.ParseFromString(buf[pos:pos + n])
    except DecodeError as exc:
        raise BadInput(f"malformed frame: header does not parse ({exc})") from None
    if header.pad:
        header.ClearField("pad")  # layout only: a header re-sent is padded for its own frame
    pos += n
    payload = buf[pos:pos]
    if pos < len(buf):
        if buf[pos] != 0x12:
            raise BadInput("malformed frame: unexpected field after the header")
        m, pos = _read_varint(buf, pos + 1)
        if pos + m != len(buf):
            raise BadInput(f"malformed frame: payload says {m} bytes, {len(buf) - pos} present")
        payload = buf[pos:pos + m]
    if header.WhichOneof("kind") is None:
        raise BadInput("malformed frame: header has no kind")
    return header, payload


MAX_FRAME_PAYLOAD = 4 * 1024 * 1024


def with_end(frames: list[bytes]) -> list[bytes]:
    """``frames`` and the StreamEnd that counts and digests them."""
    h, payload = xxhash.xxh3_128(), 0
    for f in frames:
        h.update(f)
        payload += len(decode_frame(f)[1])
    end = pb.StreamEnd(frames=len(frames), payload_bytes=payload, digest=h.digest())
    return [*frames, encode_frame(pb.FrameHeader(end=end))]


def as_resend(frames: Iterable[bytes], sent_to: int) -> Iterator[bytes]:
    """``frames`` (a body, its StreamEnd last) with the end marker saying the body was sent
    before, to the tier incarnation ``sent_to`` (a server epoch, not 0), and its answer never
    came. The digest is unchanged: it covers the frames before the end marker only. A body
    that ends without its marker (a streamed push cut short) passes as it is: cut."""
    if not sent_to:
        raise ValueError("a resend names the incarnation the earlier copy went to (a server epoch, not 0)")
    last = None
    for f in frames:
        if last is not None:
            yield last
        last = f
    if last is None:
        return
    h, _ = decode_frame(last)
    if h.WhichOneof("kind") == "end":
        h.end.resend_to = sent_to
        last = encode_frame(h)
    yield last


class BodyReader:
    """Checks a client-streamed body frame by frame: ``first`` kind, then chunk frames, then
    (optionally, at most once) a ``tail`` frame, then the StreamEnd, whose counts and digest
    must match what arrived.

        reader = BodyReader("push", what="push")
        for data in frames:
            kind, header, payload = reader.feed(data)
        digest = reader.finish()        # BadInput if the stream was cut before its end
    """

    def __init__(self, first: str, what: str, tail: str = "") -> None:
        self.first, self.what, self.tail = first, what, tail
        self.tailed = False  # the ``tail`` frame (optional, at most one, last before the end) came
        self.frames = 0
        self.payload_bytes = 0
        self.digest: bytes | None = None
        self.resend_to = 0  # the end marker says the body was sent before, to this incarnation (``as_resend``)
        self._hash = xxhash.xxh3_128()

    def feed(self, data: bytes) -> tuple[str, pb.FrameHeader, memoryview]:
        if self.digest is not None:
            raise BadInput(f"malformed {self.what}: a frame after the stream's end marker")
        h, payload = decode_frame(data)
        kind = h.WhichOneof("kind")
        if self.frames == 0 and kind != self.first:
            raise BadInput(f"malformed {self.what}: first frame is {kind!r}, expected a {self.first} header")
        if self.frames and self.tailed and kind != "end":
            raise BadInput(f"malformed {self.what}: frame {self.frames} is {kind!r} after the {self.tail} "
                           "frame; only the end marker may follow it")
        if self.frames and kind not in ("chunks", "end") and not (self.tail and kind == self.tail):
            raise BadInput(f"malformed {self.what}: frame {self.frames} is {kind!r}, expected tensor "
                           "chunks or the end marker")
        if self.frames and kind == self.tail:
            if len(payload):
                raise BadInput(f"malformed {self.what}: its {self.tail} frame carries {len(payload)} payload "
                               "bytes; it has none")
            self.tailed = True
        if kind == "end":
            e, digest = h.end, self._hash.digest()
            if (e.frames, e.payload_bytes, e.digest) != (self.frames, self.payload_bytes, digest):
                raise BadInput(f"malformed {self.what}: the end marker counts {e.frames} frames and "
                               f"{e.payload_bytes} payload bytes, {self.frames} and {self.payload_bytes} "
                               "arrived (or their digest differs); nothing was applied")
            self.digest, self.resend_to = digest, e.resend_to
        else:
            self._hash.update(data)
            self.frames += 1
            self.payload_bytes += len(payload)
        return kind, h, payload

    def finish(self) -> bytes:
        """The body's digest; BadInput if the stream ended before its end marker."""
        if self.digest is None:
            raise BadInput(f"{self.what} stream ended after {self.frames} frames without its end "
                           "marker: it was cut (cancelled, timed out or disconnected); nothing was applied")
        return self.digest
