"""Codec properties (pure): lossless ones exact, lossy ones bounded, error feedback conserves
the sum, top-k selects the true top k, malformed payloads are refused with BadInput."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ps.core.codecs import CODEC_NAMES, ErrorFeedback, dgc_density, get_codec
from ps.core.codecs.topk import SMALL, select
from ps.core.encoder import Encoder, input_print, row_sparse_keys
from ps.core.errors import BadInput
from ps.core.tensors import assemble
from ps.core.view import KeySpec, Layout

LOSSY = ["fp16", "bf16", "int8", "int4", "topk", "sign"]
# derandomize: the same examples on every run, so CI is repeatable (a new seed explores anew).
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

finite = arrays(np.float32, st.integers(1, 3000),
                elements=st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False))


def _rt(name, x, **opt):
    codec = get_codec(name, **opt)
    payload = codec.encode(x)
    return get_codec(name).decode(memoryview(payload), x.size), payload  # the receiver's instance


# ---------------------------------------------------------------------------- bounds


@SETTINGS
@given(finite)
def test_fp16_error_is_within_half_an_ulp_of_float16_behind_its_scale(x):
    y, _ = _rt("fp16", x)
    amax = float(np.abs(x).max())
    # Relative 2**-11 in the normal range; below it float16's subnormal step, relative to amax;
    # and the scale is clamped at 2**100, so below 2**-124 values may flush to zero.
    assert np.all(np.abs(y - x) <= 2.0 ** -11 * np.abs(x) + amax * 2.0 ** -24 + 2.0 ** -124)


@SETTINGS
@given(finite)
def test_bf16_error_is_within_half_an_ulp_of_bfloat16(x):
    y, _ = _rt("bf16", x)
    # relative 2**-8; below bfloat16's smallest subnormal step (2**-133) absolute
    assert np.all(np.abs(y - x) <= 2.0 ** -8 * np.abs(x) + 2.0 ** -133)


# (codec, largest level, payload bytes of n elements after the header and the scales)
QUANTIZED = [("int8", 127, lambda n: n), ("int4", 7, lambda n: (n + 1) // 2)]


@pytest.mark.parametrize("name, top, body", QUANTIZED, ids=[q[0] for q in QUANTIZED])
@SETTINGS
@given(x=finite, chunk=st.integers(1, 600))
def test_quantized_error_is_below_one_level_of_its_chunk(name, top, body, x, chunk):
    y, payload = _rt(name, x, chunk=chunk)
    for i in range(0, x.size, chunk):
        xs, ys = x[i:i + chunk], y[i:i + chunk]
        step = np.float32(np.abs(xs).max()) / np.float32(top)
        assert np.all(np.abs(ys - xs) <= step * (1 + 1e-5) + 1e-30)
        # every value is one of the chunk's 2 * top + 1 levels
        levels = ys / step if step else ys
        assert np.allclose(levels, np.round(levels), atol=1e-4) and np.abs(levels).max() <= top + 1e-4
    assert len(payload) == 16 + 4 * -(-x.size // chunk) + body(x.size)


@pytest.mark.parametrize("name, chunk, reps, within", [("int8", 4096, 50, 0.002), ("int4", 1024, 200, 0.005)])
def test_quantized_rounding_is_unbiased(name, chunk, reps, within):
    x = np.full(chunk, 0.3, np.float32)
    x[0] = 1.0  # int8: 0.3 * 127 = 38.1 rounds to 38 or 39; int4: 0.3 * 7 = 2.1 to 2 or 3
    codec = get_codec(name, seed=3)
    mean = np.mean([codec.decode(codec.encode(x), x.size)[1:].mean() for _ in range(reps)])
    # floor would be 0.26% low (38/127) for int8, 4.8% (2/7) for int4
    assert abs(mean - 0.3) < 0.3 * within


def test_int4_nibbles_go_low_first_and_any_nibble_decodes_finite():
    codec = get_codec("int4", chunk=4)
    x = np.array([7, -7, 0, 7, -7], np.float32)  # exact levels: no rounding, scale 1
    payload = codec.encode(x)
    assert payload[16 + 8:] == bytes([(1 << 4) | 15, (15 << 4) | 8, 1 | (8 << 4)])
    assert codec.decode(payload, x.size).tolist() == x.tolist()
    # a nibble of 0 (level -8) is never written; a decoder reads it as -8 times the scale
    hostile = bytearray(payload)
    hostile[16 + 8] = 0
    assert codec.decode(bytes(hostile), x.size).tolist()[:2] == [-8.0, -8.0]


@SETTINGS
@given(finite)
def test_sign_sends_the_mean_magnitude_with_each_sign(x):
    y, payload = _rt("sign", x)
    scale = np.float32(np.abs(x).astype(np.float64).mean())
    assert np.allclose(np.abs(y), scale, rtol=1e-3)  # a float32 sum of |x| on the sender
    assert np.all((y >= 0) == (x >= 0))
    assert len(payload) == 16 + (x.size + 7) // 8


@SETTINGS
@given(finite, st.floats(0.001, 1.0))
def test_topk_keeps_exactly_the_largest_magnitudes(x, k):
    y, _ = _rt("topk", x, k=k)
    count = min(x.size, max(1, round(k * x.size)))
    kept = np.flatnonzero(y)
    assert len(kept) <= count
    if len(kept):  # every dropped element is no larger than every kept one
        dropped = np.setdiff1d(np.arange(x.size), kept)
        if dropped.size:
            assert np.abs(x[dropped]).max() <= np.abs(x[kept]).min()
    # values travel as float16 behind a power-of-two scale
    amax = float(np.abs(x).max()) if x.size else 0.0
    assert np.all(np.abs(y[kept] - x[kept]) <= 2.0 ** -11 * np.abs(x[kept]) + amax * 2.0 ** -24)


@pytest.mark.parametrize("n", [SMALL + 1, 1 << 20, 3_000_017])
def test_sampled_topk_selection_matches_torch_topk(n):
    """The sampled threshold (used above SMALL elements) finds the same set as a full topk."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    k = n // 100
    idx = select(x, k, torch.Generator().manual_seed(1))
    want = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(idx, want)


