"""Property-based fuzzing of everything that parses untrusted bytes (pure, a few seconds).

    .venv/bin/python -m pytest -q tests/core/test_fuzz_decoders.py

Each decoder -- raw frames, client-streamed bodies (``BodyReader`` through ``decode_push`` and
``decode_create_job``), pull replies, protobuf-to-domain conversions, every codec, the
``Assembler``, request parsing and the exactly-once key records -- is fed arbitrary bytes,
mutated valid inputs (bytes flipped, frames dropped, duplicated, reordered, truncated, the end
marker lost or forged) and structurally valid inputs with hostile field values. It must either
return a well-formed result or raise ``BadInput``: never another exception, never more than a
second, never an allocation past ``_MEMORY_SLACK`` (the address space is bounded while it
runs, so a decoder that allocates what a header claims fails with MemoryError here instead of
passing lazily). Encode -> decode round trips are exact, and a push stream that lost its end
marker or had a frame altered never decodes to a whole push with the original digest.

Hypothesis runs derandomized with a bounded number of examples: the same inputs every run
(set ``derandomize=False`` and raise ``max_examples`` locally to explore anew).
``tests/net/test_wire.py`` and ``tests/core/test_codecs.py`` hold the hand-written cases.
"""

from __future__ import annotations

import contextlib
import resource
import struct
import time
from unittest import mock

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ps.net.wire
from ps.core.codecs import CODEC_NAMES, get_codec, half, int4, int8, powersgd, rows, sign, topk
from ps.core.config import JobConfig
from ps.core.errors import BadInput
from ps.core.exactly_once import AppliedBook, decode_keys, encode_keys
from ps.core.tensors import Assembler, Chunk, assemble, split
from ps.core.types import PullMeta, PushKey, PushMeta, VersionMeta
from ps.core.view import KeySpec, Layout
from ps.net.messages import job_from_pb, job_to_pb, layout_from_pb, layout_to_pb
from ps.net.wire import (
    METHODS,
    decode_create_job,
    decode_frame,
    decode_pull_reply,
    decode_push,
    encode_create_job,
    encode_frame,
    encode_pull_reply,
    encode_push,
    pb,
)
from ps.server.service import parse
from tests._hostile import flip, hostile_int, hostile_message, hostile_str, mutate_message, mutate_stream, restamp

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RNG = st.randoms(use_true_random=False)  # Hypothesis draws (and replays) every choice
U64 = (1 << 64) - 1
_MEMORY_SLACK = 1 << 30  # what one decode may allocate beyond the process's size
_TIME_LIMIT_S = 1.0      # CPU seconds; real decodes take microseconds

LAYOUT = Layout([KeySpec("enc.w", (20, 7)), KeySpec("enc.b", (7,)), KeySpec("emb", (6, 4))])
NAMES = ("lm", "w0", "zone-a", "enc.w", "enc.b", "emb")
META = PushMeta(job="lm", sender="w0", seq=3, base_version=7, view_epoch=0xABC, contributors=2,
                clock_min=1, clock_max=4, incarnation=0x5EED, sources=(PushKey("w1", 9, 2, b"d" * 16),))


def _grad(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.numel).astype(np.float32)


def _chunks(codec: str = "fp32", seed: int = 0, chunk_elems: int = 16):
    return split(LAYOUT, _grad(seed), get_codec(codec), chunk_elems=chunk_elems)


with mock.patch.object(ps.net.wire, "MAX_FRAME_PAYLOAD", 96):  # many small frames to drop and reorder
    PUSH = encode_push(META, _chunks() + _chunks("fp32+zstd", seed=1, chunk_elems=40)[:2])
    CREATE = encode_create_job(JobConfig(name="lm"), LAYOUT,
                               split(LAYOUT, _grad(2), get_codec("fp32"), chunk_elems=32))
    PULL = list(encode_pull_reply(PullMeta(0xABC, 6, 8, False, 0xDEF),
                                  [(VersionMeta(7, 0xFFFFFFFF, 1, 2), _chunks(seed=3)),
                                   (VersionMeta(8, 5, 2, 3), _chunks("fp16", seed=4))]))
