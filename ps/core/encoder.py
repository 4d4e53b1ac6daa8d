"""What one sender keeps for one edge: codec, density warm-up, error feedback, rows (pure).

>>> from ps.core.view import KeySpec
>>> layout = Layout([KeySpec("fc.weight", (100, 10))])
>>> enc = Encoder("topk", topk=0.01, warmup_steps=100, seed="w0")
>>> import torch
>>> grad = torch.randn(layout.numel)             # numpy, or torch on the training device
>>> chunks = enc.split(layout, grad, step=7)     # density 25% during the warm-up
>>> [(c.key, c.offset) for c in chunks]
[('fc.weight', 0)]
>>> {k: v.shape for k, v in enc.state_dict().items()}   # residuals survive a restart
{'fc.weight@0': (1000,)}

A worker's push edge and each relay's upward edge own one (design invariant 6). Lossy codecs
always run under error feedback; with ``momentum`` (DGC's momentum correction) the sender also
keeps the velocity it sparsifies; with powersgd it keeps each matrix's Q, the warm start of
its next power iteration (as torch's ``PowerSGDState`` does). Lossless codecs send row-sparse
keys as rows. An encoder of a lossless codec fed numpy (a relay's) needs no torch.
"""

from __future__ import annotations

import threading
import zlib
from typing import TYPE_CHECKING, cast

import numpy as np
import xxhash

from ps.core.codecs import Codec, get_codec
from ps.core.codecs._host import is_tensor
from ps.core.codecs.feedback import ErrorFeedback, dgc_density
from ps.core.config import JobConfig
from ps.core.errors import BadInput
from ps.core.tensors import CHUNK_ELEMS, Chunk, row_width, split
from ps.core.view import Layout

if TYPE_CHECKING:  # the lossy codecs' state is torch's; imported where it is used
    import torch

    from ps.core.codecs.powersgd import PowerSGD
    from ps.core.codecs.topk import TopK

__all__ = ["Encoder", "row_sparse_keys", "input_print"]

_PROBE_ROWS = 64  # rows sampled to rule out a row-sparse gradient cheaply
_STATE_PREFIXES = ("velocity:", "powersgd_q:")  # state_dict entries that are not residuals


def row_sparse_keys(layout: Layout, flat: np.ndarray | torch.Tensor, max_fraction: float = 0.5,
                    only: frozenset[str] | None = None) -> frozenset[str]:
    """Keys of two or more dimensions whose gradient touches at most ``max_fraction`` of the rows
    (``only``: of these keys alone).

    An embedding table's gradient touches only the rows of the batch's tokens; sending those
    rows (with their indices) instead of the table is lossless and often 10-1000x smaller.
    """
    tensor = is_tensor(flat)
    if tensor:
        import torch  # loaded already: flat is a tensor
    out = []
    for spec in layout:
        width = row_width(spec)
        if (only is not None and spec.key not in only) or len(spec.shape) < 2 or spec.shape[0] < 2 \
                or not 1 <= width <= CHUNK_ELEMS:  # (a row of 0 elements: a key of no elements)
            continue
        base, rows = layout.offset(spec.key), spec.shape[0]
        # A dense gradient is the common case: rule it out from a few evenly spaced rows
        # instead of a full pass over (maybe hundreds of MB of) gradient.
        probing = rows > 4 * _PROBE_ROWS
        if tensor:  # on the tensor's device
            table = cast("torch.Tensor", flat)[base: base + spec.numel].view(rows, width)
            if probing:
                # In integers: float32's linspace rounds rows - 1 up to rows past 2**24 rows.
                probe = torch.arange(_PROBE_ROWS, device=table.device) * (rows - 1) // (_PROBE_ROWS - 1)
                if int((table.index_select(0, probe) != 0).any(dim=1).sum()) > 0.9 * _PROBE_ROWS:
                    continue
            touched = int((table != 0).any(dim=1).sum())
        else:
            host = np.asarray(flat)[base: base + spec.numel].reshape(rows, width)
            if probing:
                probe_np = np.arange(_PROBE_ROWS, dtype=np.int64) * (rows - 1) // (_PROBE_ROWS - 1)
                if int(np.count_nonzero((host[probe_np] != 0).any(axis=1))) > 0.9 * _PROBE_ROWS:
                    continue
            touched = int(np.count_nonzero((host != 0).any(axis=1)))
        if touched <= max_fraction * rows:
            out.append(spec.key)
    return frozenset(out)