@SETTINGS
@given(arrays(np.float32, st.tuples(st.integers(1, 40), st.integers(1, 17)),
              elements=st.sampled_from([0.0, 0.0, 0.0, 1.5, -2.25, 3e-30, 7e20])))
def test_rows_is_exact_and_sends_only_non_zero_rows(table):
    width = table.shape[1]
    y, payload = _rt("rows", table.reshape(-1), width=width)
    assert np.array_equal(y, table.reshape(-1))
    nz = int((table != 0).any(axis=1).sum())
    assert len(payload) >= 4 * width * nz and len(payload) < 24 + 4 + 64 + 4 * width * nz + 8 * table.shape[0]


def test_lossless_codecs_are_exact_on_every_value():
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32) * 1e3
    for name in [n for n in CODEC_NAMES if get_codec(n).lossless]:
        y, _ = _rt(name, x)
        assert np.array_equal(y, x), name


# ---------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name", LOSSY)
def test_error_feedback_conserves_the_sum(name):
    """sum(inputs) == sum(decoded) + residual: nothing is lost, only delayed."""
    rng = np.random.default_rng(1)
    codec = get_codec(name, k=0.05) if name == "topk" else get_codec(name)
    ef = ErrorFeedback()
    sent = np.zeros(20_000, np.float64)
    total = np.zeros(20_000, np.float64)
    for _ in range(30):
        g = rng.standard_normal(20_000).astype(np.float32)
        total += g
        sent += get_codec(name).decode(ef.encode("w", codec, g), g.size)
    residual = ef.residuals["w"].numpy().astype(np.float64)
    assert np.allclose(sent + residual, total, atol=1e-3, rtol=1e-5)
    # ... and error feedback is what keeps the residual bounded (it does not grow with steps)
    assert np.abs(residual).max() < 30 * np.abs(total).max()