PUSH_DIGEST = decode_push(PUSH)[2]


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def _bounded_memory(slack: int = _MEMORY_SLACK):
    """The address space capped at its current size plus ``slack`` (Linux)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_bytes() + slack
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _untrusted(fn, *args):
    """``fn(*args)``, or None when it refuses with BadInput; any other exception, a call past
    ``_TIME_LIMIT_S`` or an allocation past ``_MEMORY_SLACK`` fails the test. The time is the
    thread's CPU time: a decode that loops burns it, while a shared machine's load only
    stretches the wall clock (1.0 s of wall time failed once under CI's load)."""
    t0 = time.thread_time()
    try:
        with _bounded_memory():
            return fn(*args)
    except BadInput as exc:
        assert str(exc), "a refusal needs a sentence"
        return None
    finally:
        took = time.thread_time() - t0
        assert took < _TIME_LIMIT_S, f"{fn.__name__} took {took:.2f}s of CPU"


def _is_end(frame: bytes) -> bool:
    try:
        return decode_frame(frame)[0].WhichOneof("kind") == "end"
    except BadInput:
        return False


def _same_chunks(a: list[Chunk], b: list[Chunk]) -> bool:
    return [(*(c.key, c.shape, c.dtype, c.offset, c.numel, c.codec), bytes(c.payload)) for c in a] == \
           [(*(c.key, c.shape, c.dtype, c.offset, c.numel, c.codec), bytes(c.payload)) for c in b]


# ============================================================================ frames


@SETTINGS
@given(st.one_of(st.binary(max_size=80), st.binary(max_size=80).map(lambda b: b"\x0a" + b)))
def test_decode_frame_of_arbitrary_bytes_returns_a_header_with_a_kind_or_refuses(data):
    got = _untrusted(decode_frame, data)
    if got is not None:
        header, payload = got
        assert header.WhichOneof("kind") is not None
        assert isinstance(payload, memoryview) and payload.obj is data  # a slice, never a copy


@SETTINGS
@given(RNG, st.binary(max_size=300))
def test_frames_round_trip_exactly_whatever_their_header_holds(rng, payload):
    header = pb.FrameHeader()
    kind = rng.choice(pb.FrameHeader.DESCRIPTOR.oneofs_by_name["kind"].fields)
    getattr(header, kind.name).CopyFrom(hostile_message(kind.message_type._concrete_class, rng, NAMES, many=9))
    data = encode_frame(header, payload)
    got_header, got_payload = decode_frame(data)
    assert got_header == header and bytes(got_payload) == payload
    frame = pb.Frame.FromString(data)  # the generated class agrees, but for the zeros that align the payload
    assert not any(frame.header.pad) and (not payload or (len(data) - len(payload)) % 16 == 0)
    frame.header.ClearField("pad")
    assert frame == pb.Frame(header=header, payload=payload)


# ============================================================================ client-streamed bodies


@SETTINGS
@given(RNG)
def test_a_mutated_push_is_refused_or_is_exactly_what_arrived(rng):
    """Invariant 7: a stream without its end marker, or with any frame altered, dropped,
    duplicated or reordered, never decodes to a whole push with the original digest; what does
    decode is digested from the frames that arrived."""
    frames, what = mutate_stream(PUSH, rng, NAMES)
    if rng.random() < 0.3 and frames:
        frames = restamp(frames[:-1] if _is_end(frames[-1]) else frames)  # a consistent end marker
    got = _untrusted(decode_push, frames)
    if not frames or not _is_end(frames[-1]):
        assert got is None, f"{what}: a stream without its end marker decoded"
    if got is None:
        return
    meta, chunks, digest = got
    assert digest == xxhash.xxh3_128(b"".join(frames[:-1])).digest(), what
    if frames[:-1] == PUSH[:-1]:  # only the end marker's bytes changed, not what it vouches for
        assert (meta, digest) == (META, PUSH_DIGEST) and _same_chunks(chunks, decode_push(PUSH)[1])
    else:
        assert digest != PUSH_DIGEST, f"{what}: an altered body kept the original digest"


@SETTINGS
@given(RNG)
def test_a_push_with_a_hostile_header_decodes_to_what_it_says_or_is_refused(rng):
    header = hostile_message(pb.PushHeader, rng, NAMES, many=9)
    frames = restamp([encode_frame(pb.FrameHeader(push=header))] + PUSH[1:-1])
    got = _untrusted(decode_push, frames)
    if got is not None:
        meta, chunks, _ = got
        assert (meta.job, meta.sender, meta.seq, meta.contributors, meta.incarnation) == \
               (header.job, header.sender, header.seq, header.contributors, header.incarnation)
        assert meta.workers == max(1, header.workers) and len(meta.sources) == len(header.sources)
        assert _same_chunks(chunks, decode_push(PUSH)[1])


@SETTINGS
@given(RNG)
def test_a_mutated_create_job_stream_is_refused_or_well_formed(rng):
    frames, what = mutate_stream(CREATE, rng, NAMES)
    if rng.random() < 0.5 and frames:
        frames = restamp(frames[:-1] if _is_end(frames[-1]) else frames)
    got = _untrusted(decode_create_job, frames)
    if not frames or not _is_end(frames[-1]):
        assert got is None, f"{what}: a stream without its end marker decoded"
    if got is not None:
        cfg, layout, chunks = got
        assert isinstance(cfg, (JobConfig, str)) and (layout is None or isinstance(layout, Layout))
        assert layout is not None or not chunks
        assert all(c.codec in CODEC_NAMES for c in chunks)


def _job_config(rng) -> pb.JobConfig:
    """A hostile JobConfig: every field drawn, or a valid one with one field hostile."""
    if rng.random() < 0.5:
        return hostile_message(pb.JobConfig, rng, NAMES, many=9)
    m = job_to_pb(JobConfig(name="lm", mode=rng.choice(("bsp", "ssp", "async"))))
    mutate_message(m, rng, NAMES)
    return m


@SETTINGS
@given(RNG)
def test_a_create_job_with_a_hostile_header_is_refused_or_valid(rng):
    keys = layout_to_pb(LAYOUT)
    if rng.random() < 0.5:
        keys = [hostile_message(pb.KeySpec, rng, NAMES, many=9) for _ in range(rng.randint(0, 3))]
    elif rng.random() < 0.5:
        mutate_message(keys[rng.randrange(len(keys))], rng, NAMES)
    header = pb.JobHeader(config=_job_config(rng), keys=keys)
    got = _untrusted(decode_create_job, restamp([encode_frame(pb.FrameHeader(job=header))]))
    if got is not None:
        cfg, layout, _ = got
        assert isinstance(cfg, JobConfig) or cfg == header.config.name
        if layout is not None:
            assert layout_from_pb(layout_to_pb(layout)) == layout and 0 <= layout.numel <= 1 << 40


@SETTINGS
@given(RNG)
def test_a_mutated_pull_reply_is_refused_or_well_formed(rng):
    frames, what = mutate_stream(PULL, rng, NAMES)
    got = _untrusted(decode_pull_reply, frames)
    if got is not None:
        meta, versions = got
        assert isinstance(meta, PullMeta)
        for vm, chunks in versions:
            assert isinstance(vm, VersionMeta)
            assert all(c.codec in CODEC_NAMES and c.dtype in ("float32", "float16", "bfloat16", "float64")
                       for c in chunks)


def test_pull_replies_round_trip_exactly():
    meta, versions = decode_pull_reply(PULL)
    with mock.patch.object(ps.net.wire, "MAX_FRAME_PAYLOAD", 96):  # as PULL was packed
        assert list(encode_pull_reply(meta, versions)) == PULL


# ============================================================================ protobuf -> domain


@SETTINGS
@given(RNG)
def test_job_from_pb_of_any_message_is_a_valid_config_or_refused(rng):
    cfg = _untrusted(job_from_pb, _job_config(rng))
    if cfg is not None:
        assert isinstance(cfg, JobConfig)  # validated at construction
        assert job_from_pb(job_to_pb(cfg)) == cfg  # and it round-trips


@SETTINGS
@given(RNG)
def test_layout_from_pb_of_any_keys_is_a_valid_layout_or_refused(rng):
    keys = [hostile_message(pb.KeySpec, rng, NAMES, many=9) for _ in range(rng.randint(0, 4))]
    if rng.random() < 0.3:  # valid but for one huge dimension
        keys = [pb.KeySpec(key=f"k{i}", dtype=pb.DTYPE_FLOAT32, shape=[rng.choice((1 << 20, 1 << 40, 1 << 62)), 2])
                for i in range(2)]
    layout = _untrusted(layout_from_pb, keys)
    if layout is not None:
        assert layout.numel <= 1 << 40 and layout_from_pb(layout_to_pb(layout)) == layout


@SETTINGS
@given(RNG)
def test_every_request_parses_to_its_message_or_is_refused(rng):
    classes = [req for _, req, _ in METHODS.values() if req is not None]
    cls = rng.choice(classes)
    good = hostile_message(cls, rng, NAMES, many=9).SerializeToString()
    data = rng.choice((rng.randbytes(rng.randint(0, 64)), good,
                       good[:rng.randrange(len(good) + 1)],
                       flip(good, rng)))
    got = _untrusted(parse, cls, data)
    assert got is None or isinstance(got, cls)


# ============================================================================ codecs


_UNSIZED = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 16)


