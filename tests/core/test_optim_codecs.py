"""Unit tests for ps.core.optim, ps.core.codecs, ps.tiers.checkpoint and ps.core.config.

    .venv/bin/python -m pytest -q tests/core/test_optim_codecs.py

The optimizer is checked against torch.optim on the same values held as two separate
parameters (what a single training process would hold), so a flat-vector shortcut that
mixed elements or skipped a hyper-parameter would show.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
import torch

from ps.core.codecs import CODEC_NAMES, get_codec
from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
from ps.core.errors import BadInput
from ps.core.optim import ServerOptimizer, lr_at
from ps.tiers import checkpoint

__all__: list[str] = []

N, SPLIT, STEPS = 50, 30, 10


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _init(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def _grads(seed: int = 1, steps: int = STEPS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(np.float32) for _ in range(steps)]


def _torch_reference(cfg: OptimizerConfig, init: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """torch.optim on two separate parameters holding the same values, lr set per step."""
    a = torch.tensor(init[:SPLIT].copy(), requires_grad=True)
    b = torch.tensor(init[SPLIT:].copy(), requires_grad=True)
    if cfg.kind == "sgd":
        opt = torch.optim.SGD([a, b], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                              weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.Adam([a, b], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                               weight_decay=cfg.weight_decay)
    for step, g in enumerate(grads):
        a.grad = torch.from_numpy(g[:SPLIT].copy())
        b.grad = torch.from_numpy(g[SPLIT:].copy())
        lr = cfg.lr * (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else cfg.lr
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return torch.cat([a.detach(), b.detach()]).numpy()


OPTIMIZERS = {
    "sgd-momentum": OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9),
    "sgd-nesterov-wd": OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9, nesterov=True,
                                       weight_decay=0.01),
    "sgd-momentum-wd": OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9, nesterov=False,
                                       weight_decay=0.01),
    "adam": OptimizerConfig(kind="adam", lr=1e-2),
    "adam-wd-betas": OptimizerConfig(kind="adam", lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6,
                                     weight_decay=0.01),
    "sgd-warmup": OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9, warmup_steps=4),
    "adam-warmup": OptimizerConfig(kind="adam", lr=1e-2, warmup_steps=6),
}


# ============================================================================ optim


@pytest.mark.parametrize("cfg", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_server_optimizer_matches_torch_on_separate_parameters(cfg):
    init, grads = _init(), _grads()
    params = init.copy()
    opt = ServerOptimizer(cfg, params)
    for g in grads:
        opt.step(g)
    want = _torch_reference(cfg, init, grads)
    assert opt.steps == STEPS
    assert not np.allclose(params, init)  # the vector passed in is updated in place
    np.testing.assert_allclose(params, want, rtol=1e-6, atol=0)


def test_lr_warm_up_is_linear_and_reaches_lr():
    cfg = OptimizerConfig(lr=0.8, warmup_steps=4)
    lrs = [lr_at(cfg, s) for s in range(7)]
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8])
    assert lr_at(cfg, cfg.warmup_steps) == cfg.lr
    assert lr_at(cfg, cfg.warmup_steps - 1) == pytest.approx(cfg.lr)
    diffs = np.diff(lrs[:4])
    np.testing.assert_allclose(diffs, diffs[0])
    assert all(lr_at(OptimizerConfig(lr=0.3), s) == 0.3 for s in range(5))


def test_server_optimizer_refuses_wrong_inputs():
    cfg = OptimizerConfig()
    with pytest.raises(ValueError):
        ServerOptimizer(cfg, np.zeros(N, np.float64))
    with pytest.raises(ValueError):
        ServerOptimizer(cfg, np.zeros((5, 10), np.float32))
    opt = ServerOptimizer(cfg, np.zeros(N, np.float32))
    with pytest.raises(ValueError):
        opt.step(np.zeros(N + 1, np.float32))
    assert opt.steps == 0


def _restored_run(cfg: OptimizerConfig, via_disk: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    init, grads = _init(2), _grads(3)
    straight = init.copy()
    a = ServerOptimizer(cfg, straight)
    for g in grads:
        a.step(g)

    first = init.copy()
    b = ServerOptimizer(cfg, first)
    for g in grads[:5]:
        b.step(g)
    state = b.state_dict()
    params = first.copy()
    if via_disk is not None:  # what the root does: arrays to a checkpoint, steps in meta
        arrays = {"params": params, **{k: v for k, v in state.items() if isinstance(v, np.ndarray)}}
        checkpoint.save(via_disk, 5, arrays, {"steps": state["steps"]})
        arrays, meta = checkpoint.load_latest(via_disk)
        params = arrays.pop("params")
        state = {"steps": meta["steps"], **arrays}
    del b
    c = ServerOptimizer(cfg, params)
    c.load_state_dict(state)
    assert c.steps == 5
    for g in grads[5:]:
        c.step(g)
    return straight, params


@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adam-wd-betas", "sgd-warmup", "adam-warmup"])
def test_state_dict_round_trip_continues_identically(name):
    straight, restored = _restored_run(OPTIMIZERS[name])
    assert straight.tobytes() == restored.tobytes()


@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adam-warmup"])
def test_state_dict_survives_a_checkpoint_file(name, tmp_path):
    straight, restored = _restored_run(OPTIMIZERS[name], via_disk=str(tmp_path))
    assert straight.tobytes() == restored.tobytes()


def test_state_dict_without_restore_would_differ():
    """The round-trip tests above can fail: a fresh optimizer (no state) diverges."""
    cfg = OPTIMIZERS["adam-warmup"]
    init, grads = _init(2), _grads(3)
    straight = init.copy()
    a = ServerOptimizer(cfg, straight)
    for g in grads:
        a.step(g)
    half = init.copy()
    b = ServerOptimizer(cfg, half)
    for g in grads[:5]:
        b.step(g)
    fresh = ServerOptimizer(cfg, half)
    for g in grads[5:]:
        fresh.step(g)
    assert straight.tobytes() != half.tobytes()


def test_state_dict_is_a_snapshot():
    opt = ServerOptimizer(OPTIMIZERS["adam"], _init())
    grads = _grads()
    opt.step(grads[0])
    state = opt.state_dict()
    saved = {k: np.array(v, copy=True) for k, v in state.items()}
    for g in grads[1:]:
        opt.step(g)
    assert state["steps"] == 1
    for k, v in saved.items():
        np.testing.assert_array_equal(state[k], v)
    assert set(state) >= {"steps", "state.0.exp_avg", "state.0.exp_avg_sq"}  # per key (one key here)


def test_a_checkpoint_from_before_per_key_state_loads():
    # Checkpoints written before issue 13 held one flat array per state name.
    straight = _init()
    a = ServerOptimizer(OPTIMIZERS["adam"], straight)
    grads = _grads()
    a.step(grads[0])
    old = {k.replace("state.0.", "state."): v for k, v in a.state_dict().items()}
    assert set(old) == {"steps", "state.step", "state.exp_avg", "state.exp_avg_sq"}
    resumed = straight.copy()
    b = ServerOptimizer(OPTIMIZERS["adam"], resumed)
    b.load_state_dict(old)
    for g in grads[1:]:
        a.step(g)
        b.step(g)
    assert straight.tobytes() == resumed.tobytes()


# ============================================================================ codecs


def test_every_codec_name_resolves():
    for name in CODEC_NAMES:
        codec = get_codec(name)
        assert codec.name == name
    assert {n for n in CODEC_NAMES if get_codec(n).lossless} == {"fp32", "fp32+zstd", "rows"}


@pytest.mark.parametrize("name", ["fp32", "fp32+zstd"])
def test_codec_round_trip_is_bit_exact(name):
    codec = get_codec(name)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    x[:4] = [-0.0, 1e-45, np.finfo(np.float32).max, np.nan]  # decoding validates nothing
    y = codec.decode(memoryview(codec.encode(x)), x.size)
    assert y.dtype == np.float32 and y.tobytes() == x.tobytes()


def test_get_codec_unknown_lists_the_known_ones():
    with pytest.raises(BadInput) as exc:
        get_codec("nope")
    msg = str(exc.value)
    assert "'nope'" in msg
    assert all(name in msg for name in CODEC_NAMES)


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 16, b"not zstd at all", bytes(range(256))])
def test_zstd_decode_of_garbage_is_bad_input(garbage):
    with pytest.raises(BadInput, match="fp32\\+zstd"):
        get_codec("fp32+zstd").decode(garbage, 4)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("numel", [0, 9, 11, 100])
def test_wrong_payload_length_is_bad_input(name, numel):
    codec = get_codec(name)
    payload = codec.encode(np.arange(10, dtype=np.float32))
    with pytest.raises(BadInput):
        codec.decode(payload, numel)




def _zstd_frame_claiming(size: int) -> bytes:
    """18 bytes: a single-segment zstd frame whose header claims ``size`` bytes of content."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + size.to_bytes(8, "little") + b"\x01\x00\x00"