def test_without_error_feedback_topk_loses_what_it_drops():
    """The control for the test above: plain top-k drops mass for good."""
    g = np.random.default_rng(2).standard_normal(10_000).astype(np.float32)
    codec = get_codec("topk", k=0.01)
    sent = sum(codec.decode(codec.encode(g), g.size).astype(np.float64) for _ in range(10))
    assert not np.allclose(sent, 10 * g.astype(np.float64), atol=1e-3)


def test_error_feedback_state_round_trips_and_continues_identically():
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(3000).astype(np.float32) for _ in range(6)]
    a, b = ErrorFeedback(), ErrorFeedback()
    codec = get_codec("sign")
    for g in grads[:3]:
        a.encode("w", codec, g)
    b.load_state_dict(a.state_dict())
    for g in grads[3:]:
        assert a.encode("w", codec, g) == b.encode("w", codec, g)


def test_error_feedback_refuses_a_residual_of_another_size():
    ef = ErrorFeedback()
    ef.encode("w", get_codec("fp16"), np.ones(10, np.float32))
    with pytest.raises(BadInput, match="reset"):
        ef.encode("w", get_codec("fp16"), np.ones(11, np.float32))


def test_dgc_density_warm_up():
    assert dgc_density(0, 0.01, 100) == 0.25
    ks = [dgc_density(s, 0.01, 100) for s in range(0, 120, 10)]
    assert ks == sorted(ks, reverse=True) and ks[-1] == 0.01 and min(ks) == 0.01
    with pytest.raises(BadInput):
        dgc_density(0, 0.0, 100)


# ---------------------------------------------------------------------------- the Encoder

LAYOUT = Layout([KeySpec("emb", (1000, 16)), KeySpec("w", (64, 64)), KeySpec("b", (64,))])


def test_encoder_sends_row_sparse_keys_as_rows_with_a_lossless_codec():
    g = np.random.default_rng(4).standard_normal(LAYOUT.numel).astype(np.float32)
    g[: 1000 * 16] = 0
    g[16 * 5: 16 * 6] = 1.0  # one embedding row touched
    assert row_sparse_keys(LAYOUT, g) == {"emb"}
    chunks = Encoder("fp32").split(LAYOUT, g)
    assert [c.codec for c in chunks] == ["rows", "fp32", "fp32"]
    assert len(chunks[0].payload) < 200  # one row of 16 floats, not 64 KB
    assert np.array_equal(assemble(LAYOUT, chunks, "t"), g)


def test_row_keys_of_every_size_go_up_lossless():
    """A key of no elements, a row wider than a frame (a (1, 2**21) position embedding), and a
    table past 2**24 rows (its row probe was float32: it indexed one row past the end)."""
    layout = Layout([KeySpec("w", (4, 3)), KeySpec("empty", (5, 0)), KeySpec("pos", (1, 2**21))])
    g = np.random.default_rng(6).standard_normal(layout.numel).astype(np.float32)
    for codec in ("fp32", "rows"):
        assert np.array_equal(assemble(layout, Encoder(codec).split(layout, g), "t"), g), codec
    big = Layout([KeySpec("emb", (16777220, 2))])
    assert row_sparse_keys(big, torch.zeros(big.numel)) == {"emb"}
    assert row_sparse_keys(big, np.zeros(big.numel, np.float32)) == {"emb"}


def test_encoder_density_follows_the_warm_up_and_residuals_persist():
    enc = Encoder("topk", topk=0.01, warmup_steps=100, seed="w0")
    g = np.random.default_rng(5).standard_normal(LAYOUT.numel).astype(np.float32)
    early = sum(len(c.payload) for c in enc.split(LAYOUT, g, step=0))
    late = sum(len(c.payload) for c in enc.split(LAYOUT, g, step=100))
    assert early > 5 * late
    state = enc.state_dict()
    assert set(state) == {"emb@0", "w@0", "b@0"}
    other = Encoder("topk", topk=0.01, warmup_steps=100, seed="w0")
    other.load_state_dict(state)
    assert [c.payload for c in other.split(LAYOUT, g, 200)] == [c.payload for c in enc.split(LAYOUT, g, 200)]


