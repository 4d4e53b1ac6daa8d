"""Server-side optimizers as state objects (pure; only the root holds one).

>>> params = np.ones(3, np.float32)      # the job's flat float32 vector
>>> opt = ServerOptimizer(OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9), params)
>>> opt.step(np.array([1, 2, 3], np.float32))
>>> params                              # updated in place
array([0.9, 0.8, 0.7], dtype=float32)
>>> sorted(opt.state_dict())            # numpy arrays + counters: what a checkpoint saves
['state.0.momentum_buffer', 'steps']

Any torch.optim class, with param groups chosen by name, on a layout of named keys:

>>> layout = Layout([KeySpec("fc.weight", (2,)), KeySpec("fc.bias", (1,)), KeySpec("bn.mean", (1,), kind="buffer")])
>>> cfg = OptimizerConfig(kind="adamw", lr=0.1, groups=(ParamGroup(("*.bias",), (("weight_decay", 0.0),)),))
>>> group_index(cfg, ["fc.weight", "fc.bias"]), [g["weight_decay"] for g in group_defaults(cfg)]
([0, 1], [0.01, 0.0])
>>> flat_hparams(group_defaults(cfg)[0])["betas_1"]
0.999
>>> params = np.array([1, 1, 1, 5], np.float32)
>>> opt = ServerOptimizer(cfg, params, layout)
>>> step = StepInfo(hparams=((1, "lr", 0.5),), absent=(0,), buffers=1)   # fc.weight: no gradient
>>> opt.step(np.array([1, 1, 1, 3], np.float32), step=step, contributors=2)
>>> params.round(6)                     # bias: one AdamW step of lr 0.5; mean: 3 * 2 / 1
array([1. , 1. , 0.5, 6. ], dtype=float32)

Every key is a torch tensor that is a view into the flat vector, so torch's per-parameter
semantics (a step count per tensor, a key without gradient left alone, weight decay per group)
are those of one process holding the model: the root matches a single process using the same
torch.optim class to fp32 rounding (invariant 2).
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ps.core.config import OptimizerConfig, ParamGroup
from ps.core.errors import BadInput, short
from ps.core.sharding import base_key
from ps.core.types import StepInfo
from ps.core.view import KeySpec, Layout

__all__ = ["ServerOptimizer", "lr_at", "optimizer_class", "check_config", "group_index",
           "group_defaults", "flat_hparams", "apply_hparams", "torch_kwargs", "warm_up"]

# What the root cannot run: it steps once per aggregated gradient, with no loss to re-evaluate.
_REFUSED = {"lbfgs": "needs a closure that re-evaluates the loss, which only a worker can run; the root "
                     "steps once per aggregated gradient",
            "sparseadam": "needs sparse gradients; the root holds dense ones (use adam or adamw)"}
_FLAT = (("momentum", "momentum"), ("nesterov", "nesterov"), ("weight_decay", "weight_decay"), ("eps", "eps"))
_INDEXED = re.compile(r"^(.+)_(\d)$")


def warm_up() -> None:
    """Build one throwaway torch optimizer. The first one a process builds imports torch._dynamo
    (1.1 s measured on the dev machine); a root that did so on its event loop at its first
    CreateJob stalled long enough for its standby to take over (a false takeover, seen in CI)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


@functools.cache
def _classes() -> dict[str, type[torch.optim.Optimizer]]:
    return {name.lower(): cls for name, cls in vars(torch.optim).items()
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}


def optimizer_class(kind: str) -> type[torch.optim.Optimizer]:
    """The torch.optim class named ``kind`` (any case), or BadInput saying why not."""
    key = kind.lower()
    if key in _REFUSED:
        raise BadInput(f"optimizer {kind!r} {_REFUSED[key]}; choose another torch.optim class")
    cls = _classes().get(key)
    if cls is None:
        names = ", ".join(sorted(k for k in _classes() if k not in _REFUSED))
        raise BadInput(f"optimizer {short(kind)} is not a torch.optim class; one of {names}")
    return cls