def test_zstd_payload_claiming_a_huge_size_is_bad_input():
    with pytest.raises(BadInput):
        get_codec("fp32+zstd").decode(_zstd_frame_claiming(1 << 40), 4)


def test_zstd_decode_does_not_inflate_past_the_expected_size():
    bomb = get_codec("fp32+zstd").encode(np.zeros(16 << 20, np.float32))  # 64 MiB in ~2 KiB
    assert len(bomb) < 8192
    tracemalloc.start()
    try:
        with pytest.raises(BadInput):
            get_codec("fp32+zstd").decode(bomb, 4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding 4 elements allocated {peak} bytes"


def test_fp32_decode_of_a_ragged_payload_is_bad_input():
    with pytest.raises(BadInput, match="bytes"):
        get_codec("fp32").decode(b"\x00" * 7, 2)


# ============================================================================ checkpoint


def _save(d, version: int, keep: int = 3):
    arrays = {"params": np.full(4, version, np.float32), "opt.state.step": np.array(version, np.float32)}
    return checkpoint.save(d, version, arrays, {"version": version, "keys": [["w", [4], "float32"]]},
                           keep=keep)


def test_checkpoint_round_trip(tmp_path):
    arrays = {"params": np.random.default_rng(0).standard_normal(33).astype(np.float32),
              "opt.state.exp_avg": np.arange(33, dtype=np.float32),
              "opt.state.step": np.array(7.0, np.float32)}
    meta = {"version": 12, "checksum": 0xDEADBEEF, "config": {"name": "lm", "lr": 3e-4}}
    path = checkpoint.save(tmp_path / "job", 12, arrays, meta)
    assert path.exists() and path.parent == tmp_path / "job"
    got_arrays, got_meta = checkpoint.load_latest(tmp_path / "job")
    assert got_meta == meta
    assert set(got_arrays) == set(arrays)
    for k, v in arrays.items():
        assert got_arrays[k].dtype == v.dtype and got_arrays[k].shape == v.shape
        assert got_arrays[k].tobytes() == v.tobytes()


def test_load_latest_of_nothing_is_none(tmp_path):
    assert checkpoint.load_latest(tmp_path) is None
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_checkpoint_keeps_the_last_k_and_loads_the_newest(tmp_path):
    for v in (1, 2, 10, 11, 100):  # numeric, not lexicographic, order
        _save(tmp_path, v, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "ckpt-000000000011.npz", "ckpt-000000000100.npz"]
    arrays, meta = checkpoint.load_latest(tmp_path)
    assert meta["version"] == 100 and arrays["params"][0] == 100


def test_a_stray_tmp_file_is_ignored(tmp_path):
    _save(tmp_path, 3)
    # A crash mid-write of version 4 leaves only its temp file (not even a valid npz).
    (tmp_path / ".ckpt-000000000004.npz.tmp").write_bytes(b"PK\x03\x04half a zip")
    arrays, meta = checkpoint.load_latest(tmp_path)
    assert meta["version"] == 3
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-000000000003.npz"]


def test_a_garbage_newest_file_falls_back_to_the_previous_one(tmp_path):
    _save(tmp_path, 3)
    _save(tmp_path, 4).write_bytes(b"this is not a checkpoint")
    assert checkpoint.load_latest(tmp_path)[1]["version"] == 3


@pytest.mark.parametrize("damage", ["truncated", "bit-flip", "empty"])
def test_a_corrupt_newest_file_falls_back_to_the_previous_one(tmp_path, damage):
    _save(tmp_path, 3)
    newest = _save(tmp_path, 4)
    data = bytearray(newest.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "bit-flip":  # inside the stored params: the zip CRC notices
        i = bytes(data).find(np.full(4, 4, np.float32).tobytes())
        assert i > 0
        data[i] ^= 0x01
    else:
        data = bytearray()
    newest.write_bytes(bytes(data))
    assert checkpoint.load_latest(tmp_path)[1]["version"] == 3


# ============================================================================ config


def test_valid_configs_construct_and_are_frozen():
    job = JobConfig(name="lm-1.x_y", mode="ssp", staleness=2,
                    optimizer=OptimizerConfig(kind="adam", lr=3e-4), push_codec="fp32+zstd")
    srv = ServerConfig(role="zone", listen="0.0.0.0:7001", parent="127.0.0.1:7000")
    root = ServerConfig(role="global", checkpoint_dir="/tmp/x")
    assert srv.display_name == "zone" and root.parent == ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.mode = "bsp"  # type: ignore[misc]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(kind="rmsprob"), "'rmsprob' is not a torch.optim class"),  # any class, by name
    (dict(lr=-1), "-1"),
    (dict(lr=0), "0"),
    (dict(lr=float("nan")), "nan"),
    (dict(momentum=1.0), "1.0"),
    (dict(momentum=-0.5), "-0.5"),
    (dict(nesterov=True), "nesterov"),
    (dict(weight_decay=-0.1), "-0.1"),
    (dict(beta1=1.0), "1.0"),
    (dict(beta2=-0.2), "-0.2"),
    (dict(eps=0.0), "0.0"),
    (dict(warmup_steps=-3), "-3"),
    # inf passed every range check (inf > 0) and made the first step non-finite.
    (dict(lr=float("inf")), "lr must be a finite number, got inf"),
    (dict(weight_decay=float("inf")), "weight_decay must be a finite number"),
    (dict(eps=float("inf")), "eps must be a finite number"),
    (dict(lr=float("nan")), "lr must be a finite number, got nan"),
])
def test_optimizer_config_rejects_bad_values_naming_them(kwargs, needle):
    with pytest.raises(BadInput) as exc:
        OptimizerConfig(**kwargs)
    assert needle in str(exc.value)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(mode="bsq"), "'bsq'"),
    (dict(name="bad name!"), "'bad name!'"),
    (dict(name=""), "''"),
    (dict(name="x" * 64), "x" * 60),  # named, cut short: sentences echo at most 64 characters
    (dict(staleness=-1), "-1"),
    (dict(push_codec="gzip"), "'gzip'"),
    (dict(delta_codec="lz4"), "'lz4'"),
    (dict(delta_log_length=0), "0"),
    (dict(delta_log_length=100_001), "100001"),
    (dict(topk=float("nan")), "topk must be a finite number"),
])
def test_job_config_rejects_bad_values_naming_them(kwargs, needle):
    with pytest.raises(BadInput) as exc:
        JobConfig(**{"name": "lm", **kwargs})
    assert needle in str(exc.value)