def test_encoders_of_different_senders_round_differently():
    g = np.full(LAYOUT.numel, 0.3, np.float32)
    g[::4096] = 1.0
    a = Encoder("int8", seed="w0").split(LAYOUT, g)
    b = Encoder("int8", seed="w1").split(LAYOUT, g)
    assert [c.payload for c in a] != [c.payload for c in b]


def test_encoder_takes_torch_tensors_and_leaves_them_unchanged():
    g = torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(6))
    before = g.clone()
    chunks = Encoder("topk", topk=0.05).split(LAYOUT, g)
    assert torch.equal(g, before)
    assert np.count_nonzero(assemble(LAYOUT, chunks, "t")) <= 0.05 * LAYOUT.numel + 3


def test_an_encoder_used_from_several_threads_still_conserves_the_sum():
    """async senders encode several pushes at once from threads: error feedback must still
    send every bit of gradient mass exactly once (sent + residual == pushed)."""
    import threading

    enc = Encoder("topk", topk=0.01, seed="w0")
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(LAYOUT.numel).astype(np.float32) for _ in range(48)]
    sent = [None] * len(grads)

    def work(i0: int) -> None:
        for i in range(i0, len(grads), 4):
            sent[i] = assemble(LAYOUT, enc.split(LAYOUT, grads[i]), "t")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    residual = np.concatenate([enc.state_dict()[f"{s.key}@0"] for s in LAYOUT])
    total = np.sum(grads, axis=0, dtype=np.float64)
    assert np.allclose(np.sum(sent, axis=0, dtype=np.float64) + residual, total, atol=1e-3)


# ---------------------------------------------------------------------------- malformed input


def _payload(name):
    x = np.random.default_rng(7).standard_normal(999).astype(np.float32)
    x[100:200] = 0
    opts = {"rows": dict(width=9), "topk": dict(k=0.1)}.get(name, {})
    return get_codec(name, **opts).encode(x), x.size


@pytest.mark.parametrize("name", LOSSY + ["rows"])
@SETTINGS
@given(cut=st.integers(0, 10_000))
def test_truncated_payloads_are_bad_input(name, cut):
    payload, n = _payload(name)
    cut = cut % len(payload)
    with pytest.raises(BadInput):
        get_codec(name).decode(payload[:cut], n)


@pytest.mark.parametrize("name", LOSSY + ["rows"])
@SETTINGS
@given(pos=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_corrupted_payloads_decode_to_the_right_size_or_are_bad_input(name, pos, byte):
    payload, n = _payload(name)
    damaged = bytearray(payload)
    damaged[pos % len(damaged)] = byte
    try:
        y = get_codec(name).decode(bytes(damaged), n)
    except BadInput:
        return
    assert y.dtype == np.float32 and y.shape == (n,)


@pytest.mark.parametrize("name", LOSSY + ["rows"])
def test_a_payload_for_another_size_is_bad_input(name):
    payload, n = _payload(name)
    with pytest.raises(BadInput):
        get_codec(name).decode(payload, n + 9)


def _zstd_header(size: int) -> bytes:
    """A zstd frame that declares ``size`` bytes and holds none (magic, 8-byte content size,
    single segment, then one empty last raw block)."""
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, size) + b"\x01\x00\x00"


def test_a_tiny_payload_claiming_a_huge_size_is_refused_before_anything_is_allocated():
    """Found by the decoder fuzzer: both raised MemoryError (the decompressor allocated what the
    frame claimed, or max_output_size when it claimed nothing) instead of BadInput."""
    numel = 1 << 40
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 16)
    with pytest.raises(BadInput, match="cannot decompress to"):
        get_codec("fp32+zstd").decode(unsized, numel)
    with pytest.raises(BadInput, match="does not declare its size"):
        get_codec("fp32+zstd").decode(unsized, 4)  # the size is required, however small
    with pytest.raises(BadInput, match="cannot decompress to"):
        get_codec("fp32+zstd").decode(_zstd_header(4 * numel), numel)
    count = 1 << 38
    topk = struct.pack("<Bxh4xQQ", 1, 0, count, numel) + _zstd_header(6 * count)
    with pytest.raises(BadInput, match="cannot decompress to"):
        get_codec("topk").decode(topk, numel)
    # A frame that can hold what it declares is still read, and must then hold it.
    with pytest.raises(BadInput, match="does not decompress"):
        get_codec("fp32+zstd").decode(_zstd_header(4096), 1024)


