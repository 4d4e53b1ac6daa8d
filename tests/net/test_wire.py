"""Unit tests for ps.net.wire and ps.net.messages: hand-written raw frames, push/pull streams and job conversion.

    .venv/bin/python -m pytest -q tests/net/test_wire.py

The frame bytes are the protobuf encoding of ``hps.v1.Frame``, so they are also checked
against the generated message class in both directions (interop with generated stubs).
Every malformed input must surface as ``BadInput`` (INVALID_ARGUMENT), never as a crash.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import BadInput
from ps.core.tensors import assemble, split
from ps.core.types import PullMeta, PushKey, PushMeta, VersionMeta
from ps.core.view import KeySpec, Layout
from ps.net.frames import BodyReader, decode_frame, encode_frame
from ps.net.messages import job_from_pb, job_to_pb, layout_from_pb, layout_to_pb
from ps.net.wire import (
    as_resend,
    decode_create_job,
    decode_pull_reply,
    decode_push,
    encode_create_job,
    encode_pull_reply,
    encode_push,
    pb,
)

__all__: list[str] = []

LAYOUT = Layout([KeySpec("enc.w", (20, 7)), KeySpec("enc.b", (7,)), KeySpec("head", (3, 3))])
META = PushMeta(job="lm", sender="zone-a", seq=42, base_version=1 << 40, view_epoch=0xABCDEF12345,
                contributors=5, clock_min=3, clock_max=9, incarnation=0x5EED,
                sources=(PushKey("w0", 7, 3, b"d" * 16), PushKey("w1", 8, 4, b"e" * 16)))


def _grad(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.numel).astype(np.float32)


def _chunks(codec: str = "fp32", chunk_elems: int = 64, seed: int = 0):
    return split(LAYOUT, _grad(seed), get_codec(codec), chunk_elems=chunk_elems)


def _chunk_header() -> pb.FrameHeader:
    return pb.FrameHeader(chunks=pb.ChunkBatch(chunks=[pb.TensorChunk(
        key="head", dtype=pb.DTYPE_FLOAT32, shape=[3, 3], offset=0, numel=9, codec=pb.CODEC_FP32,
        nbytes=36)]))


# ============================================================================ frames


def test_frame_round_trip_and_zero_copy_payload():
    payload = bytes(range(256)) * 3
    data = encode_frame(_chunk_header(), payload)
    header, got = decode_frame(data)
    assert header == _chunk_header()
    assert isinstance(got, memoryview) and bytes(got) == payload
    assert got.obj is data  # a slice of the received buffer, not a copy


@pytest.mark.parametrize("key", ["w", "k" * 40, "k" * 200])
@pytest.mark.parametrize("size", [4, 400, 70_000, 1 << 22])
def test_a_payload_starts_aligned_so_fp32_values_are_read_in_place(key, size):
    """Whatever the header's and the payload's lengths, the payload starts at a multiple of 16
    bytes into the frame, so fp32 values sliced from a received frame (a fresh bytes object)
    are aligned: numpy's unaligned path made the finiteness check of every arriving chunk ~20x
    slower (benchmarks/frame_align.py)."""
    header = pb.FrameHeader(chunks=pb.ChunkBatch(chunks=[pb.TensorChunk(
        key=key, dtype=pb.DTYPE_FLOAT32, shape=[size // 4], numel=size // 4, codec=pb.CODEC_FP32, nbytes=size)]))
    values = np.arange(size // 4, dtype=np.float32)
    data = bytes(bytearray(encode_frame(header, memoryview(values).cast("B"))))  # as gRPC hands it over
    got_header, payload = decode_frame(data)
    assert (len(data) - len(payload)) % 16 == 0
    got = np.frombuffer(payload, np.float32)
    assert got.flags.aligned and np.array_equal(got, values)
    assert got_header == header  # the padding is layout, not content
    assert pb.Frame.FromString(data).payload == values.tobytes()  # still a valid hps.v1.Frame


def test_frame_without_payload_has_an_empty_one():
    header, got = decode_frame(encode_frame(pb.FrameHeader(push=pb.PushHeader(job="lm", seq=1))))
    assert header.push.job == "lm" and len(got) == 0


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_384, 1 << 20])
def test_hand_written_frames_parse_with_the_generated_frame_message(size):
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    data = encode_frame(_chunk_header(), payload)
    frame = pb.Frame.FromString(data)
    assert len(frame.header.pad) <= 17 and not any(frame.header.pad)  # zeros that align the payload
    frame.header.ClearField("pad")
    assert frame.header == _chunk_header() and frame.payload == payload


@pytest.mark.parametrize("size", [0, 1, 200, 70_000])
def test_generated_frame_bytes_decode_by_hand(size):
    payload = b"\x5a" * size
    data = pb.Frame(header=_chunk_header(), payload=payload).SerializeToString()
    header, got = decode_frame(data)
    assert header == _chunk_header() and bytes(got) == payload


@pytest.mark.parametrize("data,match", [
    (b"", "0 bytes"),
    (b"\x0a", "1 bytes"),
    (b"hello world, not a frame", "header field"),
    (b"\x12\x00", "header field"),                       # payload field first
    (b"\x0a\x7f" + b"\x00" * 10, "overruns"),             # header length past the end
    (b"\x0a\xff\xff\xff\xff\x0f", "overruns"),            # a 4 GiB header in 6 bytes
    (b"\x0a" + b"\xff" * 11, "length prefix"),            # a varint that never ends
    (b"\x0a\x03\xff\xff\xff", "does not parse"),          # garbage header bytes
    (b"\x0a\x00", "no kind"),                             # an empty header
    (b"\x0a\x00\x12\x03abc", "no kind"),
    (b"\x0a\x02\x0a\x00\x1a\x00", "after the header"),    # a third field
    (b"\x0a\x02\x0a\x00\x12\x05abc", "payload says 5"),   # payload cut short
    (b"\x0a\x02\x0a\x00\x12\x01abc", "payload says 1"),   # trailing bytes
    (b"\x0a\x02\x0a\x00\x12", "length prefix"),           # payload length missing
], ids=lambda v: v if isinstance(v, str) else None)
def test_decode_frame_rejects_malformed_frames(data, match):
    with pytest.raises(BadInput, match=match):
        decode_frame(data)


def test_a_frame_with_no_kind_is_refused():
    with pytest.raises(BadInput, match="no kind"):
        decode_frame(encode_frame(pb.FrameHeader(), b"\x00" * 8))


def test_every_truncation_of_a_frame_is_refused_or_loses_only_the_payload():
    payload = _grad().tobytes()[:400]
    data = encode_frame(_chunk_header(), payload)
    header_len = data[1]  # the header as sent: its fields and the padding that aligns the payload
    assert header_len < 128  # one-byte length prefix
    header_end = 2 + header_len
    assert data[header_end] == 0x12 and (header_end + 3) % 16 == 0  # 0x12, a 2-byte length, payload
    for cut in range(len(data)):
        short = data[:cut]
        if cut == header_end:
            # Indistinguishable from a payload-less frame; the chunk's numel catches it later.
            assert len(decode_frame(short)[1]) == 0
            continue
        with pytest.raises(BadInput):
            decode_frame(short)


def test_random_bytes_only_ever_raise_bad_input():
    rng = np.random.default_rng(7)
    good = encode_frame(_chunk_header(), b"\x00" * 36)
    for i in range(3000):
        if i % 2:
            data = bytes(rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8))
            data = b"\x0a" + data if i % 4 == 1 else data
        else:  # a valid frame with a few random bytes changed
            buf = bytearray(good)
            for _ in range(int(rng.integers(1, 4))):
                buf[int(rng.integers(0, len(buf)))] = int(rng.integers(0, 256))
            data = bytes(buf)
        try:
            decode_frame(data)
        except BadInput:
            pass


# ============================================================================ push streams


@pytest.mark.parametrize("codec", ["fp32", "fp32+zstd"])
def test_push_round_trip(codec):
    chunks = _chunks(codec, chunk_elems=50)
    frames = encode_push(META, chunks)
    # Small chunks are packed: one header frame, one frame for all of them, the end marker.
    assert len(frames) == 3 and all(isinstance(f, bytes) for f in frames)
    meta, got, digest = decode_push(frames)
    assert len(digest) == 16
    assert meta == META
    assert len(got) == len(chunks)
    for a, b in zip(chunks, got):
        assert (b.key, b.shape, b.dtype, b.offset, b.numel, b.codec) == \
               (a.key, a.shape, a.dtype, a.offset, a.numel, a.codec)
        assert isinstance(b.payload, memoryview) and b.payload == a.payload
        assert b.payload.obj is frames[1]  # zero-copy: a slice of the received frame
    grad = assemble(LAYOUT, got, what="push", require_all=True)
    assert grad.tobytes() == _grad().tobytes()


@pytest.mark.parametrize("codec", ["fp32", "fp32+zstd"])
def test_a_relay_re_encodes_decoded_chunks_verbatim(codec):
    """Relays forward what they received: decode then encode gives the same bytes."""
    frames = encode_push(META, _chunks(codec, chunk_elems=40, seed=3))
    meta, chunks, _ = decode_push(frames)
    assert encode_push(meta, chunks) == frames
    pull = PullMeta(9, 1, 2, False, 9)
    reply = list(encode_pull_reply(pull, [(VersionMeta(2, 5), chunks)]))
    got_meta, versions = decode_pull_reply(reply)
    assert list(encode_pull_reply(got_meta, versions)) == reply


@pytest.mark.parametrize("meta,have,why", [
    (PullMeta(9, 0, 4, True, 9), [], "a snapshot with no version"),
    (PullMeta(9, 0, 4, True, 9), [3], "a snapshot of another version than named"),
    (PullMeta(9, 1, 4, False, 9), [2, 3], "deltas short of the version named (a stream cut at a version)"),
    (PullMeta(9, 1, 4, False, 9), [2, 4, 4], "a version twice, one missing"),
    (PullMeta(9, 1, 1 << 62, False, 9), [2], "a range no reply could carry"),
])
def test_a_pull_reply_that_is_not_what_its_header_names_is_refused(meta, have, why):
    """A snapshot with no version made the replica raise IndexError (a relay's follow loop died
    silently); deltas short of their end were applied as far as they went."""
    chunks = _chunks("fp32")
    reply = list(encode_pull_reply(meta, [(VersionMeta(v, 5), chunks) for v in have]))
    with pytest.raises(BadInput, match="malformed pull reply"):
        decode_pull_reply(reply)


def test_push_with_no_chunks():
    meta, chunks, _ = decode_push(encode_push(META, []))
    assert meta == META and chunks == []


def test_decode_push_rejects_a_stream_not_opened_by_a_push_header():
    frames = encode_push(META, _chunks())
    with pytest.raises(BadInput, match="first frame is 'chunks'"):
        decode_push(frames[1:])
    pull = encode_frame(pb.FrameHeader(pull=pb.PullHeader(to_version=3)))
    with pytest.raises(BadInput, match="push header"):
        decode_push([pull] + frames[1:])


def test_decode_push_rejects_an_empty_stream():
    with pytest.raises(BadInput, match="after 0 frames without its end marker"):
        decode_push([])
    with pytest.raises(BadInput, match="after 0 frames without its end marker"):
        decode_push(iter(()))


@pytest.fixture
def small_frames(monkeypatch):
    """Frames of at most 64 payload bytes, so a small push spans many."""
    import ps.net.wire
    monkeypatch.setattr(ps.net.wire, "MAX_FRAME_PAYLOAD", 64)


def test_a_push_cut_anywhere_before_its_end_marker_is_refused(small_frames):
    """Invariant 7: grpc.aio ends a cancelled, timed-out or disconnected stream like a finished
    one; without the end marker, a prefix of a push would pass for a whole push."""
    frames = encode_push(META, _chunks(chunk_elems=8))
    assert len(frames) > 3
    for k in range(len(frames)):
        with pytest.raises(BadInput, match=f"after {k} frames without its end marker"):
            decode_push(frames[:k])
    decode_push(frames)  # whole: fine


def test_an_end_marker_that_does_not_match_what_arrived_is_refused(small_frames):
    frames = encode_push(META, _chunks(chunk_elems=8))
    with pytest.raises(BadInput, match="end marker counts"):
        decode_push(frames[:2] + frames[3:])  # a chunk frame lost in the middle
    other = encode_push(META, _chunks(chunk_elems=8, seed=1))
    with pytest.raises(BadInput, match="digest differs"):
        decode_push(frames[:-1] + other[-1:])  # same counts, another body
    with pytest.raises(BadInput, match="after the stream's end marker"):
        decode_push(frames + frames[1:2])


def test_the_digest_identifies_the_body():
    a = decode_push(encode_push(META, _chunks(seed=1)))[2]
    assert decode_push(encode_push(META, _chunks(seed=1)))[2] == a  # a retry: the same bytes
    assert decode_push(encode_push(META, _chunks(seed=2)))[2] != a
    from dataclasses import replace
    assert decode_push(encode_push(replace(META, seq=43), _chunks(seed=1)))[2] != a
    reader = BodyReader("push", "push")
    for f in encode_push(META, _chunks(seed=1)):
        reader.feed(f)
    assert reader.finish() == a


def test_a_resend_is_the_same_push_and_says_so_in_its_end_marker(small_frames):
    """A push sent again after its answer was lost carries, outside the digest, the tier
    incarnation its earlier copies went to: the receiving tier still knows it as the same push,
    and learns whether another incarnation may have placed it (it then asks the root first).
    A body cut before its end marker passes as it is: cut."""
    frames = encode_push(META, _chunks(chunk_elems=8))
    marked = list(as_resend(frames, 0xE90C))
    assert marked[:-1] == frames[:-1] and marked[-1] != frames[-1]

    def read(body: list[bytes]) -> BodyReader:
        reader = BodyReader("push", "push")
        for f in body:
            reader.feed(f)
        return reader
    plain, again = read(frames), read(marked)
    assert again.finish() == plain.finish() == decode_push(marked)[2]
    assert (again.resend_to, plain.resend_to) == (0xE90C, 0)
    assert list(as_resend(frames[:-1], 0xE90C)) == frames[:-1]
    with pytest.raises(BadInput, match="without its end marker"):
        read(list(as_resend(frames[:-1], 0xE90C))).finish()
    with pytest.raises(ValueError, match="names the incarnation"):
        list(as_resend(frames, 0))


def test_decode_push_rejects_a_second_header_and_bad_frames():
    frames = encode_push(META, _chunks())
    with pytest.raises(BadInput, match="frame 2 is 'push'"):
        decode_push(frames[:2] + [frames[0]] + frames[2:])
    with pytest.raises(BadInput):
        decode_push([frames[0], frames[1][:-1]])  # one truncated chunk frame


def test_unknown_enum_values_in_a_chunk_are_bad_input():
    h = _chunk_header()
    h.chunks.chunks[0].codec = 99  # a codec from a newer peer
    with pytest.raises(BadInput, match="codec enum value 99"):
        decode_push(_with_chunk_frame(h))
    h = _chunk_header()
    h.chunks.chunks[0].dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(BadInput, match="dtype"):
        decode_push(_with_chunk_frame(h))


def _with_chunk_frame(h) -> list[bytes]:
    """A push stream with one hand-made chunk frame before its end marker."""
    head, end = encode_push(META, [])
    return [head, encode_frame(h, b"\x00" * 36), end]


def test_a_chunk_frame_truncated_at_its_header_is_refused():
    frames = encode_push(META, _chunks(chunk_elems=64))
    h = pb.Frame.FromString(frames[1]).header
    frames[1] = encode_frame(h)  # payload lost entirely: the batch's byte counts do not add up
    with pytest.raises(BadInput, match="bytes past"):
        decode_push(frames)


def test_large_chunks_are_spread_over_frames_of_at_most_4_mib():
    from ps.net.frames import MAX_FRAME_PAYLOAD

    big = Layout([KeySpec("a", (3 << 20,)), KeySpec("b", (5,))])
    flat = np.arange(big.numel, dtype=np.float32)
    frames = encode_push(META, split(big, flat, get_codec("fp32")))
    assert len(frames) == 6  # header, three full 4 MiB frames of a, then b (it would overflow), end
    assert all(len(pb.Frame.FromString(f).payload) <= MAX_FRAME_PAYLOAD for f in frames)
    _, chunks, _ = decode_push(frames)
    assert assemble(big, chunks, what="push", require_all=True).tobytes() == flat.tobytes()


def test_mutated_push_streams_only_ever_raise_bad_input():
    rng = np.random.default_rng(11)
    frames = encode_push(META, _chunks(chunk_elems=32))
    for _ in range(1500):
        mutated = list(frames)
        i = int(rng.integers(0, len(mutated)))
        buf = bytearray(mutated[i])
        j = int(rng.integers(0, min(len(buf), 48)))  # mostly headers: payloads are opaque
        buf[j] = int(rng.integers(0, 256))
        mutated[i] = bytes(buf)
        try:
            _, chunks, _ = decode_push(mutated)
            assemble(LAYOUT, chunks, what="push")
        except BadInput:
            pass


# ============================================================================ pull replies


def test_pull_reply_round_trip():
    """Checksums are XXH3-64: all 64 bits survive the wire (the field was a uint32 once)."""
    meta = PullMeta(view_epoch=5, from_version=3, to_version=5, snapshot=False, server_epoch=5)
    versions = [(VersionMeta(4, 0xFEDCBA9876543210, clock_min=2, contributors=3), _chunks(seed=1)),
                (VersionMeta(5, 17), [])]
    got_meta, got = decode_pull_reply(list(encode_pull_reply(meta, versions)))
    assert got_meta == meta
    assert [vm for vm, _ in got] == [vm for vm, _ in versions]
    assert [bytes(c.payload) for c in got[0][1]] == [bytes(c.payload) for c in versions[0][1]]
    assert got[1][1] == []


def test_pull_reply_refuses_a_chunk_before_any_version():
    meta = PullMeta(1, 0, 1, True, 1)
    frames = list(encode_pull_reply(meta, [(VersionMeta(1, 0), _chunks())]))
    with pytest.raises(BadInput, match="position 1"):
        decode_pull_reply([frames[0]] + frames[2:])
    with pytest.raises(BadInput, match="first frame"):
        decode_pull_reply(frames[1:])
    with pytest.raises(BadInput, match="empty"):
        decode_pull_reply([])


# ============================================================================ jobs and layouts


def test_job_config_round_trips_through_protobuf():
    cfg = JobConfig(
        name="lm-2.b_x", mode="ssp", staleness=3,
        optimizer=OptimizerConfig(kind="adam", lr=3e-4, momentum=0.5, weight_decay=0.01, beta1=0.85,
                                  beta2=0.995, eps=1e-7, warmup_steps=250),
        push_codec="fp32+zstd", delta_codec="fp32+zstd", delta_log_length=17)
    assert cfg != JobConfig(name="lm-2.b_x")
    m = job_to_pb(cfg)
    assert job_from_pb(pb.JobConfig.FromString(m.SerializeToString())) == cfg
    sgd = JobConfig(name="s", optimizer=OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9, nesterov=True))
    assert job_from_pb(job_to_pb(sgd)) == sgd
    dgc = JobConfig(name="d", push_codec="topk", relay_codec="sign", delta_codec="int8", topk=0.003,
                    topk_warmup_steps=400, momentum_correction=True,
                    optimizer=OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9))
    assert job_from_pb(pb.JobConfig.FromString(job_to_pb(dgc).SerializeToString())) == dgc
    rows = JobConfig(name="r", push_codec="rows")
    assert job_from_pb(job_to_pb(rows)) == rows and job_to_pb(rows).relay_codec == pb.CODEC_UNSPECIFIED


def test_torch_optimizer_configs_round_trip_exactly():
    from ps.core.config import ParamGroup

    configs = [
        OptimizerConfig(kind="AdamW", lr=3e-4, beta2=0.95, warmup_steps=7, clip_grad_norm=1.25,
                        options=(("amsgrad", True), ("eps", 1e-7)),
                        groups=(ParamGroup(("*.bias", "*norm*"), (("weight_decay", 0.0),)),
                                ParamGroup(("emb.*",), (("lr", 1e-4), ("betas", (0.8, 0.9)))))),
        OptimizerConfig(kind="rmsprop", lr=0.01, momentum=0.5, options=(("alpha", 0.9), ("centered", True))),
        OptimizerConfig(kind="rprop", options=(("etas", (0.4, 1.3)), ("step_sizes", (1e-6, 50)))),
        OptimizerConfig(kind="adagrad", options=(("lr_decay", 0.001), ("initial_accumulator_value", 1))),
    ]
    for o in configs:
        cfg = JobConfig(name="t", optimizer=o)
        back = job_from_pb(pb.JobConfig.FromString(job_to_pb(cfg).SerializeToString()))
        assert back == cfg and hash(back) == hash(cfg)
        assert [type(v) for _, v in back.optimizer.options] == [type(v) for _, v in o.options]
    assert job_to_pb(JobConfig(name="t", optimizer=configs[0])).optimizer.kind == pb.OPTIMIZER_UNSPECIFIED
    assert job_to_pb(JobConfig(name="t")).optimizer.kind == pb.OPTIMIZER_SGD  # what older peers read
    m = job_to_pb(JobConfig(name="t", optimizer=configs[1]))
    m.optimizer.options.add(name="alpha")  # no value: refused with a sentence
    with pytest.raises(BadInput, match="no value"):
        job_from_pb(m)
    m = job_to_pb(JobConfig(name="t", optimizer=configs[1]))
    m.optimizer.options.add(name="momentom", real=0.9)
    with pytest.raises(BadInput, match="momentom"):
        job_from_pb(m)
    m = job_to_pb(JobConfig(name="t", optimizer=configs[1]))
    for i in range(100):
        m.optimizer.groups.add(match=[f"k{i}"])
    with pytest.raises(BadInput, match="too large"):
        job_from_pb(m)


def test_job_from_pb_refuses_unspecified_values():
    # No mode: the message only names the job, to adopt its declared configuration.
    assert job_from_pb(pb.JobConfig(name="lm")) is None
    with pytest.raises(BadInput, match="name"):
        job_from_pb(pb.JobConfig())
    m = job_to_pb(JobConfig(name="lm"))
    m.delta_log_length = 0  # an old peer that never set it: the config validation names it
    with pytest.raises(BadInput, match="delta_log_length"):
        job_from_pb(m)


def test_layout_and_create_job_round_trip():
    assert layout_from_pb(layout_to_pb(LAYOUT)) == LAYOUT
    cfg = JobConfig(name="lm", push_codec="fp32+zstd")
    got_cfg, got_layout, chunks = decode_create_job(encode_create_job(cfg, LAYOUT, _chunks(seed=2)))
    assert got_cfg == cfg and got_layout == LAYOUT
    init = assemble(got_layout, chunks, what="initial values", require_all=True)
    assert init.tobytes() == _grad(2).tobytes()
    with pytest.raises(BadInput):
        decode_create_job(encode_push(META, []))


def test_a_pushs_step_information_round_trips_and_bad_ones_are_refused():
    from ps.core.types import StepInfo
    from ps.net.wire import pb, step_from_pb, step_to_pb
    step = StepInfo(hparams=((0, "lr", 0.05), (1, "betas_0", 0.9)), absent=(1, 4), skip=True, buffers=2,
                    progress=((3, 7, 128),))
    meta = PushMeta(job="lm", sender="w0", seq=1, base_version=0, step=step)
    chunks = split(Layout([KeySpec("w", (3,))]), np.ones(3, np.float32), get_codec("fp32"))
    got, _, _ = decode_push(encode_push(meta, chunks))
    assert got.step == step
    assert decode_push(encode_push(PushMeta(job="lm", sender="w0", seq=1, base_version=0), chunks))[0].step.empty
    assert step_to_pb(StepInfo()) is None  # an empty step costs no bytes
    for bad, match in [
        (pb.StepInfo(hparams=[pb.HParam(group=0, name="lr", value=float("nan"))]), "finite"),
        (pb.StepInfo(hparams=[pb.HParam(group=0, name="l r", value=0.1)]), "identifiers"),
        (pb.StepInfo(hparams=[pb.HParam(group=0, name="lr", value=0.1)] * 2), "twice"),
        (pb.StepInfo(absent=[3, 1]), "increasing"),
        (pb.StepInfo(progress=[pb.ShardProgress()] * 5000), "at most"),
    ]:
        with pytest.raises(BadInput, match=match):
            step_from_pb(bad)


def test_step_information_merges_as_contributions_are_summed():
    from ps.core.types import StepInfo
    a = StepInfo(hparams=((0, "lr", 0.1),), absent=(0, 2), buffers=1, progress=((0, 1, 8),))
    b = StepInfo(hparams=((0, "lr", 0.1),), absent=(2,), skip=True, progress=((0, 2, 16),))
    m = a.merge(b)
    assert m.absent == (2,) and m.skip and m.buffers == 1 and m.progress == ((0, 1, 8), (0, 2, 16))
    assert a.agrees(b) == "" and "0.05" in a.agrees(StepInfo(hparams=((0, "lr", 0.05),)))
    older = StepInfo(hparams=((0, "lr", 0.2),))
    assert a.merge(older, other_newer=False).hparams == a.hparams   # windows keep the newest clock's


def test_a_streamed_pushs_tail_replaces_its_late_fields_and_is_digested():
    """A push opened before its gradient was complete (backward overlap) carries its step
    information and telemetry in a tail frame just before the end marker."""
    from dataclasses import replace

    from ps.core.types import StepInfo
    from ps.net.frames import with_end
    from ps.net.wire import chunk_frames, encode_push_head, encode_push_tail
    late = replace(META, loss_sum=2.5, loss_count=2, step_seconds_sum=0.4,
                   step=StepInfo(hparams=((0, "lr", 0.05),), absent=(1,), skip=True))
    body = [encode_push_head(META), *chunk_frames(_chunks())]
    meta, chunks, digest = decode_push(with_end([*body, encode_push_tail(late)]))
    assert meta == late and len(chunks) == len(_chunks())
    other = decode_push(with_end([*body, encode_push_tail(replace(late, loss_sum=3.0))]))[2]
    assert other != digest  # the tail is part of the push's identity
    tail = encode_push_tail(late)
    for frames, match in [
        ([encode_push_head(META), tail, *body[1:]], "after the tail frame"),   # chunks after it
        ([*body, tail, tail], "after the tail frame"),                          # two of them
        ([tail, *body[1:]], "first frame is 'tail'"),                           # instead of the header
    ]:
        with pytest.raises(BadInput, match=match):
            decode_push(with_end(frames))
    with pytest.raises(BadInput, match="without its end marker"):
        decode_push([*body, tail])  # cut after the tail: still not whole
    with pytest.raises(BadInput, match="carries 3 payload bytes"):
        decode_push(with_end([*body, encode_frame(pb.FrameHeader(tail=pb.PushTail()), b"abc")]))
    reader = BodyReader("job", "create-job stream")  # only pushes have tails
    reader.feed(encode_frame(pb.FrameHeader(job=pb.JobHeader())))
    with pytest.raises(BadInput, match="is 'tail'"):
        reader.feed(tail)


def test_a_relay_serves_the_frames_it_received_verbatim_and_reframes_anything_else(small_frames):
    """Deltas a relay pulled are served to its children as the very frames that brought them
    (no copy per child); chunks that are only part of a received frame, reordered, or made
    here are framed afresh, and every reply decodes to the same chunks."""
    pull = PullMeta(9, 1, 2, False, 9)
    sent = list(encode_pull_reply(pull, [(VersionMeta(2, 5), _chunks(chunk_elems=8, seed=4))]))
    assert len(sent) > 3
    meta, versions = decode_pull_reply(sent)
    served = list(encode_pull_reply(meta, versions))
    assert served == sent and all(a is b for a, b in zip(served[2:], sent[2:]))  # chunk frames: the same objects
    (vm, chunks), = versions
    for variant in (chunks[1:], chunks[::-1], [*chunks[:3], *_chunks(chunk_elems=8, seed=5)[3:]]):
        again = list(encode_pull_reply(meta, [(vm, variant)]))
        got = decode_pull_reply(again)[1][0][1]
        assert [(c.key, c.offset, bytes(c.payload)) for c in got] == [(c.key, c.offset, bytes(c.payload))
                                                                          for c in variant]
    # Chunk 0 described right but holding chunk 1's bytes of the same frame: reframed, as sent.
    from dataclasses import replace
    c0, c1 = chunks[0], chunks[1]
    assert c0.payload.obj is c1.payload.obj and len(c0.payload) == len(c1.payload)  # one frame, two chunks
    wrong = [replace(c0, payload=c1.payload), c1]
    frames = list(encode_pull_reply(meta, [(vm, wrong)]))
    assert frames[2] is not c0.payload.obj
    assert bytes(decode_pull_reply(frames)[1][0][1][0].payload) == bytes(c1.payload)


def test_chunks_framed_once_are_served_as_those_frames(small_frames):
    """framed(): a tier frames a version once when it publishes it; every pull then sends
    those frames, the same objects each time, and they decode to the chunks framed."""
    from ps.net.wire import framed
    chunks = _chunks(chunk_elems=8, seed=6)
    kept = framed(chunks)
    assert [(c.key, c.offset, c.numel, bytes(c.payload)) for c in kept] == \
           [(c.key, c.offset, c.numel, bytes(c.payload)) for c in chunks]
    pull = PullMeta(9, 1, 2, False, 9)
    one = list(encode_pull_reply(pull, [(VersionMeta(2, 5), kept)]))
    two = list(encode_pull_reply(pull, [(VersionMeta(2, 5), kept)]))
    assert all(a is b for a, b in zip(one[2:], two[2:]))
    assert decode_pull_reply(one)[1][0][1][0].key == chunks[0].key
