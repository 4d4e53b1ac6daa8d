"""PowerSGD (pure): low-rank matrices come back exactly, error feedback loses nothing over time,
the warm start survives a checkpoint, keys go by shape, malformed payloads are refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps.core.codecs import get_codec
from ps.core.codecs.powersgd import _HEAD, PowerSGD
from ps.core.config import JobConfig
from ps.core.encoder import Encoder
from ps.core.errors import BadInput
from ps.core.tensors import assemble, split
from ps.core.view import KeySpec, Layout
from ps.net.messages import job_from_pb, job_to_pb

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _low_rank(rows: int, cols: int, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)


# ---------------------------------------------------------------------------- the codec


@SETTINGS
@given(st.integers(1, 80), st.integers(1, 80), st.integers(1, 6), st.integers(0, 3), st.integers(0, 99))
def test_a_matrix_of_rank_at_most_r_comes_back_up_to_float32_rounding(rows, cols, rank, extra, seed):
    m = _low_rank(rows, cols, rank, seed)
    codec = get_codec("powersgd", rank=rank + extra, width=cols)
    y = torch.from_numpy(get_codec("powersgd").decode(codec.encode(m.flatten()), m.numel()))  # any instance decodes
    scale = float(m.abs().max()) * max(rows, cols)
    assert torch.allclose(y, m.flatten(), rtol=0, atol=2e-5 * scale + 1e-30), float((y - m.flatten()).abs().max())


def test_the_payload_is_the_factors_and_a_header():
    m = _low_rank(300, 200, 8)
    payload = PowerSGD(rank=4, width=200).encode(m.flatten())
    assert len(payload) == _HEAD.size + 4 * 4 * (300 + 200)
    p, q = PowerSGD().factors(payload, m.numel())
    assert p.shape == (300, 4) and q.shape == (200, 4)
    assert torch.allclose(p.t() @ p, torch.eye(4), atol=1e-5)   # P orthonormal: decode = P P^T M
    assert torch.allclose(q, m.t() @ p, rtol=1e-4, atol=1e-3)


def test_decoding_sums_the_outer_products_in_order_with_one_rounding_each():
    """The bits a receiver gets are specified (no matmul), so the sender's residual, on any
    device, is computed from exactly what every receiver holds (invariant 6)."""
    payload = PowerSGD(rank=3, width=50).encode(torch.randn(40, 50))
    p, q = PowerSGD().factors(payload, 2000)
    want = (p[:, :1] * q[:, 0]) + (p[:, 1:2] * q[:, 1])
    want = want + (p[:, 2:3] * q[:, 2])
    assert PowerSGD().decode(payload, 2000).tobytes() == want.flatten().numpy().tobytes()


def test_the_warm_start_converges_to_the_best_rank_r_approximation():
    """One power iteration per step, started from the last Q: repeated on a fixed matrix, the
    error falls to the truncated SVD's (Eckart-Young), as subspace iteration does."""
    g = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(120, 120, generator=g))
    v, _ = torch.linalg.qr(torch.randn(90, 90, generator=g))
    s = 0.7 ** torch.arange(90.0)
    m = (u[:, :90] * s) @ v.t()
    best = float(s[2:].norm())
    codec, q, errors = PowerSGD(rank=2, width=90), None, []
    for _ in range(12):
        payload = codec.warm(q).encode(m.flatten())
        q = codec.factors(payload, m.numel())[1]
        errors.append(float((torch.from_numpy(codec.decode(payload, m.numel())) - m.flatten()).norm()))
    assert errors[-1] < 1.01 * best < errors[0]