def _accepted(cls: type) -> list[str]:
    return [n for n, p in inspect.signature(cls).parameters.items()
            if n != "params" and p.kind is not p.VAR_KEYWORD]


def torch_kwargs(cfg: OptimizerConfig, strict: bool = False) -> dict[str, Any]:
    """The keyword arguments the class is built with: lr, the flat fields changed from their
    defaults that the class takes (``strict``: a changed one it does not take is BadInput),
    then ``options``."""
    cls = optimizer_class(cfg.kind)
    accepted = _accepted(cls)
    defaults = OptimizerConfig.__dataclass_fields__
    out: dict[str, Any] = {"lr": cfg.lr}
    changed = [(key, getattr(cfg, f)) for f, key in _FLAT if getattr(cfg, f) != defaults[f].default]
    if (cfg.beta1, cfg.beta2) != (defaults["beta1"].default, defaults["beta2"].default):
        changed.append(("betas", (cfg.beta1, cfg.beta2)))
    for key, value in changed:
        if key in accepted:
            out[key] = value
        elif strict:
            raise BadInput(f"optimizer {cls.__name__} takes no {key} (set to {value}); its options: "
                           f"{', '.join(accepted)}")
    for name, value in cfg.options:
        if name not in accepted:
            raise BadInput(f"optimizer {cls.__name__} takes no option {name!r}; its options: {', '.join(accepted)}")
        out[name] = value
    return out


def _build(cfg: OptimizerConfig, groups: Sequence[list[torch.Tensor]],
           fuse: bool = False) -> tuple[torch.optim.Optimizer, bool]:
    """The torch optimizer over ``groups`` (group 0 first), or BadInput with torch's reason; and
    whether it was made ``fused`` here (``fuse`` asks for it where ``fuses`` allows: a fused
    step of the configuration ran there), not by the job's own options."""
    cls = optimizer_class(cfg.kind)
    kwargs = torch_kwargs(cfg, strict=not cfg.plain)
    accepted = _accepted(cls)
    for g in cfg.groups:
        for name, _ in g.options:
            if name not in accepted:  # torch keeps unknown group keys silently: a typo would do nothing
                raise BadInput(f"param group {','.join(g.match)}: optimizer {cls.__name__} takes no option "
                               f"{name!r}; its options: {', '.join(accepted)}")
    extra: dict[str, Any] = {"fused": True} if fuse and fuses(cfg) else {}
    try:
        return cls(_spec(cfg, groups), **kwargs, **extra), bool(extra)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise BadInput(f"optimizer {cls.__name__}({_describe(kwargs)}) refused its configuration: {exc}") from None


def _spec(cfg: OptimizerConfig, groups: Sequence[list[torch.Tensor]]) -> list[dict[str, Any]]:
    """torch's param groups: group 0 (the job's defaults), then each ParamGroup's tensors and options."""
    return [{"params": groups[0]}] + [{"params": groups[i + 1], **dict(g.options)} for i, g in enumerate(cfg.groups)]


def _step_once(opt: torch.optim.Optimizer, groups: Sequence[list[torch.Tensor]]) -> None:
    """One step of ``opt`` over ``_dummies``' tensors, to see whether torch runs it."""
    for g in groups:
        g[0].grad = torch.ones_like(g[0])
    opt.step()


# torch.optim classes with a fused CPU kernel (torch 2.13): one pass over the vector per step.
_FUSED = frozenset({"Adam", "AdamW", "SGD", "Adagrad"})