class Encoder:
    """One sender's state for one edge: codec, density warm-up, error-feedback residuals.

        enc = Encoder("topk", topk=0.01, warmup_steps=400, seed="w0")
        chunks = enc.split(layout, grad, step=clock)      # grad: numpy, or torch on its device
        ckpt["encoder"] = enc.state_dict()                # residuals survive a restart

    Lossy codecs always run under error feedback: what one step does not send is added to the
    next (the worker, each relay that re-encodes an aggregate; invariant 6). Lossless codecs
    send row-sparse keys as rows. ``seed`` (any string) makes each sender's sampling and
    stochastic rounding its own: workers with one seed would round the same way and their
    rounding errors would add up instead of cancelling.
    """

    def __init__(self, codec: str, topk: float = 0.01, warmup_steps: int = 0, seed: str | int = 0,
                 momentum: float = 0.0, rank: int = 4) -> None:
        seed = seed if isinstance(seed, int) else zlib.crc32(seed.encode())
        self.name, self.topk, self.warmup_steps = codec, topk, warmup_steps
        options: dict[str, float] = ({"k": topk, "seed": seed} if codec == "topk" else
                                     {"rank": rank, "seed": seed} if codec == "powersgd" else
                                     {"seed": seed} if codec in ("int8", "int4") else {})
        self.codec = get_codec(codec, **options)
        self.ef = ErrorFeedback()
        if momentum and codec != "topk":
            raise BadInput(f"momentum correction sparsifies the velocity: it needs topk, not {codec!r}")
        self.momentum = momentum
        self.velocity: dict[str, torch.Tensor] = {}  # DGC: u = m u + g per chunk, masked when sent
        self.warm: dict[str, torch.Tensor] = {}      # powersgd: each chunk's last Q (cols x r)
        # One encode at a time, and a reset never in the middle of one: async senders encode
        # several pushes from threads, and a root restart resets from another thread.
        self._lock = threading.Lock()
        # begin(): each chunk's state as it was before its first encode since, for roll_back().
        self._undo: dict[str, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]] | None = None
        # set_aside(): the undo of a push sent and unanswered, until settle() says its fate.
        self._aside: dict[str, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]] | None = None

    @classmethod
    def for_job(cls, cfg: JobConfig, codec: str | None = None, seed: str | int = 0,
                worker: bool = False) -> Encoder:
        """The encoder a job's sender uses: workers of a momentum-corrected job keep the momentum."""
        momentum = cfg.optimizer.momentum if worker and cfg.momentum_correction else 0.0
        return cls(codec or cfg.push_codec, cfg.topk, cfg.topk_warmup_steps, seed, momentum,
                   cfg.powersgd_rank)

    def begin(self) -> None:
        """Start recording what encodes change (a push encoded piece by piece, which may be cut
        before it is whole): ``roll_back`` then puts every chunk's residual, velocity and Q back
        as they were here, ``commit`` keeps them. Costs a copy of each residual touched; none
        for a lossless codec without residuals."""
        with self._lock:
            self._undo = {}

    @property
    def recording(self) -> bool:
        """Between ``begin`` and ``commit`` or ``roll_back``."""
        return self._undo is not None

    def commit(self) -> None:
        with self._lock:
            self._undo = None

    def roll_back(self) -> None:
        """Undo every encode since ``begin`` (a push that was not sent whole)."""
        with self._lock:
            self._restore(self._undo or {})
            self._undo = None

    def set_aside(self) -> None:
        """End the recording without deciding: the push was sent and went unanswered, so the
        root may or may not have applied it. Its encodes stand until ``settle`` says which; the
        next encode before that keeps them (it builds on them: taking them back is no longer
        possible), as ``reset`` and ``load_state_dict`` drop them."""
        with self._lock:
            self._aside, self._undo = self._undo, None

    def settle(self, applied: bool) -> None:
        """The push set aside was applied (keep its encodes) or not (take them back: the
        residual still owes what it carried to earlier, acknowledged steps)."""
        with self._lock:
            aside, self._aside = self._aside, None
            if not applied and aside:
                self._restore(aside)

    def _restore(self, undo: dict) -> None:
        for name, (r, u, q) in undo.items():
            for store, value in ((self.ef.residuals, r), (self.velocity, u), (self.warm, q)):
                if value is None:
                    store.pop(name, None)
                else:
                    store[name] = value

    def _remember(self, name: str) -> None:
        self._aside = None  # an encode builds on what a push set aside did: it stands
        if self._undo is not None and name not in self._undo:
            def kept(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.clone()
            # Residuals and velocities change in place; a Q is replaced, never changed.
            self._undo[name] = (kept(self.ef.residuals.get(name)), kept(self.velocity.get(name)), self.warm.get(name))

    def _encode(self, name: str, codec: Codec, part: np.ndarray | torch.Tensor) -> bytes:
        import torch  # a lossy codec's: its module has loaded it

        self._remember(name)
        if codec.name == "powersgd":
            codec = cast("PowerSGD", codec)
            # Warm start: this step's power iteration begins at the Q the last one sent, which
            # tracks the gradient's slowly changing top subspace (Vogels et al. 2019, sec. 3).
            payload = self.ef.encode(name, codec.warm(self.warm.pop(name, None)), part)
            t = part if isinstance(part, torch.Tensor) else torch.from_numpy(np.asarray(part))
            # Contiguous, as a Q loaded from a checkpoint is: matmul takes another path for a
            # transposed view and rounds differently, so a resumed encoder drifted in the last bit.
            self.warm[name] = codec.factors(payload, t.numel(), t.device)[1].contiguous()
            return payload
        if not self.momentum:
            return self.ef.encode(name, codec, part)
        g = part if isinstance(part, torch.Tensor) else torch.from_numpy(np.asarray(part))
        u = self.velocity.get(name)
        # (a velocity loaded from a checkpoint lives on the host: moved to the gradient's device)
        u = g.to(torch.float32).clone() if u is None else u.to(g.device).mul_(self.momentum).add_(g)
        self.velocity[name] = u
        payload = self.ef.encode(name, codec, u)
        # Momentum factor masking (DGC): what was sent stops accumulating momentum here; the
        # root applies it once, without momentum of its own.
        idx, _ = cast("TopK", codec).decode_sparse(payload, u.numel(), u.device)
        u.index_fill_(0, idx, 0.0)
        return payload

    @property
    def lossless(self) -> bool:
        return self.codec.lossless

    def codec_at(self, step: int) -> Codec:
        """The codec for ``step``: top-k's density follows DGC's warm-up (25% down to topk)."""
        if self.name == "topk" and self.warmup_steps:
            return cast("TopK", self.codec).with_k(dgc_density(max(0, step), self.topk, self.warmup_steps))
        return self.codec

    def split(self, layout: Layout, flat: np.ndarray | torch.Tensor, step: int = 0,
              only: frozenset[str] | None = None, copy: bool = True) -> list[Chunk]:
        """``flat`` encoded as chunks; ``only``: just these keys (the others, and their
        residuals, are left for a later push); ``copy=False``: as ``ps.core.tensors.split``."""
        with self._lock:
            return self._split(layout, flat, step, only, copy)

    def _split(self, layout: Layout, flat: np.ndarray | torch.Tensor, step: int,
               only: frozenset[str] | None = None, copy: bool = True) -> list[Chunk]:
        if self.name == "rows":
            # Rows of at most a chunk, and of at least one element; other keys go as rows of one
            # element (as lossless): a (1, 2048, 1024) embedding's one row would not fit a frame.
            rows = frozenset(s.key for s in layout if 1 <= row_width(s) <= CHUNK_ELEMS)
        elif self.lossless:
            rows = row_sparse_keys(layout, flat, only=only)
        else:
            rows = frozenset()  # lossy codecs already send no zeros they need not (top-k) or pack them
        return split(layout, flat, self.codec_at(step), encode=None if self.lossless else self._encode, rows=rows,
                     only=only, copy=copy)

    def reset(self) -> None:
        """Drop every residual (a new lineage: the root restarted)."""
        with self._lock:
            self.ef.reset()
            self.velocity.clear()
            self.warm.clear()
            self._undo = None if self._undo is None else {}
            self._aside = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """Residuals by chunk ("key@offset") and, with momentum correction, velocities
        ("velocity:key@offset"), with powersgd each matrix's Q ("powersgd_q:key@offset", cols x
        r): float32 numpy arrays, safe to checkpoint."""
        state = self.ef.state_dict()
        state.update({f"velocity:{k}": u.detach().cpu().numpy().copy() for k, u in self.velocity.items()})
        state.update({f"powersgd_q:{k}": q.detach().cpu().numpy().copy() for k, q in self.warm.items()})
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace residuals, velocities and Qs; a Q whose shape no longer fits its matrix (the
        rank changed) is ignored there and the power iteration starts afresh."""
        def arrays(prefix: str, flat: bool) -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for k, v in state.items():
                a = np.array(v, np.float32, copy=True)
                if k.startswith(prefix) and (flat or a.ndim == 2):
                    import torch  # state of a lossy codec's sender

                    out[k[len(prefix):]] = torch.from_numpy(a.reshape(-1) if flat else a)
            return out

        residuals = {k: v for k, v in state.items() if not k.startswith(_STATE_PREFIXES)}
        velocity, warm = arrays("velocity:", flat=True), arrays("powersgd_q:", flat=False)
        with self._lock:
            # An encode recorded or set aside undoes onto residuals that are gone now: a roll
            # back after this would write the old ones over the loaded ones.
            self._undo = None if self._undo is None else {}
            self._aside = None
            self.ef.load_state_dict(residuals)
            self.velocity, self.warm = velocity, warm


def input_print(grad: np.ndarray | torch.Tensor, *fields: object) -> bytes:
    """What a push was made from: its gradient's bits (dtype and shape too) and ``fields``
    (its clocks, base version, ...), hashed (XXH3-128). A lossy encode of the same gradient
    differs from one push to the next (the residual moved), so a push sent again after its
    answer was lost is recognised by this, not by its bytes. Costs a copy of a device tensor
    to the host: asked for only on a fault's path."""
    if is_tensor(grad):
        import torch  # loaded already: grad is a tensor

        t = cast("torch.Tensor", grad).detach()
        head = repr((str(t.dtype).removeprefix("torch."), tuple(t.shape), fields))  # as numpy names it
        data = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    else:
        a = np.ascontiguousarray(grad)
        head = repr((str(a.dtype), tuple(a.shape), fields))
        data = a.reshape(-1).view(np.uint8)
    h = xxhash.xxh3_128(head.encode())
    h.update(memoryview(data))
    return h.digest()
