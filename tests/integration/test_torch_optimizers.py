"""Invariant 2 with any torch.optim class (issue 13): 2 workers in BSP through root -> zone,
pushing their gradients with ParameterClient, reach the parameters of one process training on
the concatenated batch with the same class and param groups (AdamW, RMSprop; two groups)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from ps.core.config import JobConfig, OptimizerConfig, ParamGroup
from ps.core.optim import group_defaults, group_index, optimizer_class
from ps.core.view import KeySpec, Layout
from worker import ParameterClient

STEPS, WORKERS, PER_WORKER = 20, 2, 8
CONFIGS = {
    "adamw": OptimizerConfig(kind="adamw", lr=0.01, weight_decay=0.1, warmup_steps=3,
                             groups=(ParamGroup(("*.bias",), (("weight_decay", 0.0),)),)),
    "rmsprop": OptimizerConfig(kind="RMSprop", lr=0.005, momentum=0.5, options=(("alpha", 0.95),),
                               groups=(ParamGroup(("2.*",), (("lr", 0.002),)),)),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, WORKERS * PER_WORKER, 12, generator=g), torch.randint(0, 3, (STEPS, WORKERS * PER_WORKER),
                                                                                 generator=g)


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def _reference(cfg: OptimizerConfig) -> np.ndarray:
    model, (x, y) = _model(), _data()
    names = [n for n, _ in model.named_parameters()]
    params, gi, defaults = dict(model.named_parameters()), group_index(cfg, names), group_defaults(cfg)
    opt = optimizer_class(cfg.kind)([{"params": [params[n] for n, g in zip(names, gi) if g == i], **d}
                                     for i, d in enumerate(defaults)])
    for s in range(STEPS):
        for group, d in zip(opt.param_groups, defaults):  # the root's warm-up
            w = cfg.warmup_steps
            group["lr"] = d["lr"] * (s + 1) / w if w and s < w else d["lr"]
        opt.zero_grad()
        _loss(model, x[s], y[s]).backward()
        opt.step()
    return np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_workers_with_param_groups_match_one_process(tree, name):
    cfg = CONFIGS[name]
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    model0 = _model()
    layout = Layout([KeySpec(n, tuple(p.shape)) for n, p in model0.named_parameters()])
    init = np.concatenate([p.detach().numpy().ravel() for p in model0.parameters()])
    clients = [ParameterClient(zone, "j", f"w{i}", timeout_s=10) for i in range(WORKERS)]
    clients[0].create_job(JobConfig(name="j", optimizer=cfg), layout, init)
    for c in clients:
        c.register()
        c.pull()
    x, y = _data()
    models = [_model() for _ in range(WORKERS)]
    errors: list[Exception] = []

    def run(i: int) -> None:
        try:
            model, c = models[i], clients[i]
            for s in range(STEPS):
                with torch.no_grad():  # the published view this worker holds
                    torch.nn.utils.vector_to_parameters(torch.from_numpy(c.view.values.copy()), model.parameters())
                model.zero_grad()
                sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
                _loss(model, x[s, sl], y[s, sl]).backward()
                grad = torch.cat([p.grad.ravel() for p in model.parameters()]).numpy()
                v, _ = c.push(grad, clock=s)
                c.pull(min_version=v)
        except Exception as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(WORKERS)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    want = _reference(cfg)
    assert np.abs(want - init).max() > 1e-3  # training moved the parameters
    for c in clients:
        got = c.view.values
        assert c.view.version == STEPS
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= 1e-6, f"relative difference {rel:.2e}"
        c.close()
    # Without the groups, the same run ends elsewhere: the groups are what made it equal.
    plain = _reference(OptimizerConfig(kind=cfg.kind, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                       warmup_steps=cfg.warmup_steps, options=cfg.options))
    assert np.linalg.norm(plain - want) / np.linalg.norm(want) > 1e-4
