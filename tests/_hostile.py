"""Hostile inputs for the fuzz tests (pure): protobuf messages with boundary values in every
field, and mutations of raw frame streams. Everything is drawn from the caller's
``random.Random``, so a fixed seed (or Hypothesis' ``st.randoms()``) replays a run exactly.

    rng = random.Random(7)
    req = hostile_message(pb.RegisterRequest, rng, names=("lm", "w0"))
    frames, what = mutate_stream(encode_push(meta, chunks), rng)   # what: "flip 1@3, drop 2"
    frames = restamp(frames[:-1])        # body frames, with an end marker that matches them

``restamp`` is what keeps a mutation from stopping at the stream's digest check: the body is
then taken as whole and its hostile fields reach the tier's own checks.
"""

from __future__ import annotations

import math
import random

import xxhash
from google.protobuf.descriptor import FieldDescriptor as F

from ps.core.errors import BadInput
from ps.net.frames import decode_frame, encode_frame
from ps.net.wire import pb

__all__ = ["hostile_int", "hostile_float", "hostile_str", "hostile_message", "mutate_message",
           "mutate_stream", "mutate_frame_header", "restamp", "flip"]

_RANGE = {F.CPPTYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.CPPTYPE_INT64: (-(1 << 63), (1 << 63) - 1),
          F.CPPTYPE_UINT32: (0, (1 << 32) - 1), F.CPPTYPE_UINT64: (0, (1 << 64) - 1),
          F.CPPTYPE_ENUM: (-(1 << 31), (1 << 31) - 1)}
# Values where arithmetic and bounds go wrong: overflows of u32/i64/f64 mantissas, and -1 as an
# unsigned number (what a negative count becomes on the wire).
_EDGES = sorted({0, 1, 2, 3, 7, 64, 255, 256, 4096, (1 << 20), (1 << 24), (1 << 24) + 1, (1 << 31) - 1,
                 1 << 31, (1 << 32) - 2, (1 << 32) - 1, 1 << 32, 1 << 40, (1 << 53) + 1, (1 << 62),
                 (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -2, -(1 << 31), -(1 << 63)})
_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-3, 1e-45, 5e-324, 3.4e38, 3.5e38, 1.7e308, math.inf, -math.inf,
           math.nan, -math.nan)
_TEXT = ("", " ", "é", "\u2028", "\x00", "..", "a/b", "../../etc/passwd", "%s%n", "名字", "\U0001F600", "-",
         "0" * 64, "job name", "a\nb")


def hostile_int(rng: random.Random, lo: int, hi: int) -> int:
    r = rng.random()
    if r < 0.35:
        return rng.choice([v for v in _EDGES if lo <= v <= hi] or [lo])
    if r < 0.65:
        return rng.randint(max(lo, 0), min(hi, 20))  # near the valid range of most fields
    if r < 0.85:
        k = rng.randint(0, 64)
        v = (1 << k) + rng.choice((-1, 0, 1))
        return v if lo <= v <= hi else hi
    return rng.randint(lo, hi)


def hostile_float(rng: random.Random, width: int = 64) -> float:
    v = rng.choice(_FLOATS) if rng.random() < 0.6 else rng.uniform(-1e6, 1e6)
    if width == 32 and math.isfinite(v) and abs(v) > 3.4e38:
        v = math.copysign(math.inf, v)  # a float field holds no more
    return v


def hostile_str(rng: random.Random, names: tuple[str, ...] = (), big: bool = True) -> str:
    r = rng.random()
    if names and r < 0.45:
        name = rng.choice(names)
        return name if rng.random() < 0.8 else name + rng.choice(_TEXT)  # near a real name
    if r < 0.65:
        return rng.choice(_TEXT)
    if big and r < 0.665:
        return "a" * rng.choice((257, 4097, 1 << 16, 1 << 20))  # echoed names must be cut short
    n = rng.randint(1, 24)
    return "".join(chr(rng.choice((rng.randint(0x20, 0x7E), rng.randint(0xA0, 0xD7FF)))) for _ in range(n))


def _value(field, rng: random.Random, names: tuple[str, ...], depth: int, many: int = 1001):
    t = field.cpp_type
    if t in _RANGE:
        lo, hi = _RANGE[t]
        if t == F.CPPTYPE_ENUM and rng.random() < 0.6:
            return rng.choice([v.number for v in field.enum_type.values])  # a known value
        return hostile_int(rng, lo, hi)
    if t == F.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if t in (F.CPPTYPE_DOUBLE, F.CPPTYPE_FLOAT):
        return hostile_float(rng, 32 if t == F.CPPTYPE_FLOAT else 64)
    if t == F.CPPTYPE_STRING:
        if field.type == F.TYPE_BYTES:
            n = rng.choice((0, 1, 15, 16, 17, 255, 4096))
            return rng.randbytes(n)
        return hostile_str(rng, names, big=not field.is_repeated)  # a thousand 1 MiB names: too slow
    return hostile_message(field.message_type._concrete_class, rng, names, depth + 1, many=many)


def _set(msg, field, value) -> None:
    if field.cpp_type == F.CPPTYPE_MESSAGE:
        if field.is_repeated:
            getattr(msg, field.name).add().CopyFrom(value)
        else:
            getattr(msg, field.name).CopyFrom(value)
    elif field.is_repeated:
        getattr(msg, field.name).append(value)
    else:
        setattr(msg, field.name, value)


