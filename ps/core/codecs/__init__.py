"""Codecs: how a flat float32 tensor slice becomes payload bytes and back.

>>> import numpy as np
>>> x = np.linspace(-1, 1, 1000, dtype=np.float32)
>>> codec = get_codec("fp32+zstd")
>>> payload = codec.encode(x)             # x: numpy array or torch tensor (any device)
>>> y = codec.decode(payload, x.size)     # float32 numpy on the host; bit-identical if lossless
>>> y.tobytes() == x.tobytes()
True
>>> topk = get_codec("topk", k=0.01)      # a codec with options: name plus keywords
>>> ef = ErrorFeedback()                  # lossy codecs run under error feedback
>>> payload = ef.encode("fc.weight", topk, x)
>>> int(np.count_nonzero(topk.decode(payload, x.size)))   # 1% sent, the rest kept for later
10

A codec is a pure object. Lossy codecs (fp16, bf16, int8, int4, topk, sign, powersgd; rows is lossless) keep no
residual themselves: the sender's ``ErrorFeedback`` state does (design invariant 6), and powersgd's
warm start (each matrix's last Q) is the sender's too (``ps.core.encoder.Encoder``). Their payloads
describe themselves (sizes, scales, k), so ``get_codec(name)`` decodes any of them whatever
options the sender used, and decoding is deterministic so every tier that decodes the same
bytes gets the same numbers. The registry is complete at import: every name in
``CODEC_NAMES`` has a codec, and ps.net.wire checks every name has a wire enum value.
"""

from __future__ import annotations

from typing import Any

from ps.core.codecs.base import Codec, LossyCodec
from ps.core.codecs.feedback import ErrorFeedback, dgc_density
from ps.core.codecs.half import Bf16, Fp16
from ps.core.codecs.int4 import Int4
from ps.core.codecs.int8 import Int8
from ps.core.codecs.lossless import Fp32, Fp32Zstd
from ps.core.codecs.powersgd import PowerSGD
from ps.core.codecs.rows import Rows
from ps.core.codecs.sign import Sign
from ps.core.codecs.topk import TopK
from ps.core.config import CODEC_NAMES
from ps.core.errors import BadInput

__all__ = ["Codec", "LossyCodec", "get_codec", "CODEC_NAMES", "ErrorFeedback", "dgc_density"]

_CLASSES: dict[str, type[Codec]] = {c.name: c for c in (Fp32, Fp32Zstd, Fp16, Bf16, Int8, Int4, TopK, Sign,
                                                           Rows, PowerSGD)}
_REGISTRY: dict[str, Codec] = {name: cls() for name, cls in _CLASSES.items()}
assert set(_REGISTRY) == set(CODEC_NAMES), "every codec name the configuration allows needs a codec"


def get_codec(name: str, **options: Any) -> Codec:
    """The codec registered under ``name``, or a fresh one built with ``options``.

        get_codec("int8")                # the shared default instance
        get_codec("topk", k=0.001)       # options: topk (k, seed), int8 and int4 (chunk, seed), fp32+zstd (level),
                                         # rows (width), powersgd (rank, width, seed)
    """
    cls = _CLASSES.get(name)
    if cls is None:
        raise BadInput(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}")
    if not options:
        return _REGISTRY[name]
    accepted = getattr(cls, "options", ())
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes none"
        raise BadInput(f"codec {name!r} has no option {', '.join(map(repr, unknown))}; {takes}")
    return cls(**options)