def test_unknown_codec_options_are_refused_naming_them():
    with pytest.raises(BadInput, match="'q'"):
        get_codec("topk", q=1)
    with pytest.raises(BadInput, match="k=2"):
        get_codec("topk", k=2)


def test_momentum_correction_sparsifies_the_velocity_and_masks_what_it_sent():
    """DGC: u = m u + g, v = v + u; send top-k(v); u and v zero (v: the codec's rounding) there."""
    layout = Layout([KeySpec("w", (100,))])
    enc = Encoder("topk", topk=0.1, momentum=0.9)
    g = np.linspace(-1, 1, 100).astype(np.float32)
    first = assemble(layout, enc.split(layout, g), "t")
    sent = np.flatnonzero(first)
    assert len(sent) == 10
    u = enc.velocity["w@0"].numpy()
    assert np.all(u[sent] == 0) and np.array_equal(np.delete(u, sent), np.delete(g, sent))
    second = assemble(layout, enc.split(layout, g), "t")
    # an unsent element now carries its velocity 0.9 g + g on top of its residual g
    expected = np.where(np.isin(np.arange(100), sent), 0, g + 1.9 * g)
    assert np.allclose(second[second != 0], expected[second != 0], rtol=2e-3)
    state = enc.state_dict()
    assert {"w@0", "velocity:w@0"} == set(state)
    again = Encoder("topk", topk=0.1, momentum=0.9)
    again.load_state_dict(state)
    assert [c.payload for c in again.split(layout, g)] == [c.payload for c in enc.split(layout, g)]


def test_momentum_correction_is_only_for_sgd_momentum_with_topk():
    from ps.core.config import JobConfig, OptimizerConfig

    ok = JobConfig(name="j", push_codec="topk", momentum_correction=True,
                   optimizer=OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9))
    assert Encoder.for_job(ok, worker=True).momentum == 0.9
    assert Encoder.for_job(ok, "topk").momentum == 0.0  # relays: error feedback only
    for bad in (dict(push_codec="fp16"), dict(optimizer=OptimizerConfig(kind="adam")),
                dict(optimizer=OptimizerConfig(kind="sgd", momentum=0.0))):
        with pytest.raises(BadInput, match="momentum_correction"):
            JobConfig(**{"name": "j", "push_codec": "topk", "momentum_correction": True,
                         "optimizer": OptimizerConfig(kind="sgd", momentum=0.9), **bad})


@pytest.mark.parametrize("codec, kw", [("topk", {"momentum": 0.9}), ("int8", {}), ("powersgd", {"rank": 2})])
def test_an_encoders_roll_back_puts_every_chunk_state_back_exactly(codec, kw):
    """A push encoded piece by piece and then cut (worker overlap): roll_back restores the
    residuals, DGC velocities and PowerSGD Qs the encodes since begin() changed; commit keeps."""
    layout = Layout([KeySpec("a", (64, 32)), KeySpec("b", (40, 16))])
    enc = Encoder(codec, topk=0.05, seed="w0", **kw)
    rng = np.random.default_rng(0)
    enc.split(layout, rng.standard_normal(layout.numel).astype(np.float32))
    before = {k: v.copy() for k, v in enc.state_dict().items()}
    enc.begin()
    enc.split(layout, rng.standard_normal(layout.numel).astype(np.float32), only=frozenset({"a"}))
    enc.split(layout, rng.standard_normal(layout.numel).astype(np.float32), only=frozenset({"b"}))
    assert any(not np.array_equal(v, before[k]) for k, v in enc.state_dict().items())
    enc.roll_back()
    after = enc.state_dict()
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)
    enc.begin()
    enc.split(layout, rng.standard_normal(layout.numel).astype(np.float32))
    enc.commit()
    kept = enc.state_dict()
    enc.roll_back()  # nothing begun: nothing undone
    assert all(np.array_equal(enc.state_dict()[k], kept[k]) for k in kept)


