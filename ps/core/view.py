"""Parameters, layouts and the published view with its checksums (pure).

>>> layout = Layout([KeySpec("w", (4, 3)), KeySpec("b", (3,))])
>>> layout.numel, layout.offset("b")
(15, 12)
>>> view = View(layout)
>>> zeros, d = np.zeros(15, np.float32), np.ones(15, np.float32)
>>> view.load_snapshot(epoch=7, version=0, values=zeros, crc=checksum(zeros))
>>> view.apply_delta(epoch=7, version=1, delta=d, crc=checksum(zeros + d))
>>> view.apply_delta(epoch=7, version=1, delta=d, crc=checksum(zeros + d))   # invariant 5
Traceback (most recent call last):
ps.core.errors.Stale: delta for version 1 of epoch 0x7 does not apply to the held view ...

A job's parameters are held as one flat float32 vector; each key is a slice of it, in the
order the job was created with. Every version's view has a checksum that replicas verify
(invariant 1), so a wrong base or a corrupted delta is caught, not trained on.

The checksum is made of a digest per block (XXH3-64 of each ``BLOCK`` elements), combined by
hashing the digests in order. A view keeps its blocks' digests, so a version that changed
some blocks costs a hash of those alone: the root hashes what its delta touched (an outer
job's fragment, a job's trained keys but not its frozen ones), and a replica what the pulled
chunks covered (a span no chunk covered adds +0.0, which leaves its bits as they were: the
view never holds -0.0, see ``normalized``).

>>> v = np.zeros(3 * BLOCK, np.float32)
>>> d = block_digests(v); bool(d[1] == d[0]), combine(d) == checksum(v)
(True, True)
>>> blocks_of([(BLOCK - 1, BLOCK + 1)], v.size)      # a span across a boundary: both blocks
[0, 1]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from ps.core.errors import BadInput, Stale, short
from ps.core.pieces import Pieces

__all__ = ["KeySpec", "Layout", "View", "checksum", "block_digests", "blocks_of", "combine", "normalized", "BLOCK",
           "DTYPES", "KEY_KINDS", "MAX_ELEMENTS"]

DTYPES = ("float32",)
KEY_KINDS = ("param", "frozen", "buffer")
# Sanity bounds checked before anything is allocated; a tier's own budget is tighter
# (ServerConfig.max_job_params).
MAX_KEYS = 100_000
MAX_KEY_LENGTH = 256
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 40
# Elements per digest block (256 KiB of float32). Hashing 400 MB as 64Ki-element blocks took
# 35 ms against 32 ms in one piece here (1,526 calls); a smaller block wastes less of a hash
# on a fragment boundary it straddles.
BLOCK = 1 << 16


def block_digests(values: np.ndarray, blocks: list[int] | None = None,
                  out: np.ndarray | None = None) -> np.ndarray:
    """XXH3-64 of each ``BLOCK`` elements of a float32 vector (the last block may be short):
    all of them into a fresh array, or only ``blocks`` into ``out`` (the others left as they are)."""
    raw = memoryview(np.ascontiguousarray(values, dtype="<f4")).cast("B")
    n = -(-values.size // BLOCK)
    if out is None:
        out = np.empty(n, dtype="<u8")
    h, step = xxhash.xxh3_64_intdigest, 4 * BLOCK
    for b in range(n) if blocks is None else blocks:
        out[b] = h(raw[b * step:(b + 1) * step])
    return out


def combine(digests: np.ndarray) -> int:
    """A version's checksum from its blocks' digests, in order."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(digests, dtype="<u8").tobytes())


def checksum(values: np.ndarray) -> int:
    """The checksum every version carries: its blocks' XXH3-64 digests, combined. Every tier
    computes it for what it applies; XXH3 ran at 11.7 GB/s here against 3.8 for the zlib CRC-32
    it replaced (``benchmarks/hashes.py``: 34 ms instead of 106 ms per 100M-parameter view)."""
    return combine(block_digests(values))


