"""Which root shard owns which block of a job's parameters (pure; DESIGN.md, "Sharding").

>>> from ps.core.view import KeySpec
>>> layout = Layout([KeySpec("emb", (1000, 64)), KeySpec("bias", (64,))])
>>> blocks = split_blocks(layout, block_elems=16384)          # emb: 3 blocks of 16384, 1 of 14848
>>> [(b.key, b.index, b.start, b.stop) for b in blocks][:2]
[('emb', 0, 0, 16384), ('emb', 1, 16384, 32768)]
>>> len(blocks), blocks[-1].key                                # bias is small: one block, whole
(5, 'bias')
>>> owners = place(blocks, [Shard("r0"), Shard("r1", weight=2.0)])
>>> sorted(set(owners.values()))
['r0', 'r1']
>>> owners == place(list(reversed(blocks)), [Shard("r1", weight=2.0), Shard("r0")])  # order-free
True

Large tensors are cut into blocks of ``block_elems`` elements, small ones are one block. Each
shard puts virtual nodes on a 64-bit hash ring, in proportion to its weight; a block goes to the
first shard clockwise from its own hash *that has room*: each shard holds at most (1 + eps)
times its weighted share of the job's bytes (consistent hashing with bounded loads, Mirrokni,
Thorup and Zadimoghaddam, SODA 2018). Plain vnode hashing leaves a shard of 100 blocks 15-20%
over its share; the bound keeps every shard within ``eps`` of it while a new shard still takes
mostly blocks that land next to its own points, so resharding moves little.

The result depends only on the blocks (key, index, size) and the shards (name, weight): every
tier and worker computes the same owners, in any order, with no coordination, and a job records
(block_elems, shards) in its configuration to recompute them.

``ps.core.sharding`` builds a job's plan on it (each shard's layout, vectors cut and joined),
which root shards (``--shard I/N``), workers (``worker.sharded``) and ``hps reshard`` use;
relays carry one shard each (a relay tree per shard), so none computes placements.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import xxhash

from ps.core.errors import BadInput
from ps.core.view import Layout

__all__ = ["Block", "Shard", "split_blocks", "place", "BLOCK_ELEMS"]

BLOCK_ELEMS = 1 << 20  # 4 MiB of float32: a frame's worth, and few enough blocks to place quickly
VNODES = 128           # virtual nodes of a shard of weight 1


@dataclass(frozen=True)
class Block:
    """Elements [start, stop) of the job's flat vector: part ``index`` of tensor ``key``."""

    key: str
    index: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return 4 * (self.stop - self.start)

    @property
    def name(self) -> str:
        return f"{self.key}#{self.index}"


@dataclass(frozen=True)
class Shard:
    name: str
    weight: float = 1.0


def split_blocks(layout: Layout, block_elems: int = BLOCK_ELEMS) -> list[Block]:
    """The job's blocks in layout order: every tensor in pieces of ``block_elems`` elements (the
    last one shorter), a tensor of at most ``block_elems`` elements whole."""
    if block_elems < 1:
        raise BadInput(f"block_elems must be at least 1, got {block_elems}")
    out = []
    for spec in layout:
        base, n = layout.offset(spec.key), spec.numel
        for i, lo in enumerate(range(0, max(n, 1), block_elems)):
            out.append(Block(spec.key, i, base + lo, base + min(n, lo + block_elems)))
    return out


def _h(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode())


def place(blocks: list[Block], shards: list[Shard], eps: float = 0.05, vnodes: int = VNODES) -> dict[str, str]:
    """Block name -> the name of the shard that owns it."""
    if not shards:
        raise BadInput("a job needs at least one root shard")
    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        raise BadInput(f"shard names must differ, got {names}")
    if any(not (s.weight > 0) for s in shards):
        raise BadInput(f"shard weights must be positive, got {[s.weight for s in shards]}")
    if not eps > 0:
        raise BadInput(f"eps must be positive, got {eps}")
    mean = sum(s.weight for s in shards) / len(shards)
    ring = sorted((_h(f"{s.name}/{v}"), s.name)
                  for s in shards for v in range(max(1, round(vnodes * s.weight / mean))))
    points = [p for p, _ in ring]
    total = sum(b.nbytes for b in blocks)
    weight = sum(s.weight for s in shards)
    cap = {s.name: (1.0 + eps) * total * s.weight / weight for s in shards}
    load = dict.fromkeys(names, 0)
    owners: dict[str, str] = {}
    # Largest first (a big block fits where a small one would have), then by hash: the order
    # is part of the result, so it must not depend on how the caller listed the blocks.
    for b in sorted(blocks, key=lambda b: (-b.nbytes, _h(b.name), b.name)):
        at = bisect.bisect(points, _h(b.name))
        owner = None
        for step in range(len(ring)):
            name = ring[(at + step) % len(ring)][1]
            if load[name] + b.nbytes <= cap[name]:
                owner = name
                break
        if owner is None:  # blocks larger than the slack: the least loaded for its weight
            owner = min(names, key=lambda n: ((load[n] + b.nbytes) / cap[n], n))
        owners[b.name] = owner
        load[owner] += b.nbytes
    return owners