def test_a_pushs_input_print_is_its_gradients_bits_and_fields_on_either_side_of_torch():
    """What a push sent again after a lost answer is known by (a lossy encode of it differs):
    the same bits, dtype, shape and fields print the same, from numpy or torch; a change of a
    bit (-0.0 for 0.0), of the dtype, the shape or a field does not."""
    g = np.random.default_rng(2).standard_normal(12).astype(np.float32)
    p = input_print(g, 3, 0, 1)
    assert p == input_print(g.copy(), 3, 0, 1) == input_print(torch.from_numpy(g.copy()), 3, 0, 1)
    z = np.zeros(12, np.float32)
    others = [input_print(g, 4, 0, 1), input_print(g, 3, 0), input_print(g.reshape(3, 4), 3, 0, 1),
              input_print(g.astype(np.float64), 3, 0, 1), input_print(torch.from_numpy(g).to(torch.bfloat16), 3, 0, 1),
              input_print(np.where(np.arange(12) == 5, np.nextafter(g, np.inf), g), 3, 0, 1),
              input_print(z, 3, 0, 1), input_print(-z, 3, 0, 1)]
    assert len({p, *others}) == 1 + len(others)


def test_a_loaded_state_is_not_overwritten_by_taking_back_an_encode_recorded_before_it():
    """A checkpoint loaded while a push's encode is recorded (an interrupted push not settled
    yet): taking that encode back wrote the residuals from before it over the loaded ones."""
    layout = Layout([KeySpec("a", (64, 32))])
    rng = np.random.default_rng(3)
    enc = Encoder("topk", topk=0.05, seed="w0")
    enc.split(layout, rng.standard_normal(layout.numel).astype(np.float32))
    other = Encoder("topk", topk=0.05, seed="w1")
    other.split(layout, rng.standard_normal(layout.numel).astype(np.float32))
    loaded = other.state_dict()
    for end in ("roll_back", "settle"):
        enc.begin()
        enc.split(layout, rng.standard_normal(layout.numel).astype(np.float32))
        if end == "settle":
            enc.set_aside()
        enc.load_state_dict(loaded)
        enc.roll_back() if end == "roll_back" else enc.settle(False)
        got = enc.state_dict()
        assert got.keys() == loaded.keys() and all(np.array_equal(got[k], loaded[k]) for k in loaded), end


def test_an_encode_set_aside_is_taken_back_only_if_settled_as_not_applied_and_not_built_on():
    """A push sent and unanswered: its encodes stand until the root says (``settle``); one
    not applied gives back what it took of the residual. An encode in between builds on them,
    and a reset replaces them: neither can be taken back after."""
    layout = Layout([KeySpec("a", (64, 32))])
    rng = np.random.default_rng(1)

    def grad() -> np.ndarray:
        return rng.standard_normal(layout.numel).astype(np.float32)

    def state(e: Encoder) -> dict:
        return {k: v.copy() for k, v in e.state_dict().items()}

    def same(x: dict, y: dict) -> bool:
        return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
    enc = Encoder("topk", topk=0.05, seed="w0")
    enc.split(layout, grad())
    before = state(enc)
    for applied in (True, False):
        enc.begin()
        enc.split(layout, grad())
        sent = state(enc)
        enc.set_aside()
        assert not enc.recording and same(state(enc), sent)
        enc.settle(applied)
        assert same(state(enc), sent if applied else before)
        before = state(enc)
    enc.begin()
    enc.split(layout, grad())
    enc.set_aside()
    enc.split(layout, grad())  # built on it
    built = state(enc)
    enc.settle(False)
    assert same(state(enc), built)
    enc.begin()
    enc.split(layout, grad())
    enc.set_aside()
    enc.reset()
    enc.settle(False)
    assert state(enc) == {}