@functools.lru_cache(maxsize=64)
def fuses(cfg: OptimizerConfig) -> bool:
    """Whether the root builds the job's optimizer with ``fused=True``: torch has a fused CPU
    kernel for the class, the job chose neither ``fused`` nor ``foreach`` itself (options or a
    group's), the step is not plain SGD without momentum, which reads the caller's gradient
    where it lies in one pass already (``ServerOptimizer._reads_only``; with momentum the
    fused kernel reads it where it lies too), and a fused step of the configuration runs (on
    dummy tensors). Only the root's step is fused: the job's param groups as scripts
    and ``group_defaults`` see them, and exported optimizer state, are the job's own.

    Measured at 100M parameters, one thread: Adam 866 ms a step unfused (torch's per-tensor
    loop on CPU), 626 with foreach, 89 fused; SGD with momentum 105 against 58. The fused step
    agrees with the unfused one to fp32 rounding (Adam, 1,000 values, 50 steps: at most 1.2e-7
    apart), which is what invariant 2 promises against one process; it is deterministic, so
    replay, standbys and restarts stay bit for bit.

    >>> fuses(OptimizerConfig(kind="adamw")), fuses(OptimizerConfig(kind="sgd", lr=0.1))
    (True, False)
    >>> fuses(OptimizerConfig(kind="adam", options=(("foreach", True),)))
    False
    """
    cls = optimizer_class(cfg.kind)
    if cls.__name__ not in _FUSED or "fused" not in _accepted(cls):
        return False
    chosen = {name for name, _ in cfg.options} | {name for g in cfg.groups for name, _ in g.options}
    if chosen & {"fused", "foreach"} or (_reads_only(cfg) and not cfg.momentum):
        return False
    groups = _dummies(cfg)
    try:
        kwargs: dict[str, Any] = {**torch_kwargs(cfg), "fused": True}
        _step_once(cls(_spec(cfg, groups), **kwargs), groups)
    except (ValueError, TypeError, RuntimeError, AssertionError):  # a setting the fused kernel refuses
        return False
    return True


def _reads_only(cfg: OptimizerConfig) -> bool:
    """Plain SGD only reads the gradient, so it may read the caller's array where it lies: a
    400 MB copy less per version at 100M parameters. Not so with nesterov (torch 2.13's foreach
    path, the GPU default, adds the momentum into the gradient in place) nor with root clipping
    (it scales the gradient in place); nor options (maximize) or groups."""
    return (cfg.kind == "sgd" and not cfg.nesterov and cfg.clip_grad_norm == 0
            and not cfg.options and not cfg.groups)