@pytest.mark.parametrize("kwargs,needles", [
    (dict(role="leaf"), ["'leaf'"]),
    (dict(role="zone"), ["zone", "parent", "''"]),
    (dict(role="regional", parent="nocolon"), ["'nocolon'"]),
    (dict(role="global", parent="127.0.0.1:1"), ["'127.0.0.1:1'"]),
    (dict(role="global", listen="localhost"), ["'localhost'"]),
    (dict(role="zone", parent="p:1", checkpoint_dir="/tmp/c"), ["checkpoint"]),
    (dict(role="global", heartbeat_s=3.0, member_timeout_s=3.0), ["3.0s"]),
    (dict(role="global", heartbeat_s=5.0, member_timeout_s=2.0), ["5.0", "2.0"]),
    (dict(role="global", heartbeat_s=0.0), ["0.0"]),
    (dict(role="global", metrics_port=-2), ["-2"]),
    (dict(role="global", checkpoint_every=0), ["0"]),
    (dict(role="global", checkpoint_keep=0), ["0"]),
    (dict(role="global", upstream_timeout_s=-1.0), ["-1.0"]),
])
def test_server_config_rejects_bad_values_naming_them(kwargs, needles):
    with pytest.raises(BadInput) as exc:
        ServerConfig(**kwargs)
    for needle in needles:
        assert needle in str(exc.value)


