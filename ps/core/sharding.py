"""A sharded job's plan: which blocks each root shard owns, and the vectors cut and joined by
it (pure; DESIGN.md, "Sharding"; ``ps.core.placement`` places the blocks).

>>> from ps.core.config import ShardingConfig
>>> layout = Layout([KeySpec("emb", (10, 4)), KeySpec("bias", (4,))])
>>> plan = ShardPlan(layout, ShardingConfig(weights=(1.0, 2.0), block_elems=16))
>>> sorted(s.key for sub in plan.layouts for s in sub)     # emb in blocks of 16, bias whole
['bias', 'emb#0', 'emb#1', 'emb#2']
>>> flat = np.arange(44, dtype=np.float32)
>>> parts = plan.split(flat)                               # one vector per shard, its blocks'
>>> sum(p.size for p in parts), bool((plan.merge(parts) == flat).all())
(44, True)

Each shard serves an ordinary job over its own layout: a whole tensor keeps its key and shape;
a cut one gives keys ``key#i`` of shape (n,) (``base_key`` gives the tensor's name back, for
param-group patterns). Everything here depends only on the job's layout and its
``ShardingConfig``, so every worker, root shard and tool computes the same plan.

A tensor cut into blocks is stepped block by block, so only optimizers that act element-wise
may be used on it (Adafactor's factored moments and Muon's orthogonalisation see whole
matrices): ``ShardPlan`` refuses the others, saying which tensor is cut.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ps.core.config import JobConfig, OptimizerConfig, ShardingConfig
from ps.core.errors import BadInput
from ps.core.placement import Block, Shard, place, split_blocks
from ps.core.view import KeySpec, Layout, checksum

__all__ = ["ShardPlan", "shard_name", "base_key", "keys_of", "layout_of", "ELEMENTWISE", "reshard"]

# torch.optim classes whose update of an element depends on that element's own state only.
ELEMENTWISE = frozenset({"sgd", "adam", "adamw", "adamax", "nadam", "radam", "adagrad", "rmsprop",
                         "adadelta", "asgd", "rprop"})
_BLOCK_KEY = re.compile(r"^(.*)#(\d+)$")


def shard_name(i: int) -> str:
    return f"shard-{i}"


def base_key(name: str) -> str:
    """The tensor a shard's key belongs to: ``emb#3`` -> ``emb``; a whole tensor's is itself."""
    m = _BLOCK_KEY.match(name)
    return m.group(1) if m else name


def keys_of(layout: Layout) -> tuple[tuple[str, tuple[int, ...], str, str], ...]:
    """A layout as ShardingConfig.keys records it."""
    return tuple((s.key, tuple(s.shape), s.dtype, s.kind) for s in layout)


def layout_of(keys: Sequence[Sequence]) -> Layout:
    return Layout([KeySpec(k[0], tuple(k[1]), k[2], k[3]) for k in keys])


@dataclass(frozen=True)
class _Piece:
    block: Block
    whole: bool


class ShardPlan:
    """The blocks of ``layout`` placed on ``sharding``'s shards, with each shard's layout."""

    def __init__(self, layout: Layout, sharding: ShardingConfig, optimizer_kind: str = "sgd") -> None:
        self.layout, self.sharding = layout, sharding
        self.blocks = split_blocks(layout, sharding.block_elems)
        self.shards = [Shard(shard_name(i), w) for i, w in enumerate(sharding.weights)]
        owners = place(self.blocks, self.shards)
        index = {s.name: i for i, s in enumerate(self.shards)}
        self.owner = {b.name: index[owners[b.name]] for b in self.blocks}
        per: list[list[_Piece]] = [[] for _ in self.shards]
        for b in self.blocks:  # layout order within each shard
            spec = layout.spec(b.key)
            per[self.owner[b.name]].append(_Piece(b, whole=(b.stop - b.start) == spec.numel))
        cut = sorted({p.block.key for ps in per for p in ps if not p.whole})
        if cut and optimizer_kind.lower() not in ELEMENTWISE:
            raise BadInput(f"optimizer {optimizer_kind!r} steps whole tensors, and with block_elems "
                           f"{sharding.block_elems} tensor {cut[0]!r} is cut into blocks across shards; raise "
                           f"block_elems above {max(layout.spec(k).numel for k in cut)} or use one of "
                           f"{sorted(ELEMENTWISE)}")
        self._pieces = per
        self.layouts: list[Layout | None] = []
        for ps in per:
            specs = []
            for p in ps:
                spec = layout.spec(p.block.key)
                if p.whole:
                    specs.append(spec)
                else:
                    specs.append(KeySpec(p.block.name, (p.block.stop - p.block.start,), spec.dtype, spec.kind))
            self.layouts.append(Layout(specs) if specs else None)
        empty = [i for i, sub in enumerate(self.layouts) if sub is None]
        if empty:
            raise BadInput(f"root shard {empty[0]} of {len(self.shards)} would own no block of this job "
                           f"({len(self.blocks)} blocks): use fewer shards or a smaller block_elems")
        # A key of the whole layout -> (shard, index in that shard's layout) of each of its blocks
        self._key_blocks: dict[int, list[tuple[int, int]]] = {}
        key_index = {s.key: i for i, s in enumerate(layout)}
        for shard, ps in enumerate(per):
            for j, p in enumerate(ps):
                self._key_blocks.setdefault(key_index[p.block.key], []).append((shard, j))

    @classmethod
    def of(cls, cfg: JobConfig) -> ShardPlan:
        """The plan a sharded job's configuration records."""
        if cfg.sharding is None:
            raise BadInput(f"job {cfg.name!r} is not sharded")
        if not cfg.sharding.keys:
            raise BadInput(f"job {cfg.name!r}'s sharding records no keys; the creating worker fills them in")
        return cls(layout_of(cfg.sharding.keys), cfg.sharding, cfg.optimizer.kind)

    def shard_layout(self, shard: int) -> Layout:
        sub = self.layouts[shard]
        assert sub is not None
        return sub

    def split(self, flat: np.ndarray | torch.Tensor) -> list:
        """One vector per shard: its blocks' elements in its layout's order (numpy or torch, as
        given: a gradient on the GPU is cut there)."""
        if flat.shape[0] != self.layout.numel:
            raise BadInput(f"a vector of {flat.shape[0]} elements for a job of {self.layout.numel}")
        cat = torch.cat if isinstance(flat, torch.Tensor) else np.concatenate
        return [cat([flat[p.block.start:p.block.stop] for p in ps]) for ps in self._pieces]  # type: ignore[misc]

    def merge(self, parts: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """The whole vector from each shard's (``split``'s inverse)."""
        out = np.empty(self.layout.numel, np.float32) if out is None else out
        for ps, part in zip(self._pieces, parts, strict=True):
            off = 0
            for p in ps:
                n = p.block.stop - p.block.start
                out[p.block.start:p.block.stop] = part[off:off + n]
                off += n
        return out

    def absent(self, keys: Sequence[int]) -> list[tuple[int, ...]]:
        """Indices of the whole layout's keys -> each shard's indices of their blocks."""
        out: list[list[int]] = [[] for _ in self.shards]
        for k in keys:
            for shard, j in self._key_blocks.get(k, []):
                out[shard].append(j)
        return [tuple(sorted(a)) for a in out]

    def nbytes(self, shard: int) -> int:
        return sum(p.block.nbytes for p in self._pieces[shard])

    def block_count(self, shard: int) -> int:
        return len(self._pieces[shard])

    def moved(self, other: ShardPlan) -> int:
        """Blocks whose owner differs in ``other`` (same layout and block size: blocks are the
        same; a block cut differently counts as moved)."""
        mine = frozenset(self.blocks)  # once: a set per block made this quadratic in the blocks
        return sum(1 for b in other.blocks if self.owner.get(b.name) != other.owner[b.name] or b not in mine)


def _tensor_states(plan: ShardPlan, arrays: list[dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """Each trained tensor's optimizer state, whole: name -> state name -> array (scalars, such
    as Adam's step count, from the tensor's first block; the blocks of a tensor agree)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for shard, arr in enumerate(arrays):
        sub = plan.shard_layout(shard)
        trained = [i for i, s in enumerate(sub) if s.kind == "param"]
        for k, v in arr.items():
            if not k.startswith("opt.state."):
                continue
            head, _, name = k[len("opt.state."):].partition(".")
            if not head.isdigit() or int(head) >= len(sub.specs) or int(head) not in trained:
                raise BadInput(f"shard {shard}'s checkpoint holds optimizer state {k} for no trained key")
            spec = sub.specs[int(head)]
            whole = plan.layout.spec(base_key(spec.key))
            state = out.setdefault(whole.key, {})
            if v.ndim == 0:
                state.setdefault(name, v)
                continue
            if v.size != spec.numel:  # factored (Adafactor's (m, 1)): only on uncut keys, kept as it is
                if base_key(spec.key) != spec.key:
                    raise BadInput(f"shard {shard}'s optimizer state {k} of shape {v.shape} is of a cut key")
                state[name] = v
                continue
            full = state.setdefault(name, np.zeros(whole.numel, v.dtype))
            if base_key(spec.key) == spec.key:
                full[:] = v.reshape(-1)
            else:
                index = int(_BLOCK_KEY.match(spec.key).group(2))  # type: ignore[union-attr]
                lo = index * plan.sharding.block_elems
                full[lo:lo + v.size] = v.reshape(-1)
    return out


def reshard(old: list[tuple[dict[str, np.ndarray], dict]], sharding: ShardingConfig
            ) -> tuple[list[tuple[dict[str, np.ndarray], dict]], int]:
    """Checkpoints (arrays, meta) of every shard of one job -> those of the same job over
    ``sharding``'s shards, and how many blocks changed owner. Parameters, the published view
    and the optimizer state are carried bit for bit; the version is kept (all shards must be
    at one version: a job stopped cleanly); new shard j keeps old shard j's exactly-once
    records (its workers' clients for shard j retry there); the data progress is shard 0's."""
    if not old:
        raise BadInput("no shard checkpoints to reshard")
    cfg = _job(old[0][1]["config"])
    if cfg.sharding is None:
        raise BadInput(f"job {cfg.name!r} is not sharded")
    if len(old) != cfg.sharding.shards:
        raise BadInput(f"job {cfg.name!r} is sharded over {cfg.sharding.shards} roots; got {len(old)} checkpoints")
    for i, (_, meta) in enumerate(old):
        other = _job(meta["config"])
        if other != cfg:
            raise BadInput(f"shard {i}'s checkpoint is of another job or configuration ({other.name!r})")
    versions = [meta["version"] for _, meta in old]
    if len(set(versions)) != 1:
        raise BadInput(f"the shards' checkpoints are at versions {versions}; reshard a job whose shards "
                       "stopped at one version (stop every shard cleanly: SIGTERM writes a checkpoint)")
    steps = {meta["steps"] for _, meta in old}
    if len(steps) != 1:
        raise BadInput(f"the shards' optimizers took different step counts {sorted(steps)}")
    before = ShardPlan.of(cfg)
    for i, (_, meta) in enumerate(old):
        got = layout_of(meta["keys"])
        if got != before.shard_layout(i):
            raise BadInput(f"checkpoint {i} holds other blocks than the ring places on shard {i}: "
                           "give the checkpoints in shard order")
    params = before.merge([a["params"] for a, _ in old])
    view = before.merge([a["view"] for a, _ in old])
    states = _tensor_states(before, [a for a, _ in old])
    new_cfg = dataclasses.replace(cfg, sharding=ShardingConfig(
        weights=sharding.weights, block_elems=sharding.block_elems, keys=cfg.sharding.keys))
    after = ShardPlan.of(new_cfg)
    p_parts, v_parts = after.split(params), after.split(view)
    out = []
    for j in range(len(after.shards)):
        sub = after.shard_layout(j)
        arrays = {"params": p_parts[j], "view": v_parts[j]}
        # The records of applied pushes stay with the shard number: a worker's client for
        # shard j (its own incarnation and push numbers) talks to shard j before and after, so
        # shard j's records -- with the runs it dropped, or an old push read as never applied
        # would be applied again -- are the ones its retries are answered from.
        if j < len(old):
            for name in ("applied", "applied_runs"):
                if name in old[j][0]:
                    arrays[name] = old[j][0][name]
        for i, spec in enumerate(sub):
            if spec.kind != "param":
                continue
            whole = base_key(spec.key)
            lo = 0 if whole == spec.key else int(_BLOCK_KEY.match(spec.key).group(2)) * sharding.block_elems  # type: ignore[union-attr]
            for name, full in states.get(whole, {}).items():
                if full.ndim == 0 or full.size != after.layout.spec(whole).numel:  # a scalar, or factored
                    if full.ndim and whole != spec.key:
                        raise BadInput(f"optimizer state {name} of {whole} is factored ({full.shape}): "
                                       "the key cannot be cut into blocks")
                    arrays[f"opt.state.{i}.{name}"] = full.copy()
                else:
                    arrays[f"opt.state.{i}.{name}"] = full[lo:lo + spec.numel].reshape(spec.shape).copy()
        meta = {**old[0][1], "config": _asdict(new_cfg), "keys": [[s.key, list(s.shape), s.dtype, s.kind] for s in sub]}
        meta["checksum"] = checksum(v_parts[j])
        if j:
            meta["data"] = {}
        out.append((arrays, meta))
    return out, before.moved(after)


def _job(c: dict) -> JobConfig:
    """A JobConfig from its ``dataclasses.asdict`` JSON (as a checkpoint's meta holds it)."""
    return JobConfig(**{**c, "optimizer": OptimizerConfig(**c["optimizer"])})


def _asdict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)
