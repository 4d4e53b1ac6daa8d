"""A sharded job's plan (ps/core/sharding.py): every element in exactly one shard's blocks, the
vectors cut and joined without loss, absent keys mapped to their blocks, whole-tensor
optimizers refused on cut tensors, and a reshard that carries every value and state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ps.core.config import JobConfig, OptimizerConfig, ShardingConfig
from ps.core.errors import BadInput
from ps.core.sharding import ShardPlan, base_key, keys_of, reshard
from ps.core.view import KeySpec, Layout

LAYOUT = Layout([KeySpec("emb", (50, 8)), KeySpec("fc.weight", (8, 8)), KeySpec("fc.bias", (8,)),
                 KeySpec("bn.running_mean", (8,), kind="buffer")])


def _plan(weights=(2.0, 1.0, 1.0), block_elems=64, kind="adam") -> ShardPlan:
    return ShardPlan(LAYOUT, ShardingConfig(weights=weights, block_elems=block_elems), kind)


def test_every_element_is_in_exactly_one_shard_and_split_merge_is_lossless():
    plan = _plan()
    flat = np.random.default_rng(0).standard_normal(LAYOUT.numel).astype(np.float32)
    parts = plan.split(flat)
    assert [p.size for p in parts] == [plan.shard_layout(i).numel for i in range(3)]
    assert sum(p.size for p in parts) == LAYOUT.numel
    assert np.array_equal(plan.merge(parts), flat)
    names = sorted(base_key(s.key) for i in range(3) for s in plan.shard_layout(i))
    assert set(names) == {s.key for s in LAYOUT}
    # emb (400 elements) is cut into 7 blocks of <= 64; the small tensors stay whole, with their shapes
    assert names.count("emb") == 7
    whole = {s.key: s for i in range(3) for s in plan.shard_layout(i) if "#" not in s.key}
    assert whole["fc.weight"].shape == (8, 8) and whole["bn.running_mean"].kind == "buffer"


def test_torch_gradients_are_cut_on_their_device_as_numpy_ones_are():
    torch = pytest.importorskip("torch")
    plan = _plan()
    flat = np.arange(LAYOUT.numel, dtype=np.float32)
    for a, b in zip(plan.split(torch.from_numpy(flat)), plan.split(flat), strict=True):
        assert isinstance(a, torch.Tensor) and np.array_equal(a.numpy(), b)


def test_absent_keys_map_to_each_shards_blocks_of_them():
    plan = _plan()
    absent = plan.absent([0])  # emb: all its blocks, wherever they live
    got = [plan.shard_layout(i).specs[j].key for i, a in enumerate(absent) for j in a]
    assert sorted(got) == sorted(f"emb#{i}" for i in range(7))


def test_a_whole_tensor_optimizer_is_refused_on_a_cut_tensor_and_allowed_when_nothing_is_cut():
    with pytest.raises(BadInput, match="adafactor.*emb.*block_elems above 400"):
        _plan(kind="adafactor")
    _plan(kind="adafactor", block_elems=400)


def test_a_shard_that_would_own_nothing_is_refused():
    with pytest.raises(BadInput, match="would own no block"):
        ShardPlan(Layout([KeySpec("w", (4,))]), ShardingConfig(weights=(1.0, 1.0)))


def _ckpts(plan: ShardPlan, cfg: JobConfig) -> list[tuple[dict, dict]]:
    rng = np.random.default_rng(1)
    params = rng.standard_normal(LAYOUT.numel).astype(np.float32)
    m = rng.standard_normal(LAYOUT.numel).astype(np.float32)
    out = []
    for i, (p, mm) in enumerate(zip(plan.split(params), plan.split(m), strict=True)):
        sub = plan.shard_layout(i)
        arrays = {"params": p, "view": p.copy(), "applied": np.full(3, i, np.uint8),
                  "applied_runs": np.full(2, 10 + i, np.uint8)}
        off = 0
        for j, s in enumerate(sub):
            if s.kind == "param":
                arrays[f"opt.state.{j}.exp_avg"] = mm[off:off + s.numel].reshape(s.shape)
                arrays[f"opt.state.{j}.step"] = np.array(7.0, np.float32)
            off += s.numel
        out.append((arrays, dict(version=7, checksum=0, steps=7, clock_min=0, data={},
                                 config=dataclasses.asdict(cfg),
                                 keys=[[s.key, list(s.shape), s.dtype, s.kind] for s in sub])))
    return out, params, m


def test_reshard_3_to_4_carries_values_and_state_and_moves_little():
    cfg = JobConfig(name="j", optimizer=OptimizerConfig(kind="adam"),
                    sharding=ShardingConfig(weights=(1.0, 1.0, 1.0), block_elems=8, keys=keys_of(LAYOUT)))
    before = ShardPlan.of(cfg)
    old, params, m = _ckpts(before, cfg)
    new, moved = reshard(old, ShardingConfig(weights=(1.0,) * 4, block_elems=8))
    after = ShardPlan.of(dataclasses.replace(cfg, sharding=ShardingConfig((1.0,) * 4, 8, keys_of(LAYOUT))))
    assert np.array_equal(after.merge([a["params"] for a, _ in new]), params)
    joined = np.zeros(LAYOUT.numel, np.float32)
    for i, (arrays, meta) in enumerate(new):
        sub = after.shard_layout(i)
        assert [k[0] for k in meta["keys"]] == [s.key for s in sub] and meta["version"] == 7
        for j, s in enumerate(sub):
            if s.kind == "param":
                assert float(arrays[f"opt.state.{j}.step"]) == 7.0
                lo = LAYOUT.offset(base_key(s.key)) + (int(s.key.split("#")[1]) * 8 if "#" in s.key else 0)
                joined[lo:lo + s.numel] = arrays[f"opt.state.{j}.exp_avg"].reshape(-1)
    trained = np.zeros(LAYOUT.numel, bool)
    for s in LAYOUT:
        if s.kind == "param":
            trained[LAYOUT.offset(s.key):LAYOUT.offset(s.key) + s.numel] = True
    assert np.array_equal(joined[trained], m[trained])  # the optimizer state, bit for bit
    # Shard j's records of applied pushes (with the runs it dropped) stay at shard j: its
    # workers' clients for shard j retry there. Shard 0's went everywhere, the runs nowhere.
    for j, (arrays, _) in enumerate(new):
        if j < len(old):
            assert arrays["applied"].tolist() == [j] * 3 and arrays["applied_runs"].tolist() == [10 + j] * 2
        else:
            assert "applied" not in arrays and "applied_runs" not in arrays
    assert len(before.blocks) >= 60 and moved <= 1.5 * len(before.blocks) / 4, moved


def test_reshard_refuses_shards_stopped_at_different_versions():
    cfg = JobConfig(name="j", sharding=ShardingConfig(weights=(1.0, 1.0), block_elems=64, keys=keys_of(LAYOUT)))
    old, _, _ = _ckpts(ShardPlan.of(cfg), cfg)
    old[1][1]["version"] = 8
    with pytest.raises(BadInput, match="versions \\[7, 8\\]"):
        reshard(old, ShardingConfig(weights=(1.0,) * 3, block_elems=64))


def test_reshard_carries_factored_optimizer_state_of_uncut_keys():
    """Adafactor keeps (m, 1) and (1, n) arrays for an (m, n) weight: moved whole, as they are."""
    keys = keys_of(LAYOUT)
    cfg = JobConfig(name="j", optimizer=OptimizerConfig(kind="adafactor"),
                    sharding=ShardingConfig(weights=(1.0, 1.0), block_elems=400, keys=keys))
    before = ShardPlan.of(cfg)
    old, _, _ = _ckpts(before, cfg)
    rows = {}
    for i, (arrays, _) in enumerate(old):
        for j, s in enumerate(before.shard_layout(i)):
            if s.kind == "param" and len(s.shape) == 2:
                rows[s.key] = np.arange(s.shape[0], dtype=np.float32).reshape(-1, 1) + 100 * j
                arrays[f"opt.state.{j}.row_var"] = rows[s.key]
    new, moved = reshard(old, ShardingConfig(weights=(1.0, 3.0), block_elems=400))
    after = ShardPlan.of(dataclasses.replace(cfg, sharding=ShardingConfig((1.0, 3.0), 400, keys)))
    got = {s.key: arrays[f"opt.state.{j}.row_var"] for i, (arrays, _) in enumerate(new)
           for j, s in enumerate(after.shard_layout(i)) if s.kind == "param" and len(s.shape) == 2}
    assert moved > 0 and got.keys() == rows.keys()
    assert all(np.array_equal(got[k], rows[k]) and got[k].shape == rows[k].shape for k in rows)
    # cut into blocks, the factored state has no block of its own to go with: refused, not invented
    with pytest.raises(BadInput, match="adafactor"):
        reshard(old, ShardingConfig(weights=(1.0, 1.0), block_elems=64))