def test_error_feedback_sends_everything_over_time():
    """Sum of what receivers decode + the sender's residual = sum of the gradients, and the
    unsent fraction shrinks relative to what was sent (Vogels et al. 2019, sec. 3)."""
    layout = Layout([KeySpec("w", (64, 48)), KeySpec("b", (48,))])
    enc = Encoder("powersgd", seed="w0", rank=2)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(layout.numel, generator=g)
    total, sent, gaps = torch.zeros(layout.numel), torch.zeros(layout.numel), []
    for step in range(200):
        grad = base + 0.5 * torch.randn(layout.numel, generator=g)
        total += grad
        sent += torch.from_numpy(assemble(layout, enc.split(layout, grad, step), what="push"))
        residual = torch.from_numpy(enc.state_dict()["w@0"])
        assert torch.allclose(sent[:3072] + residual, total[:3072], atol=1e-3 * (step + 1))
        assert torch.equal(sent[3072:], total[3072:])  # the bias: fp32, exact
        gaps.append(float((total - sent).norm() / total.norm()))
    # The residual stays bounded while the total grows: the unsent fraction falls like 1/t.
    assert gaps[-1] < 0.1 and gaps[-1] < gaps[49] / 3, gaps[9::10]


def test_the_warm_start_and_residual_survive_a_checkpoint():
    layout = Layout([KeySpec("w", (64, 48)), KeySpec("conv", (16, 4, 3, 3))])
    grads = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    a = Encoder("powersgd", seed="w0", rank=3)
    for step in range(3):
        a.split(layout, grads[step], step)
    state = a.state_dict()
    assert state["powersgd_q:w@0"].shape == (48, 3) and state["powersgd_q:conv@0"].shape == (36, 3)
    b = Encoder("powersgd", seed="other", rank=3)  # another seed: only the checkpoint can agree
    b.load_state_dict({k: v.copy() for k, v in state.items()})
    for step in (3, 4):
        pa, pb = a.split(layout, grads[step], step), b.split(layout, grads[step], step)
        assert [bytes(c.payload) for c in pa] == [bytes(c.payload) for c in pb]
    cold = [[bytes(c.payload) for c in Encoder("powersgd", seed=s, rank=3).split(layout, grads[3])]
            for s in ("other", "w0")]
    assert cold[0] != cold[1]  # without the checkpoint the seeds' random starts differ
    a.reset()
    assert a.state_dict() == {}


def test_a_checkpointed_q_of_another_rank_is_ignored():
    layout = Layout([KeySpec("w", (64, 48))])
    a = Encoder("powersgd", rank=2)
    a.split(layout, torch.randn(layout.numel))
    b = Encoder("powersgd", rank=4)
    b.load_state_dict(a.state_dict())
    (chunk,) = b.split(layout, torch.randn(layout.numel))
    assert PowerSGD().factors(chunk.payload, chunk.numel)[0].shape == (64, 4)
    assert b.state_dict()["powersgd_q:w@0"].shape == (48, 4)


# ---------------------------------------------------------------------------- keys by shape


def test_keys_go_by_shape_matrices_factored_whole_the_rest_fp32():
    layout = Layout([KeySpec("emb", (3000, 512)), KeySpec("conv", (64, 32, 3, 3)), KeySpec("b", (512,)),
                     KeySpec("small", (8, 8)), KeySpec("thin", (4096, 2)), KeySpec("bn.mean", (64, 64), kind="buffer")])
    grad = torch.randn(layout.numel)
    chunks = Encoder("powersgd", rank=4).split(layout, grad)
    got = {(c.key, c.codec, c.offset, c.numel) for c in chunks}
    assert got == {("emb", "powersgd", 0, 3000 * 512),   # one chunk past CHUNK_ELEMS: the whole matrix
                   ("conv", "powersgd", 0, 64 * 288),    # (64, 32*3*3), as torch reshapes it
                   ("b", "fp32", 0, 512), ("small", "fp32", 0, 64),  # 1-D; (8+8)*4*2 > 64
                   ("thin", "fp32", 0, 8192),            # width 2: factors would not shrink it
                   ("bn.mean", "fp32", 0, 4096)}         # buffers carry values, always fp32
    y = assemble(layout, chunks, what="push", require_all=True)
    off = layout.offset("b")
    assert y[off:off + 512].tobytes() == grad[off:off + 512].numpy().tobytes()


