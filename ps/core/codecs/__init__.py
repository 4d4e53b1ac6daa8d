"""Codecs: how a flat float32 tensor slice becomes payload bytes and back.

>>> import numpy as np
>>> x = np.linspace(-1, 1, 1000, dtype=np.float32)
>>> codec = get_codec("fp32+zstd")
>>> payload = codec.encode(x)             # x: numpy array or torch tensor (any device)
>>> y = codec.decode(payload, x.size)     # float32 numpy on the host; bit-identical if lossless
>>> y.tobytes() == x.tobytes()
True
>>> topk = get_codec("topk", k=0.01)      # a codec with options: name plus keywords
>>> from ps.core.codecs import ErrorFeedback
>>> ef = ErrorFeedback()                  # lossy codecs run under error feedback
>>> payload = ef.encode("fc.weight", topk, x)
>>> int(np.count_nonzero(topk.decode(payload, x.size)))   # 1% sent, the rest kept for later
10

A codec is a pure object. Lossy codecs (fp16, bf16, int8, int4, topk, sign, powersgd; rows is lossless) keep no
residual themselves: the sender's ``ErrorFeedback`` state does (design invariant 6), and powersgd's
warm start (each matrix's last Q) is the sender's too (``ps.core.encoder.Encoder``). Their payloads
describe themselves (sizes, scales, k), so ``get_codec(name)`` decodes any of them whatever
options the sender used, and decoding is deterministic so every tier that decodes the same
bytes gets the same numbers. The registry is complete: every name in ``CODEC_NAMES`` has a
codec (asserted at import), and ps.net.wire checks every name has a wire enum value. A codec's
module is imported when it is first asked for, so only a process that meets a lossy codec
imports torch (``load`` imports some ahead, off an event loop).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ps.core.codecs.base import Codec, LossyCodec
from ps.core.config import CODEC_NAMES
from ps.core.errors import BadInput

if TYPE_CHECKING:
    from ps.core.codecs.feedback import ErrorFeedback, dgc_density

__all__ = ["Codec", "LossyCodec", "get_codec", "load", "unloaded", "CODEC_NAMES", "ErrorFeedback", "dgc_density"]

# name -> (module, class). A codec's module is imported the first time it is asked for: the
# lossless ones (fp32, fp32+zstd, rows) need numpy alone, the lossy ones torch, which costs a
# process ~2 s and ~180 MB, so a relay whose jobs are lossless never loads it.
_WHERE: dict[str, tuple[str, str]] = {
    "fp32": ("lossless", "Fp32"), "fp32+zstd": ("lossless", "Fp32Zstd"), "rows": ("rows", "Rows"),
    "fp16": ("half", "Fp16"), "bf16": ("half", "Bf16"), "int8": ("int8", "Int8"), "int4": ("int4", "Int4"),
    "topk": ("topk", "TopK"), "sign": ("sign", "Sign"), "powersgd": ("powersgd", "PowerSGD"),
}
assert set(_WHERE) == set(CODEC_NAMES), "every codec name the configuration allows needs a codec"
_CLASSES: dict[str, type[Codec]] = {}
_REGISTRY: dict[str, Codec] = {}
_loading = threading.RLock()  # a codec's module may ask for another as it loads


def _class(name: str) -> type[Codec]:
    cls = _CLASSES.get(name)
    if cls is None:
        where = _WHERE.get(name)
        if where is None:
            raise BadInput(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}")
        with _loading:
            cls = getattr(importlib.import_module(f"ps.core.codecs.{where[0]}"), where[1])
            assert cls.name == name, (cls, name)
            _REGISTRY.setdefault(name, cls())
            _CLASSES[name] = cls
    return cls


# The lossless codecs need numpy alone: loaded now, so that only a lossy one ever waits on the lock.
for _name in ("fp32", "fp32+zstd", "rows"):
    _class(_name)


def load(names: Iterable[str]) -> None:
    """Import the codecs named (and torch, for a lossy one) now: for a caller that must not
    import them later on its event loop. Unknown names raise BadInput."""
    for name in names:
        _class(name)


def unloaded(names: Iterable[str]) -> frozenset[str]:
    """The codecs named that are known but not imported yet (what ``load`` would import)."""
    return frozenset(n for n in names if n not in _CLASSES and n in _WHERE)


def __getattr__(name: str) -> Any:
    """The error-feedback helpers (``__all__``), imported on first use."""
    if name in ("ErrorFeedback", "dgc_density"):
        return getattr(importlib.import_module("ps.core.codecs.feedback"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_codec(name: str, **options: Any) -> Codec:
    """The codec registered under ``name``, or a fresh one built with ``options``.

        get_codec("int8")                # the shared default instance
        get_codec("topk", k=0.001)       # options: topk (k, seed), int8 and int4 (chunk, seed), fp32+zstd (level),
                                         # rows (width), powersgd (rank, width, seed)
    """
    cls = _class(name)
    if not options:
        return _REGISTRY[name]
    accepted = getattr(cls, "options", ())
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes none"
        raise BadInput(f"codec {name!r} has no option {', '.join(map(repr, unknown))}; {takes}")
    return cls(**options)
