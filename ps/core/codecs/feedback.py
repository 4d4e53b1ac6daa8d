"""Error feedback: the state a lossy sender keeps so that compression loses nothing over time.

>>> import torch
>>> from ps.core.codecs import get_codec
>>> ef, codec, sent = ErrorFeedback(), get_codec("topk", k=0.01), torch.zeros(1000)
>>> grads = [torch.randn(1000) for _ in range(50)]
>>> for step, grad in enumerate(grads):
...     payload = ef.encode("fc.weight", codec.with_k(dgc_density(step, 0.01, 40)), grad)
...     sent += codec.decode_tensor(payload, 1000)      # what receivers add up
>>> torch.allclose(sent + ef.residuals["fc.weight"], sum(grads), atol=1e-4)   # nothing lost
True
>>> checkpoint = {"ef": ef.state_dict()}                # residuals survive a restart

Every encode computes y = x + residual, sends encode(y) and keeps residual = y - decode(payload),
decoding the payload itself exactly as receivers do. So the sum of everything decoded plus the
final residual equals the sum of the inputs (up to float32 rounding of the additions), which is
what makes top-k, sign and int8 converge (Seide et al. 2014; Karimireddy et al. 2019; Stich et
al. 2018). Design invariant 6: the worker, each relay that re-encodes, and the root each hold one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import numpy as np

from ps.core.codecs.base import Codec, LossyCodec
from ps.core.errors import BadInput

if TYPE_CHECKING:
    import torch

__all__ = ["ErrorFeedback", "dgc_density"]


class ErrorFeedback:
    """One float32 residual per key, on the device of that key's tensor (cf. PowerSGDState).

        ef = ErrorFeedback()
        payload = ef.encode("emb", get_codec("sign"), grad)      # grad: torch or numpy
        ef.residuals["emb"]                                       # what has not been sent yet

    Not thread-safe: each sender (a worker, a relay's aggregate, the root's view) owns one.
    """

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def encode(self, key: str, codec: Codec, x: np.ndarray | torch.Tensor) -> bytes:
        """The payload for x plus the key's residual; the residual becomes what was not sent."""
        from ps.core.codecs._common import as_tensor  # torch: imported on a sender's first encode

        x = as_tensor(x)
        r = self.residuals.pop(key, None)
        if r is None:
            if codec.lossless:
                return codec.encode(x)  # nothing owed and nothing to keep
            y = x.clone()
        else:
            if r.numel() != x.numel():
                raise BadInput(f"error feedback for key {key!r} holds {r.numel()} elements, "
                               f"the tensor has {x.numel()}; call reset({key!r}) if it changed")
            # In place: a fresh 64 MiB y per step costs more in page faults than the add.
            y = r.to(x.device).add_(x)
        if codec.lossless:
            return codec.encode(y)  # the whole residual goes out; none is left
        # If encoding fails the residual is dropped (popped above): losing it is benign, while
        # keeping y would count x twice when the caller retries.
        payload = codec.encode(y)
        cast(LossyCodec, codec).subtract_decoded_(y, payload)  # y becomes the new residual, in place
        self.residuals[key] = y
        return payload

    def reset(self, key: str | None = None) -> None:
        """Forget one key's residual (or all): the error it held is dropped, not sent."""
        if key is None:
            self.residuals.clear()
        else:
            self.residuals.pop(key, None)

    def state_dict(self) -> dict[str, np.ndarray]:
        """A snapshot: one float32 numpy array per key, safe to checkpoint."""
        return {k: r.detach().to("cpu").numpy().copy() for k, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace the residuals; each moves to its tensor's device on that key's next encode."""
        if not state:
            self.residuals = {}
            return
        import torch

        self.residuals = {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True).reshape(-1))
                          for k, v in state.items()}


def dgc_density(step: int, final: float, warmup_steps: int, start: float = 0.25,
                factor: float = 4.0) -> float:
    """Top-k density at ``step`` under Deep Gradient Compression's exponential warm-up.

    >>> [dgc_density(step, 0.001, 400) for step in (0, 100, 200, 300)]   # per 100 steps
    [0.25, 0.0625, 0.015625, 0.00390625]
    >>> dgc_density(400, 0.001, 400)   # from warmup_steps on
    0.001

    DGC (Lin et al. 2018, section 3.3) starts dense and divides the density by 4 in equal
    stages until it reaches the target, so early, fast-changing gradients are not starved.
    """
    if not 0 < final <= 1 or not 0 < start <= 1 or factor <= 1 or warmup_steps < 0 or step < 0:
        raise BadInput(f"dgc_density needs 0 < final={final} <= 1, 0 < start={start} <= 1, "
                       f"factor={factor} > 1, warmup_steps={warmup_steps} >= 0, step={step} >= 0")
    if step >= warmup_steps or final >= start:
        return final
    stages = math.ceil(math.log(start / final, factor) - 1e-9)  # divisions to reach final
    stage = step * stages // warmup_steps
    return max(final, start / factor ** stage)
