"""Codecs: how a flat float32 tensor slice becomes payload bytes and back.

    codec = get_codec("fp32+zstd")
    payload = codec.encode(x)             # x: 1-D float32 numpy array
    y = codec.decode(payload, x.size)     # bit-identical for lossless codecs

A codec is a pure object; lossy codecs (not built yet, see the compression issue) will keep
their error-feedback residual in an explicit state object passed to ``encode``. Decoding is
deterministic so every tier that decodes the same bytes gets the same numbers (invariant 6).
The registry is complete at import: every name in ``CODEC_NAMES`` has a codec.
"""

from __future__ import annotations

from ps.codecs.base import Codec
from ps.codecs.lossless import Fp32, Fp32Zstd

__all__ = ["Codec", "get_codec", "CODEC_NAMES"]

_REGISTRY: dict[str, Codec] = {c.name: c for c in (Fp32(), Fp32Zstd())}
CODEC_NAMES: tuple[str, ...] = ("fp32", "fp32+zstd")
assert set(_REGISTRY) == set(CODEC_NAMES), "every codec name needs a codec"


def get_codec(name: str) -> Codec:
    """The codec registered under ``name``; a clear error for an unknown one."""
    try:
        return _REGISTRY[name]
    except KeyError:
        from ps.errors import BadInput

        raise BadInput(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}") from None