def blocks_of(spans: Iterable[tuple[int, int]], numel: int) -> list[int]:
    """The blocks that the ``(start, stop)`` element spans touch, in order, once each."""
    touched: set[int] = set()
    for start, stop in spans:
        if stop > start:
            touched.update(range(start // BLOCK, (min(stop, numel) - 1) // BLOCK + 1))
    return sorted(touched)


def normalized(values: np.ndarray) -> np.ndarray:
    """``values`` with every -0.0 made +0.0 (in place; the same number). The root's view starts
    this way, and a sum is -0.0 only when both terms are, so no view ever holds -0.0 and adding
    +0.0 (where a delta carries nothing) leaves a block's bits, and so its digest, as they were."""
    return np.add(values, np.float32(0.0), out=values)


@dataclass(frozen=True)
class KeySpec:
    """One named parameter tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    # "param": trained (the root's optimizer updates it); "frozen": requires_grad=False, fixed
    # at creation; "buffer": a module buffer, averaged across workers when pushes carry it.
    kind: str = "param"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class Layout:
    """The ordered keys of a job and where each lives in the flat vector."""

    def __init__(self, specs: list[KeySpec] | tuple[KeySpec, ...]) -> None:
        if not specs:
            raise BadInput("a job needs at least one parameter key")
        if len(specs) > MAX_KEYS:
            raise BadInput(f"a job has at most {MAX_KEYS} parameter keys, got {len(specs)}")
        self.specs = tuple(specs)
        self._offset: dict[str, int] = {}
        self._by_key: dict[str, KeySpec] = {}
        off = 0
        for s in self.specs:
            if (not s.key or len(s.key) > MAX_KEY_LENGTH or not s.key.isprintable()
                    or s.key in self._by_key):
                raise BadInput(f"parameter key {short(s.key)} is empty, repeated, longer than "
                               f"{MAX_KEY_LENGTH} characters or not printable")
            if s.kind not in KEY_KINDS:
                raise BadInput(f"key {short(s.key)} is of kind {short(s.kind)}, not one of {KEY_KINDS}")
            if s.dtype not in DTYPES:
                raise BadInput(f"key {short(s.key)} has dtype {s.dtype}; parameters are held as {DTYPES}")
            if len(s.shape) > MAX_DIMS or any(d < 0 or d > MAX_ELEMENTS for d in s.shape):
                raise BadInput(f"key {short(s.key)} has shape {s.shape[:MAX_DIMS + 1]}: at most {MAX_DIMS} "
                               f"dimensions, each in [0, {MAX_ELEMENTS}]")
            if s.numel > MAX_ELEMENTS or off + s.numel > MAX_ELEMENTS:
                raise BadInput(f"job holds more than {MAX_ELEMENTS} parameters (key {short(s.key)})")
            self._by_key[s.key] = s
            self._offset[s.key] = off
            off += s.numel
        self.numel = off

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.specs == other.specs

    def __hash__(self) -> int:
        return hash(self.specs)

    def __iter__(self):
        return iter(self.specs)

    def spec(self, key: str) -> KeySpec:
        try:
            return self._by_key[key]
        except KeyError:
            raise BadInput(f"key {short(key)} is not a parameter of this job") from None

    def offset(self, key: str) -> int:
        return self._offset[key]

    def spans(self, keys: Iterable[str]) -> list[tuple[int, int]]:
        """The ``(start, stop)`` element spans of ``keys`` in the flat vector."""
        return [(self._offset[k], self._offset[k] + self._by_key[k].numel) for k in keys]

    def check(self, key: str, dtype: str, shape: tuple[int, ...]) -> KeySpec:
        """The key's spec, or BadInput naming what differs."""
        spec = self.spec(key)
        if dtype != spec.dtype:
            raise BadInput(f"key {short(key)} arrived as {dtype}; the job holds it as {spec.dtype}")
        if tuple(shape) != spec.shape:
            raise BadInput(f"key {short(key)} arrived with shape {tuple(shape)[:MAX_DIMS + 1]}; the job "
                           f"holds {spec.shape}")
        return spec


class View:
    """A replica of the published view: (epoch, version) plus the values, checksummed.

    ``epoch`` is the root incarnation whose lineage the view belongs to; 0 means "no view yet".
    Every mutation through ``load_snapshot`` / ``apply_delta`` (replicas) computes the new values
    aside and commits only after the checksum matches, so a refused delta changes nothing. The
    root, whose view is the source of every checksum, updates ``values`` in place instead.
    """

    def __init__(self, layout: Layout, reuse: bool = False) -> None:
        self.layout = layout
        self.values = np.zeros(layout.numel, dtype=np.float32)
        self.epoch = 0
        self.version = 0
        self.clock_min = 0  # SSP: every live worker has at least this many pushes included
        self.digests = block_digests(self.values)
        self.checksum = combine(self.digests)
        # reuse (a tier's replica, whose values nobody outside holds on to): each version is
        # computed into the buffer the version before the last one was in, instead of a fresh
        # array per version. A fresh 400 MB array cost a zone ~0.6 s a version in page faults
        # (py-spy, benchmarks/README.md). A worker's view is the script's to read and keep, so
        # it gets fresh arrays. Pulled deltas are added straight from their chunks (Pieces).
        self.reuse = reuse
        self._spare: np.ndarray | None = None

    @property
    def ready(self) -> bool:
        return self.epoch != 0

    def load_snapshot(self, epoch: int, version: int, values: np.ndarray, crc: int,
                      clock_min: int = 0) -> None:
        if values.shape != (self.layout.numel,):
            raise BadInput(f"snapshot has {values.size} elements, the job has {self.layout.numel}")
        digests = block_digests(values)
        got = combine(digests)
        if got != crc:
            raise Stale(f"snapshot of version {version} fails its checksum ({got:#018x} != {crc:#018x})")
        self.values = np.array(values, dtype=np.float32, copy=True)
        self.digests = digests
        self.epoch, self.version, self.checksum, self.clock_min = epoch, version, crc, clock_min

    def apply_delta(self, epoch: int, version: int, delta: np.ndarray | Pieces, crc: int,
                    clock_min: int = 0) -> None:
        """view_v = view_{v-1} + d_v, only onto the exact base (invariant 5). ``delta`` may be
        the pulled chunks (``Pieces``), added straight from them."""
        if epoch != self.epoch or version != self.version + 1:
            raise Stale(
                f"delta for version {version} of epoch {epoch:#x} does not apply to the held view "
                f"(epoch {self.epoch:#x}, version {self.version}); resync from a snapshot"
            )
        if isinstance(delta, Pieces):
            if delta.numel != self.values.size:
                raise BadInput(f"delta for version {version} has {delta.numel} elements; the view has "
                               f"{self.values.size}")
        elif delta.shape != self.values.shape or delta.dtype != np.float32:
            raise BadInput(f"delta for version {version} is {delta.dtype}{delta.shape}; the view is "
                           f"float32{self.values.shape}")
        if self.reuse:
            if self._spare is None or self._spare.shape != self.values.shape:
                self._spare = np.empty_like(self.values)
            out = self._spare
        else:
            out = np.empty_like(self.values)
        if isinstance(delta, Pieces):
            new = delta.plus(self.values, out)
            # Only the blocks a chunk covered can differ: a gap adds +0.0 to a view without -0.0.
            touched = blocks_of(((s, s + v.size) for s, v in delta.parts), new.size)
            digests = block_digests(new, touched, out=self.digests.copy())
        else:
            new = np.add(self.values, delta, out=out)
            digests = block_digests(new)
        got = combine(digests)
        if got != crc:
            raise Stale(f"version {version} fails its checksum ({got:#018x} != {crc:#018x}); "
                        "resync from a snapshot")
        if self.reuse:
            self._spare = self.values
        self.values, self.version, self.checksum, self.digests = new, version, crc, digests
        self.clock_min = max(self.clock_min, clock_min)

    def rehash(self, spans: Iterable[tuple[int, int]] | None = None) -> int:
        """The root's view after it changed ``values`` in place, only within the ``(start, stop)``
        element ``spans`` (None: anywhere): those blocks' digests again, and the checksum."""
        touched = None if spans is None else blocks_of(spans, self.values.size)
        block_digests(self.values, touched, out=self.digests)
        self.checksum = combine(self.digests)
        return self.checksum