def _describe(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _dummies(cfg: OptimizerConfig) -> list[list[torch.Tensor]]:
    return [[torch.zeros(2, 2)] for _ in range(1 + len(cfg.groups))]  # 2-D: Muon takes matrices only


def check_config(cfg: OptimizerConfig) -> None:
    """BadInput unless torch builds ``cfg``'s optimizer and steps it once (on a dummy tensor)."""
    groups = _dummies(cfg)
    opt, _ = _build(cfg, groups)
    try:
        _step_once(opt, groups)
    except (ValueError, TypeError, RuntimeError, AssertionError) as exc:  # capturable=True: an assert
        raise BadInput(f"optimizer {type(opt).__name__} cannot step with this configuration: {exc}") from None


@functools.lru_cache(maxsize=64)
def _group_defaults(cfg: OptimizerConfig) -> tuple[tuple[tuple[str, Any], ...], ...]:
    opt, _ = _build(cfg, _dummies(cfg))
    return tuple(tuple((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups)


def group_defaults(cfg: OptimizerConfig) -> list[dict[str, Any]]:
    """Per param group, what torch's class holds in ``param_groups[i]`` (minus "params"):
    torch's defaults, the configuration's flat fields and options, each group's overrides."""
    return [dict(g) for g in _group_defaults(cfg)]


def group_index(cfg: OptimizerConfig | Sequence[ParamGroup], names: Sequence[str]) -> list[int]:
    """The param group of each parameter name: 1 + the first group with a matching pattern, else 0."""
    groups = cfg.groups if isinstance(cfg, OptimizerConfig) else cfg
    out = []
    for name in names:
        out.append(next((i + 1 for i, g in enumerate(groups) if any(fnmatch.fnmatchcase(name, m) for m in g.match)),
                        0))
    return out


def flat_hparams(group: dict[str, Any]) -> dict[str, float]:
    """The numeric hyperparameters of a param group, as the wire carries them: float and int
    scalars (not bools) by name, tuples element-wise as ``name_0``, ``name_1`` (``betas``)."""
    out: dict[str, float] = {}
    for name, value in group.items():
        if name == "params" or isinstance(value, bool):
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)):
            out[name] = float(value)
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{name}_{i}"] = float(v)
    return out


def apply_hparams(group: dict[str, Any], flat: dict[str, float], where: str = "param group") -> None:
    """The inverse of ``flat_hparams``, in place: each (name, value) sets the group's scalar or
    the tuple element it names (an int stays an int). BadInput for a name the group does not
    hold as a number, or a value that is not finite."""
    for name, value in flat.items():
        if not math.isfinite(value):
            raise BadInput(f"{where}: hyperparameter {name} must be finite, got {value}")
        current = group.get(name)
        if isinstance(current, (int, float)) and not isinstance(current, bool):
            group[name] = int(value) if isinstance(current, int) and float(value).is_integer() else float(value)
            continue
        m = _INDEXED.match(name)
        tup, i = (group.get(m.group(1)), int(m.group(2))) if m else (None, 0)
        if m and isinstance(tup, tuple) and i < len(tup) and isinstance(tup[i], (int, float)):
            group[m.group(1)] = tup[:i] + (float(value),) + tup[i + 1:]
            continue
        raise BadInput(f"{where}: the job's optimizer has no numeric hyperparameter {short(name)}")


def lr_at(cfg: OptimizerConfig, step: int, lr: float | None = None) -> float:
    """Learning rate for 0-based ``step``: linear warm-up to ``lr`` (``cfg.lr``) over warmup_steps."""
    lr = cfg.lr if lr is None else lr
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return lr * (step + 1) / cfg.warmup_steps
    return lr


class ServerOptimizer:
    """One job's optimizer over its flat parameter vector, one torch tensor per layout key.

    Only "param" keys are optimized, each in its group; "frozen" keys never change; "buffer"
    keys take the average of the values the pushes carried (``StepInfo.buffers`` of them).
    """

    def __init__(self, cfg: OptimizerConfig, params: np.ndarray, layout: Layout | None = None) -> None:
        if params.dtype != np.float32 or params.ndim != 1:
            raise ValueError("params must be a flat float32 vector")
        if layout is None:
            layout = Layout([KeySpec("params", (params.size,))])
        if layout.numel != params.size:
            raise ValueError(f"params has {params.size} elements, the layout {layout.numel}")
        self.cfg, self.layout, self.params = cfg, layout, params
        self.steps = 0
        self._flat = torch.from_numpy(params)  # shares memory: params change in place
        self._gflat = torch.zeros_like(self._flat)
        self._keys: list[int] = []                 # layout indices of the trained keys
        self._p: dict[int, torch.Tensor] = {}      # layout index -> view of params
        self._g: dict[int, torch.Tensor] = {}      # layout index -> view of the gradient
        self._buffers: list[tuple[int, int]] = []  # (offset, numel) of buffer keys
        self._spans: dict[int, tuple[int, int]] = {}  # layout index -> (offset, numel) of a trained key
        off = 0
        for i, s in enumerate(layout):
            if s.kind == "param":
                self._keys.append(i)
                self._spans[i] = (off, s.numel)
                self._p[i] = self._flat[off:off + s.numel].view(s.shape)
                self._g[i] = self._gflat[off:off + s.numel].view(s.shape)
                self._p[i].grad = self._g[i]
            elif s.kind == "buffer":
                self._buffers.append((off, s.numel))
            off += s.numel
        # a root shard's blocks (emb#3) belong to their tensor's group
        gi = group_index(cfg, [base_key(layout.specs[i].key) for i in self._keys])
        self._group_of = dict(zip(self._keys, gi))
        groups: list[list[torch.Tensor]] = [[] for _ in range(1 + len(cfg.groups))]
        for i, g in zip(self._keys, gi):
            groups[g].append(self._p[i])
        self._opt, self._fused = _build(cfg, groups, fuse=True)
        # Per step every group starts from these (a push's hparams hold for its own step only).
        self._configured = [{k: v for k, v in g.items() if k != "params"} for g in self._opt.param_groups]
        self._reads_only = _reads_only(cfg)
        self._saved_params: np.ndarray | None = None  # save_point's copy
        self._saved: dict[int, dict[str, torch.Tensor]] = {}
        self._saved_steps = 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer (its tensors are views into the flat vector)."""
        return self._opt

    def step(self, grad: np.ndarray, lr_scale: float = 1.0, step: StepInfo | None = None,
             contributors: int = 1) -> None:
        """Apply one aggregated (already averaged over ``contributors``) gradient; ``lr_scale``
        damps stale ones. ``step.skip``: a contribution overflowed (AMP); nothing changes, as on
        one device. ``step.absent``: keys without a gradient, left alone by torch.
        ``step.hparams``: this step's hyperparameters per group (then lr *= lr_scale).
        Buffer keys' slices of ``grad`` hold sum(values) / contributors: their average is that
        times contributors / step.buffers, set when any push carried them."""
        if step is not None and step.skip:
            return
        if grad.shape != self._flat.shape:
            raise ValueError(f"gradient has {grad.size} elements, parameters {self._flat.numel()}")
        overrides = self._overrides(step)
        absent = set(step.absent) if step is not None else set()
        borrowed = self._reads_only and grad.dtype == np.float32 and grad.flags.c_contiguous and grad.flags.writeable
        if borrowed:  # the caller's gradient, read where it lies (never written: see _reads_only)
            gflat = torch.from_numpy(grad)
            for i in self._keys:
                off, n = self._spans[i]
                self._p[i].grad = None if i in absent else gflat[off:off + n].view(self._p[i].shape)
        else:
            self._gflat.copy_(torch.from_numpy(grad))
            for i in self._keys:
                self._p[i].grad = None if i in absent else self._g[i]
        for g, (group, base) in enumerate(zip(self._opt.param_groups, self._configured)):
            group.update(base)
            over = overrides.get(g, {})
            apply_hparams(group, over, f"param group {g}")
            if "lr" not in over:
                group["lr"] = lr_at(self.cfg, self.steps, base["lr"])
            group["lr"] = group["lr"] * lr_scale
        if self.cfg.clip_grad_norm > 0:
            with_grad = [self._p[i] for i in self._keys if i not in absent]
            if with_grad:
                torch.nn.utils.clip_grad_norm_(with_grad, self.cfg.clip_grad_norm)
        try:
            if self._keys:
                self._opt.step()
        finally:
            if borrowed:  # hold no reference to the caller's array past the step
                for i in self._keys:
                    self._p[i].grad = None
        self._set_buffers(grad, step, contributors)
        self.steps += 1

    def _set_buffers(self, grad: np.ndarray, step: StepInfo | None, contributors: int) -> None:
        """Buffer keys take the average of the values the pushes that carried them sent."""
        if step is not None and step.buffers > 0 and self._buffers:
            for off, n in self._buffers:
                avg = grad[off:off + n]
                if contributors != step.buffers:
                    avg = avg * np.float32(contributors / step.buffers)
                self.params[off:off + n] = avg

    def _overrides(self, step: StepInfo | None) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for g, name, value in (step.hparams if step is not None else ()):
            if not 0 <= g < len(self._configured):
                raise BadInput(f"a push set hyperparameter {short(name)} of param group {g}; the job has "
                               f"{len(self._configured)} group(s)")
            out.setdefault(g, {})[name] = value
        return out

    # -- state ------------------------------------------------------------------------------
    def save_point(self) -> None:
        """Remember the parameters and the optimizer's state, so ``roll_back`` can undo the next
        step exactly (a root that keeps no log refuses a step whose output is not finite). The
        buffers are kept and reused: allocating them per step faulted every page in again."""
        if self._saved_params is None:
            self._saved_params = self.params.copy()
        else:
            np.copyto(self._saved_params, self.params)
        saved: dict[int, dict[str, torch.Tensor]] = {}
        for i in self._keys:
            state = self._opt.state.get(self._p[i])
            if not state:
                continue
            old = self._saved.get(i, {})
            saved[i] = {k: old[k].copy_(v) if k in old and old[k].shape == v.shape and old[k].dtype == v.dtype
                        else v.detach().clone() for k, v in state.items()}
        self._saved = saved
        self._saved_steps = self.steps

    def roll_back(self) -> None:
        """Undo every step since ``save_point``."""
        assert self._saved_params is not None, "roll_back without a save_point"
        np.copyto(self.params, self._saved_params)
        for i in self._keys:
            if i in self._saved:
                self._opt.state[self._p[i]] = {k: v.clone() for k, v in self._saved[i].items()}
            else:
                self._opt.state.pop(self._p[i], None)
        self.steps = self._saved_steps

    def state_dict(self) -> dict[str, np.ndarray | int]:
        """``steps`` and ``state.<layout index>.<name>`` arrays (what a checkpoint saves)."""
        out: dict[str, np.ndarray | int] = {"steps": self.steps}
        for i in self._keys:
            for name, value in self._opt.state.get(self._p[i], {}).items():
                out[f"state.{i}.{name}"] = _array(value)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray | int]) -> None:
        """What ``state_dict`` gave. Checkpoints from before per-key state (one flat
        ``state.<name>`` per name) load too: flat arrays are sliced by key, scalars copied."""
        self.steps = int(state["steps"])
        per: dict[int, dict[str, torch.Tensor]] = {}
        offsets = {i: self.layout.offset(self.layout.specs[i].key) for i in self._keys}
        for k, v in state.items():
            if not k.startswith("state."):
                continue
            arr = np.array(v)
            head, _, name = k[len("state."):].partition(".")
            if name and head.isdigit():
                i = int(head)
                if i not in self._p or (arr.ndim and not _fits(arr.shape, tuple(self._p[i].shape))):
                    raise ValueError(f"optimizer state {k} of shape {arr.shape} does not fit a trained key")
                per.setdefault(i, {})[name] = torch.from_numpy(arr)
                continue
            name = k[len("state."):]  # the flat layout: one array for the whole vector
            for i in self._keys:
                if arr.ndim == 0:
                    part = arr.copy()
                elif arr.size == self.layout.numel:
                    part = arr[offsets[i]:offsets[i] + self._p[i].numel()].reshape(tuple(self._p[i].shape)).copy()
                else:
                    raise ValueError(f"optimizer state {k} has {arr.size} elements, parameters {self.layout.numel}")
                per.setdefault(i, {})[name] = torch.from_numpy(part)
        for i in self._keys:
            if i in per:
                self._opt.state[self._p[i]] = per[i]
            else:
                self._opt.state.pop(self._p[i], None)

    def torch_state_dict(self) -> dict[str, Any]:
        """The optimizer's state as ``torch.optim.Optimizer.state_dict()`` shapes it: state by
        the trained keys' ordinal in layout order, each group with its configured values and the
        ordinals of its keys (load it into the class built over the model's trained parameters,
        grouped the same way)."""
        ordinal = {i: n for n, i in enumerate(self._keys)}
        state = {ordinal[i]: {k: v.detach().clone() for k, v in self._opt.state[self._p[i]].items()}
                 for i in self._keys if self._opt.state.get(self._p[i])}
        groups = [{**base, "params": [ordinal[i] for i in self._keys if self._group_of[i] == g]}
                  for g, base in enumerate(self._configured)]
        if self._fused:  # the root's choice, not the job's: a script's own optimizer keeps its kernel
            for g in groups:
                g["fused"] = None
        return {"state": state, "param_groups": groups}


def _fits(state: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """A state array's shape against its parameter's: the same, or that shape with some sizes
    1 (factored second moments: Adafactor keeps (m, 1) and (1, n) for an (m, n) weight)."""
    return len(state) == len(param) and all(s in (p, 1) for s, p in zip(state, param))


def _array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return np.asarray(value)