@pytest.mark.parametrize("cfg", [OptimizerConfig(kind="adam", lr=1e-2, weight_decay=0.01),
                                 OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9, nesterov=True),
                                 OptimizerConfig(kind="sgd", lr=0.1)], ids=["adam", "sgd-nesterov", "sgd"])
def test_a_rolled_back_step_leaves_no_trace(cfg):
    """A root without a log undoes a step whose output is not finite: the next step must be the
    one it would have taken had the refused step never happened, bit for bit."""
    from ps.core.optim import ServerOptimizer

    rng = np.random.default_rng(3)
    g1, g2, bad = (rng.standard_normal(64).astype(np.float32) for _ in range(3))
    a, b = np.zeros(64, np.float32), np.zeros(64, np.float32)
    oa, ob = ServerOptimizer(cfg, a), ServerOptimizer(cfg, b)
    oa.step(g1)
    ob.step(g1)
    for _ in range(2):  # the buffers are reused on the second save
        oa.save_point()
        oa.step(bad * 1e3)
        oa.roll_back()
    assert a.tobytes() == b.tobytes() and oa.steps == ob.steps == 1
    oa.step(g2)
    ob.step(g2)
    assert a.tobytes() == b.tobytes()
    for (k, va), (_, vb) in zip(sorted(oa.state_dict().items()), sorted(ob.state_dict().items())):
        assert np.array_equal(va, vb), k


@pytest.mark.parametrize("extra", [b"\x00", b"trailing bytes", "a second frame"])
def test_zstd_payload_with_bytes_after_its_frame_is_bad_input(extra):
    """Bytes after the frame were ignored: a payload longer than its frame was taken whole."""
    codec = get_codec("fp32+zstd")
    payload = codec.encode(np.arange(4, dtype=np.float32))
    tail = payload if extra == "a second frame" else extra
    assert codec.decode(payload, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(BadInput, match="unused data"):
        codec.decode(payload + tail, 4)