def hostile_message(cls, rng: random.Random, names: tuple[str, ...] = (), depth: int = 0, fill: float = 0.7,
                    many: int = 1001):
    """An instance of protobuf class ``cls``, each field set (with probability ``fill``) to a
    boundary value, a name from ``names``, garbage text, or a nested hostile message; repeated
    scalars sometimes hold ``many`` values (a heartbeat names at most 1000 jobs)."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if rng.random() > fill or (field.cpp_type == F.CPPTYPE_MESSAGE and depth >= 3):
            continue
        count = (rng.choice((1, 1, 2, 3, 8, many)) if field.cpp_type != F.CPPTYPE_MESSAGE
                 else rng.choice((1, 1, 2, 3))) if field.is_repeated else 1
        for _ in range(count):
            _set(msg, field, _value(field, rng, names, depth, many))
    return msg


def mutate_message(msg, rng: random.Random, names: tuple[str, ...] = ()) -> str:
    """Set one field somewhere in ``msg`` (nested messages included) to a hostile value, in
    place; returns the field's path."""
    path, cur = [], msg
    for _ in range(4):
        fields = list(cur.DESCRIPTOR.fields)
        field = rng.choice(fields)
        path.append(field.name)
        if field.cpp_type == F.CPPTYPE_MESSAGE:
            if field.is_repeated:
                items = getattr(cur, field.name)
                cur = items[rng.randrange(len(items))] if len(items) and rng.random() < 0.8 else items.add()
            else:
                cur = getattr(cur, field.name)
            continue
        value = _value(field, rng, names, 3)
        if field.is_repeated:
            items = getattr(cur, field.name)
            if len(items) and rng.random() < 0.7:
                items[rng.randrange(len(items))] = value
            else:
                items.append(value)
        else:
            setattr(cur, field.name, value)
        break
    return ".".join(path)


def flip(data: bytes, rng: random.Random, head_bias: int = 64) -> bytes:
    """``data`` with 1-4 bytes changed, mostly in its first ``head_bias`` bytes (headers;
    payload bytes are opaque to the frame layer)."""
    if not data:
        return bytes([rng.randrange(256)])
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        span = len(buf) if rng.random() < 0.3 else min(len(buf), head_bias)
        buf[rng.randrange(span)] = rng.randrange(256)
    return bytes(buf)


def mutate_frame_header(frame: bytes, rng: random.Random, names: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """The frame with one hostile field in its header and its payload unchanged (a frame that
    does not decode is flipped instead)."""
    try:
        header, payload = decode_frame(frame)
    except BadInput:
        return flip(frame, rng), "flip"
    where = mutate_message(header, rng, names)
    return encode_frame(header, payload), f"header.{where}"


def restamp(body: list[bytes]) -> list[bytes]:
    """``body`` and a StreamEnd that counts and digests it, as a sender would write it; frames
    that do not decode count no payload bytes."""
    h, payload = xxhash.xxh3_128(), 0
    for f in body:
        h.update(f)
        try:
            payload += len(decode_frame(f)[1])
        except BadInput:
            pass
    end = pb.StreamEnd(frames=len(body), payload_bytes=payload, digest=h.digest())
    return [*body, encode_frame(pb.FrameHeader(end=end))]


def mutate_stream(frames: list[bytes], rng: random.Random, names: tuple[str, ...] = ()
                  ) -> tuple[list[bytes], str]:
    """1-3 mutations of a frame stream: bytes flipped, frames dropped, duplicated, swapped,
    truncated, extended or inserted, a hostile header field, the stream cut, the end marker
    lost or replaced. Returns the frames and what was done."""
    out, done = list(frames), []
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(("flip", "drop", "dup", "swap", "truncate", "extend", "insert", "header",
                         "cut", "no_end", "end"))
        i = rng.randrange(len(out)) if out else 0
        if not out and op not in ("insert", "end"):
            op = "insert"
        if op == "flip":
            out[i] = flip(out[i], rng)
        elif op == "drop":
            del out[i]
        elif op == "dup":
            out.insert(rng.randrange(len(out) + 1), out[i])
        elif op == "swap":
            j = rng.randrange(len(out))
            out[i], out[j] = out[j], out[i]
        elif op == "truncate":
            out[i] = out[i][:rng.randrange(len(out[i]) + 1)]
        elif op == "extend":
            out[i] = out[i] + rng.randbytes(rng.randint(1, 9))
        elif op == "insert":
            junk = rng.choice((rng.randbytes(rng.randint(0, 40)), b"\x0a\x00", b"\x0a\x02\x32\x00"))
            out.insert(rng.randrange(len(out) + 1), junk)
        elif op == "header":
            out[i], where = mutate_frame_header(out[i], rng, names)
            op = f"{op}:{where}"
        elif op == "cut":
            out = out[:rng.randrange(len(out))]
        elif op == "no_end":
            out = out[:-1]
        elif op == "end":
            end = pb.StreamEnd(frames=hostile_int(rng, 0, (1 << 32) - 1),
                               payload_bytes=hostile_int(rng, 0, (1 << 64) - 1), digest=rng.randbytes(16))
            out = out[:-1] + [encode_frame(pb.FrameHeader(end=end))]
        done.append(f"{op}@{i}")
    return out, ", ".join(done)
