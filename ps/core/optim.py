"""Server-side optimizers as state objects (pure; only the root holds one).

>>> params = np.ones(3, np.float32)      # the job's flat float32 vector
>>> opt = ServerOptimizer(OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9), params)
>>> opt.step(np.array([1, 2, 3], np.float32))
>>> params                              # updated in place
array([0.9, 0.8, 0.7], dtype=float32)
>>> sorted(opt.state_dict())            # numpy arrays + counters: what a checkpoint saves
['state.momentum_buffer', 'steps']

The arithmetic is torch.optim's own, run on a tensor that shares memory with the numpy
vector: the root then matches a single process using torch.optim to fp32 rounding
(invariant 2), and torch's kernels are multi-threaded where numpy's are not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ps.core.config import OptimizerConfig
from ps.core.types import StepInfo

__all__ = ["ServerOptimizer", "lr_at", "group_index", "group_defaults", "flat_hparams"]


def lr_at(cfg: OptimizerConfig, step: int) -> float:
    """Learning rate for 0-based ``step``: linear warm-up to ``cfg.lr`` over warmup_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


class ServerOptimizer:
    """One job's optimizer over its flat parameter vector."""

    def __init__(self, cfg: OptimizerConfig, params: np.ndarray) -> None:
        if params.dtype != np.float32 or params.ndim != 1:
            raise ValueError("params must be a flat float32 vector")
        self.cfg = cfg
        self.steps = 0
        self._p = torch.from_numpy(params)  # shares memory: params change in place
        self._grad = self._p.grad = torch.zeros_like(self._p)
        self._saved: dict[str, torch.Tensor] | None = None  # save_point's buffers
        self._saved_steps = 0
        self._opt: torch.optim.Optimizer
        if cfg.kind == "sgd":
            self._opt = torch.optim.SGD([self._p], lr=cfg.lr, momentum=cfg.momentum,
                                        nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
        else:
            self._opt = torch.optim.Adam([self._p], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                         eps=cfg.eps, weight_decay=cfg.weight_decay)

    def step(self, grad: np.ndarray, lr_scale: float = 1.0, step: StepInfo | None = None) -> None:
        """Apply one aggregated (already averaged) gradient; ``lr_scale`` damps stale ones.
        ``step.skip``: a contribution overflowed (AMP); nothing changes, as on one device."""
        if step is not None and step.skip:
            return
        if grad.shape != self._p.shape:
            raise ValueError(f"gradient has {grad.size} elements, parameters {self._p.numel()}")
        self._grad.copy_(torch.from_numpy(grad))
        for group in self._opt.param_groups:
            group["lr"] = lr_at(self.cfg, self.steps) * lr_scale
        self._opt.step()
        self.steps += 1

    def save_point(self) -> None:
        """Remember the parameters and the optimizer's state, so ``roll_back`` can undo the next
        step exactly (a root that keeps no log refuses a step whose output is not finite). The
        buffers are kept and reused: allocating them per step faulted every page in again."""
        state = self._opt.state.get(self._p, {})
        saved = self._saved
        if saved is None or saved.keys() != {"params", *state}:
            saved = self._saved = {"params": self._p.detach().clone(),
                                   **{k: v.detach().clone() for k, v in state.items()}}
        else:
            saved["params"].copy_(self._p.detach())
            for k, v in state.items():
                saved[k].copy_(v)
        self._saved_steps = self.steps

    def roll_back(self) -> None:
        """Undo every step since ``save_point``."""
        assert self._saved is not None, "roll_back without a save_point"
        with torch.no_grad():
            self._p.copy_(self._saved["params"])
        state = {k: v.clone() for k, v in self._saved.items() if k != "params"}
        if state:
            self._opt.state[self._p] = state
        else:
            self._opt.state.pop(self._p, None)
        self.steps = self._saved_steps

    def state_dict(self) -> dict[str, np.ndarray | int]:
        out: dict[str, np.ndarray | int] = {"steps": self.steps}
        for name, value in self._opt.state.get(self._p, {}).items():
            out[f"state.{name}"] = value.detach().cpu().numpy().copy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray | int]) -> None:
        self.steps = int(state["steps"])
        inner = {k[len("state."):]: torch.from_numpy(np.array(v)) for k, v in state.items()
                 if k.startswith("state.")}
        if inner:
            self._opt.state[self._p] = inner


# -- the job's param groups as a worker's torch optimizer mirrors them ----------------------
# (provisional: the single-group form until the root runs any torch optimizer with groups)

def group_index(cfg: OptimizerConfig, names: Sequence[str]) -> list[int]:
    """The param group of each parameter name (one group: every name in group 0)."""
    return [0 for _ in names]


def group_defaults(cfg: OptimizerConfig) -> list[dict[str, Any]]:
    """Each group's hyperparameters as torch's class holds them in ``param_groups`` (no params)."""
    probe = ServerOptimizer(cfg, np.zeros(1, np.float32))
    return [{k: v for k, v in g.items() if k != "params"} for g in probe._opt.param_groups]


def flat_hparams(group: Mapping[str, Any]) -> dict[str, float]:
    """A group's numeric hyperparameters as the wire carries them: scalars by name, tuples as
    ``name_0``, ``name_1`` (Adam's betas); booleans and None are structure, not schedule."""
    out: dict[str, float] = {}
    for k, v in group.items():
        if k == "params" or isinstance(v, bool) or v is None:
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = float(v)
        if isinstance(v, (int, float)):
            out[k] = float(v)
        elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out.update({f"{k}_{i}": float(x) for i, x in enumerate(v)})
    return out