def test_a_matrix_whose_factors_would_overflow_a_frame_goes_in_blocks_of_rows():
    layout = Layout([KeySpec("w", (1000, 30))])
    grad = _low_rank(1000, 30, 2).flatten()
    chunks = split(layout, grad, get_codec("powersgd", rank=2), chunk_elems=200)  # (b + 30) * 2 <= 200
    assert [(c.offset, c.numel) for c in chunks] == [(i * 70 * 30, min(70, 1000 - i * 70) * 30) for i in range(15)]
    assert all(c.codec == "powersgd" for c in chunks)
    assert np.allclose(assemble(layout, chunks, what="push"), grad.numpy(), atol=1e-3)


# ---------------------------------------------------------------------------- malformed payloads


def _payload(rank=2, rows=3, cols=4, numel=12, floats=None, fmt=1):
    body = np.arange(floats if floats is not None else rank * (rows + cols), dtype="<f4").tobytes()
    return _HEAD.pack(fmt, rank, rows, cols, numel) + body


@pytest.mark.parametrize("payload, numel", [
    (b"", 12), (_payload()[:20], 12), (_payload()[:-1], 12), (_payload() + b"\0", 12),
    (_payload(fmt=2), 12), (_payload(), 13), (_payload(numel=13), 13),
    (_payload(rows=2, cols=6, numel=12), 13),                   # rows x cols != numel
    (_payload(rank=0), 12), (_payload(rank=4, floats=28), 12),  # rank 0; rank > min(rows, cols)
    (_payload(rank=65, rows=100, cols=100, numel=10_000), 10_000),  # past MAX_RANK
    (_payload(rows=0, cols=0, numel=0), 12), (_payload(rank=1, rows=0, cols=0, numel=0), 0),
    (_payload(rank=1, rows=1 << 32, cols=1 << 32, numel=0, floats=0), 0),  # 2**64 wraps to 0
    (_HEAD.pack(1, 2, 1 << 20, 1 << 20, 1 << 40) + b"\0" * 64, 1 << 40),  # no allocation past the size check
])
def test_malformed_payloads_are_refused(payload, numel):
    with pytest.raises(BadInput, match="powersgd"):
        PowerSGD().decode(payload, numel)


def test_an_empty_chunk_round_trips():
    codec = PowerSGD(width=0)
    assert codec.decode(codec.encode(np.zeros(0, np.float32)), 0).shape == (0,)


def test_non_finite_factors_decode_to_what_the_assembler_refuses():
    layout = Layout([KeySpec("w", (64, 48))])
    grad = torch.randn(layout.numel)
    grad[7] = float("nan")
    chunks = split(layout, grad, get_codec("powersgd"))
    with pytest.raises(BadInput, match="non-finite"):
        assemble(layout, chunks, what="push")
    bad = _HEAD.pack(1, 1, 3, 4, 12) + struct.pack("<7f", 1e30, 1, 1, 1e30, 1, 1, 1)  # finite, overflows
    assert not np.isfinite(PowerSGD().decode(bad, 12)).all()


def test_bad_options_are_refused():
    for rank in (0, 65, 2.0, True):
        with pytest.raises(BadInput, match="rank"):
            get_codec("powersgd", rank=rank)
    with pytest.raises(BadInput, match="width"):
        get_codec("powersgd", width=-1)
    with pytest.raises(BadInput, match="whole rows"):
        PowerSGD(width=7).encode(np.ones(20, np.float32))


# ---------------------------------------------------------------------------- the job option


def test_the_job_option_is_validated_and_travels():
    for rank in (0, 65, True, 2.5):
        with pytest.raises(BadInput, match="powersgd_rank"):
            JobConfig(name="j", powersgd_rank=rank)
    cfg = JobConfig(name="j", push_codec="powersgd", powersgd_rank=16)
    assert job_from_pb(job_to_pb(cfg)) == cfg
    old = job_to_pb(cfg)
    old.ClearField("powersgd_rank")  # a peer from before the field
    assert job_from_pb(old).powersgd_rank == 4
    assert Encoder.for_job(cfg).codec.rank == 16