def _zstd(rng, need: int) -> bytes:
    """A zstd frame header that declares ``need`` bytes (what the codec will ask for), another
    size, or none, followed by an empty last block -- or a frame without a size."""
    r = rng.random()
    if r < 0.25:
        return rng.choice((_UNSIZED, rng.randbytes(12)))
    size = need if r < 0.7 else hostile_int(rng, 0, U64)
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, size % (1 << 64)) + b"\x01\x00\x00"


def _crafted(name: str, rng, numel: int) -> bytes:
    """A payload with this codec's header (format 1, the chunk's numel, hostile other fields)
    and an arbitrary or size-claiming body: past the first checks, into the decoder proper."""
    body = rng.randbytes(rng.choice((0, 3, 16, 64)))
    count = rng.choice((numel, numel // 2, 1, hostile_int(rng, 0, U64)))
    if name == "fp16":
        return half._HEAD16.pack(1, hostile_int(rng, -(1 << 15), (1 << 15) - 1), numel) + body
    if name == "bf16":
        return half._HEADBF.pack(1, numel) + body
    if name == "int8":
        return int8._HEAD.pack(1, hostile_int(rng, 0, (1 << 32) - 1), numel) + body
    if name == "int4":
        return int4._HEAD.pack(1, hostile_int(rng, 0, (1 << 32) - 1), numel) + body
    if name == "sign":
        return sign._HEAD.pack(1, rng.choice((1.0, -1.0, float("nan"), float("inf"))), numel) + body
    if name == "topk":
        return topk._HEAD.pack(1, hostile_int(rng, -100, 113), count, numel) + rng.choice((_zstd(rng, 6 * count), body))
    if name == "rows":
        frame = _zstd(rng, 4 * count)
        head = rows._HEAD.pack(1, rng.choice((1, hostile_int(rng, 0, (1 << 32) - 1))), count, numel)
        return head + rows._LEN.pack(rng.choice((len(frame), hostile_int(rng, 0, (1 << 32) - 1)))) + frame + body
    if name == "powersgd":
        # A shape that fits the chunk, or one that does not; the body sized for it, or not.
        r = rng.choice((1, 2, 64, 65, hostile_int(rng, 0, (1 << 32) - 1)))
        rows_ = rng.choice((1, max(1, numel // 2), numel, hostile_int(rng, 0, U64)))
        cols = numel // rows_ if rows_ and rng.random() < 0.7 else hostile_int(rng, 0, U64)
        sized = b"\0" * min(4 * r * (rows_ + cols), 4096)
        return powersgd._HEAD.pack(1, r, rows_, cols, numel) + rng.choice((sized, body))
    return rng.choice((_zstd(rng, 4 * numel), body))  # fp32, fp32+zstd


def _options(name: str, n: int, rng) -> dict:
    """Options that let codec ``name`` encode ``n`` elements: rows of width 1; powersgd as a
    matrix of a random shape n fits (rows x width)."""
    if name == "rows":
        return {"width": 1}
    if name == "powersgd":
        return {"width": rng.choice([w for w in range(1, n + 1) if n % w == 0]), "rank": rng.randint(1, 4)}
    return {}


@SETTINGS
@given(RNG)
def test_every_codec_decodes_hostile_payloads_to_numel_floats_or_refuses(rng):
    _decode_hostile(rng.choice(CODEC_NAMES), rng)


@SETTINGS
@given(RNG)
def test_powersgd_decodes_hostile_payloads_to_numel_floats_or_refuses(rng):
    """The newest codec, on its own: its header declares a shape and a rank that must agree
    with the chunk and the payload's length before anything is allocated or multiplied."""
    _decode_hostile("powersgd", rng)


def _decode_hostile(name: str, rng) -> None:
    numel = rng.choice((0, 1, rng.randint(1, 300), 1 << 31, 1 << 40, 1 << 40, hostile_int(rng, 0, 1 << 40)))
    kind = rng.random()
    if kind < 0.3:
        payload = rng.randbytes(rng.randint(0, 64))
    elif kind < 0.7:
        payload = _crafted(name, rng, numel)
    else:  # a real payload, damaged, possibly for another size
        n = rng.randint(1, 300)
        x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(n).astype(np.float32)
        x[: n // 3] = 0
        payload = bytearray(get_codec(name, **_options(name, n, rng)).encode(x))
        for _ in range(rng.randint(0, 3)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        numel = n if rng.random() < 0.7 else numel
    got = _untrusted(get_codec(name).decode, memoryview(bytes(payload)), numel)
    if got is not None:
        assert got.dtype == np.float32 and got.shape == (numel,)


# ============================================================================ assembler


def _hostile_chunk(rng) -> Chunk:
    spec = rng.choice(LAYOUT.specs)
    key = spec.key if rng.random() < 0.8 else hostile_str(rng, NAMES, big=False)
    shape = spec.shape if rng.random() < 0.8 else tuple(hostile_int(rng, -(1 << 63), (1 << 63) - 1)
                                                          for _ in range(rng.randint(0, 3)))
    dtype = "float32" if rng.random() < 0.9 else rng.choice(("float16", "bfloat16", "float64"))
    offset = rng.randrange(spec.numel) if rng.random() < 0.7 else hostile_int(rng, 0, U64)
    numel = rng.randint(1, spec.numel - min(offset, spec.numel - 1)) if rng.random() < 0.7 else hostile_int(rng, 0, U64)
    codec = rng.choice(CODEC_NAMES)
    if rng.random() < 0.6 and 0 < numel <= 4096:
        x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(numel).astype(np.float32)
        if rng.random() < 0.2:
            x[rng.randrange(numel)] = rng.choice((np.nan, np.inf, -np.inf))
        payload = get_codec(codec, **_options(codec, numel, rng)).encode(x)
    else:
        payload = rng.randbytes(rng.randint(0, 48))
    return Chunk(key, shape, dtype, offset, numel, codec, memoryview(payload))


@SETTINGS
@given(RNG)
def test_the_assembler_takes_or_refuses_each_hostile_chunk_and_finishes_well_formed(rng):
    a = Assembler(LAYOUT, what="fuzzed push")
    for _ in range(rng.randint(1, 8)):
        _untrusted(a.add, _hostile_chunk(rng))
    out = _untrusted(a.finish, rng.random() < 0.5)
    if out is not None:
        assert out.dtype == np.float32 and out.shape == (LAYOUT.numel,) and np.isfinite(out).all()


@SETTINGS
@given(RNG)
def test_lossless_chunks_assemble_to_the_exact_bits(rng):
    x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(LAYOUT.numel).astype(np.float32)
    x[rng.randrange(LAYOUT.numel)] = rng.choice((0.0, -0.0, 1e-45, 3.4e38))
    chunks = split(LAYOUT, x, get_codec(rng.choice(("fp32", "fp32+zstd"))), chunk_elems=rng.randint(1, 200),
                   rows=frozenset({"emb"}) if rng.random() < 0.5 else frozenset())
    rng.shuffle(chunks)  # chunks may arrive in any order
    assert assemble(LAYOUT, chunks, what="push", require_all=True).tobytes() == x.tobytes()


# ============================================================================ exactly-once records


def _keys(rng) -> list[PushKey]:
    return [PushKey(hostile_str(rng, NAMES, big=False), hostile_int(rng, 0, U64), hostile_int(rng, 0, U64),
                    rng.randbytes(rng.choice((0, 16, 255)))) for _ in range(rng.randint(0, 5))]


@SETTINGS
@given(RNG)
def test_push_keys_round_trip_and_damaged_records_are_refused(rng):
    keys = _keys(rng)
    data = encode_keys(keys)
    assert decode_keys(data) == tuple(keys)
    damaged = rng.choice((rng.randbytes(rng.randint(0, 60)), data[:rng.randrange(len(data) + 1)],
                          flip(data, rng, head_bias=len(data))))
    got = _untrusted(decode_keys, damaged)
    assert got is None or all(isinstance(k, PushKey) for k in got)


@SETTINGS
@given(RNG)
def test_the_applied_book_loads_what_it_dumped_and_refuses_damage(rng):
    book = AppliedBook(horizon=rng.randint(1, 6))  # a short horizon: some records are dropped
    versions = {}
    for v in range(1, rng.randint(2, 6)):
        keys = _keys(rng)
        book.add(v, keys)
        versions.update({(k.member, k.incarnation, k.seq): (k, v) for k in keys})
    last = rng.randint(0, 4)
    data, runs = book.dump(last=last), book.dump_dropped(last=last)
    again = AppliedBook()
    again.load(data, runs)
    # each applied key is held with its version, or known dropped: never taken for "not applied"
    assert all(again.lookup(k) == v or again.forgotten(k) for k, v in versions.values())
    damaged = rng.choice((rng.randbytes(rng.randint(0, 60)), data[:rng.randrange(len(data) + 1)],
                          flip(data, rng, head_bias=len(data))))
    _untrusted(AppliedBook().load, damaged)
    damaged = rng.choice((rng.randbytes(rng.randint(0, 60)), runs[:rng.randrange(len(runs) + 1)],
                          flip(runs, rng, head_bias=len(runs))))
    _untrusted(AppliedBook().load, b"", damaged)


def test_the_address_space_bound_catches_a_wild_allocation():
    """The harness itself: an allocation past the slack fails instead of passing lazily."""
    with pytest.raises(MemoryError):
        _untrusted(np.zeros, 2 * _MEMORY_SLACK // 4, np.float32)
