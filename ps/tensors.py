"""Splitting a flat vector into encoded per-key chunks and assembling it back (pure).

    chunks = split(layout, grad, get_codec("fp32"))
    grad2 = assemble(layout, chunks, what="push")          # validated, bit-identical

A chunk is at most ``CHUNK_ELEMS`` elements, so every frame stays under the 4 MiB payload
limit of the wire. ``assemble`` is where untrusted input is checked: unknown keys, wrong
shape or dtype, overlapping or out-of-range slices, payloads that do not decode, and
non-finite values all raise BadInput before anything is changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ps.codecs import Codec, get_codec
from ps.errors import BadInput
from ps.store import Layout

__all__ = ["Chunk", "split", "assemble", "CHUNK_ELEMS", "payload_bytes"]

CHUNK_ELEMS = 1 << 20  # 4 MiB of float32: the wire's per-frame payload limit


@dataclass(frozen=True)
class Chunk:
    """Encoded elements [offset, offset+numel) of one key's flattened tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int
    codec: str
    payload: bytes | memoryview


def split(layout: Layout, flat: np.ndarray, codec: Codec, chunk_elems: int = CHUNK_ELEMS) -> list[Chunk]:
    """Encode ``flat`` (the job's whole vector) as chunks, key by key."""
    out = []
    for spec in layout:
        base = layout.offset(spec.key)
        for off in range(0, max(spec.numel, 1), chunk_elems):
            n = min(chunk_elems, spec.numel - off)
            if n <= 0:
                break
            part = flat[base + off: base + off + n]
            out.append(Chunk(spec.key, spec.shape, spec.dtype, off, n, codec.name, codec.encode(part)))
    return out


def assemble(layout: Layout, chunks: list[Chunk], what: str, check_finite: bool = True,
             require_all: bool = False) -> np.ndarray:
    """Decode chunks into a fresh flat vector; keys a sender left out are zero.

    ``require_all`` demands every element be covered (snapshots, initial values).
    """
    out = np.zeros(layout.numel, dtype=np.float32)
    covered: dict[str, list[tuple[int, int]]] = {}
    for i, c in enumerate(chunks):
        spec = layout.check(c.key, c.dtype, c.shape)
        if c.numel == 0 or c.offset + c.numel > spec.numel:
            raise BadInput(f"{what}: chunk {i} of key {c.key!r} covers [{c.offset}, {c.offset + c.numel}) "
                           f"outside the key's {spec.numel} elements")
        values = get_codec(c.codec).decode(c.payload, c.numel)
        if check_finite and not np.isfinite(values).all():
            bad = int(values.size - np.isfinite(values).sum())
            raise BadInput(f"{what}: key {c.key!r} holds {bad} non-finite values (NaN/Inf); "
                           "nothing was applied")
        base = layout.offset(c.key)
        out[base + c.offset: base + c.offset + c.numel] = values
        covered.setdefault(c.key, []).append((c.offset, c.offset + c.numel))
    for key, spans in covered.items():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            if b0 < a1:
                raise BadInput(f"{what}: key {key!r} has overlapping chunks [{a0}, {a1}) and [{b0}, {b1})")
    if require_all:
        for spec in layout:
            have = sum(b - a for a, b in covered.get(spec.key, []))
            if have != spec.numel:
                raise BadInput(f"{what}: key {spec.key!r} has {have} of its {spec.numel} elements")
    return out


def payload_bytes(chunks: list[Chunk]) -> int:
    return sum(len(c.payload) for c in chunks)
