"""The root's outer optimizer for asynchronous outer steps (pure): delayed Nesterov, a
``ServerOptimizer`` whose momentum moves once per round of regions (``OuterConfig.nesterov_delay``).
"""

from __future__ import annotations

import numpy as np
import torch

from ps.core.config import OptimizerConfig
from ps.core.errors import BadInput
from ps.core.optim import ServerOptimizer, apply_hparams, lr_at
from ps.core.types import StepInfo
from ps.core.view import Layout

__all__ = ["DelayedNesterov"]


class DelayedNesterov(ServerOptimizer):
    """SGD with Nesterov momentum whose momentum moves once every ``delay`` steps (asynchronous
    outer steps: one step per region's update, ``delay`` = the regions; after Async Local-SGD's
    delayed Nesterov, Liu et al. 2024). Each step applies its own gradient at once,
    ``p -= lr * g``, and adds it to a sum ``d``; every ``delay``-th step
    ``m = momentum * m + d`` (``m = d`` the first time) and ``p -= lr * momentum * m``. Over
    ``delay`` steps that is ``p -= lr * (d + momentum * m)``: torch's Nesterov SGD step on their
    sum, so one update from each region makes one synchronous outer step.

        >>> from ps.core.config import OptimizerConfig
        >>> p = np.zeros(2, np.float32)
        >>> opt = DelayedNesterov(OptimizerConfig(kind="sgd", lr=1.0, momentum=0.5, nesterov=True), p, delay=2)
        >>> opt.step(np.array([1, 0], np.float32)); p.tolist()          # the gradient alone
        [-1.0, 0.0]
        >>> opt.step(np.array([0, 2], np.float32)); p.tolist()          # and the momentum: 0.5 * (1, 2)
        [-1.5, -3.0]

    ``m`` is the key's ``momentum_buffer`` (as torch's SGD keeps it) and ``d`` its
    ``delayed_sum``, in the optimizer's state: checkpoints, ``save_point`` and ``roll_back`` carry
    them, and the step count says where in the ``delay`` a step falls."""

    def __init__(self, cfg: OptimizerConfig, params: np.ndarray, layout: Layout | None = None,
                 delay: int = 1) -> None:
        if not (cfg.kind == "sgd" and cfg.momentum > 0 and cfg.nesterov and cfg.weight_decay == 0 and not cfg.options
                and not cfg.groups and cfg.clip_grad_norm == 0) or delay < 1:
            raise BadInput("delayed Nesterov needs SGD with momentum and nesterov, no weight decay, options, "
                           "groups or clipping, and a delay of at least 1")
        super().__init__(cfg, params, layout)
        self.delay = delay

    @torch.no_grad()
    def step(self, grad: np.ndarray, lr_scale: float = 1.0, step: StepInfo | None = None,
             contributors: int = 1) -> None:
        if step is not None and step.skip:
            return
        if grad.shape != self._flat.shape:
            raise ValueError(f"gradient has {grad.size} elements, parameters {self._flat.numel()}")
        group, base = self._opt.param_groups[0], self._configured[0]
        over = self._overrides(step).get(0, {})
        group.update(base)
        apply_hparams(group, over, "param group 0")  # refuses what SGD does not have, as any step does
        lr = float(group["lr"]) if "lr" in over else lr_at(self.cfg, self.steps, base["lr"])
        beta = float(group["momentum"])
        self._gflat.copy_(torch.from_numpy(grad))
        absent = set(step.absent) if step is not None else set()
        boundary = (self.steps + 1) % self.delay == 0
        for i in self._keys:
            p, state = self._p[i], self._opt.state[self._p[i]]
            if i not in absent:
                g = self._g[i] * lr_scale
                p.add_(g, alpha=-lr)
                if "delayed_sum" in state:
                    state["delayed_sum"].add_(g)
                else:
                    state["delayed_sum"] = g  # a fresh tensor (the product above)
            d = state.pop("delayed_sum", None) if boundary else None
            if d is not None:  # torch skips a key without a gradient: so does the momentum here
                buf = state.get("momentum_buffer")
                buf = d if buf is None else buf.mul_(beta).add_(d)
                state["momentum_buffer"] = buf
                p.add_(buf, alpha=-lr * beta)
        self._set_buffers(grad, step, contributors)
        self.steps += 1
