"""Invariant 2: 4 workers in BSP through root -> region -> zones reach the parameters of one
process training on the concatenated batch with the same optimizer (lossless codec)."""

from __future__ import annotations

import pytest
import torch

from ps.core.config import JobConfig, OptimizerConfig
from tests.helpers import mlp_batches, mlp_loss, small_mlp, train_mlp

STEPS, WORKERS, PER_WORKER = 20, 4, 8


def _model() -> torch.nn.Module:
    return small_mlp()


def _data():
    return mlp_batches(STEPS, WORKERS * PER_WORKER)


_loss = mlp_loss


def _reference(opt_cfg: OptimizerConfig) -> list[torch.Tensor]:
    model, (x, y) = _model(), _data()
    if opt_cfg.kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=opt_cfg.lr, momentum=opt_cfg.momentum,
                              nesterov=opt_cfg.nesterov, weight_decay=opt_cfg.weight_decay)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2),
                               eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay)
    for s in range(STEPS):
        for group in opt.param_groups:  # the same warm-up schedule as the root's
            w = opt_cfg.warmup_steps
            group["lr"] = opt_cfg.lr * (s + 1) / w if w and s < w else opt_cfg.lr
        opt.zero_grad()
        _loss(model, x[s], y[s]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("opt_cfg", [
    OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, warmup_steps=5),
    OptimizerConfig(kind="adam", lr=0.01, warmup_steps=5),
], ids=["sgd-nesterov", "adam"])
def test_four_workers_through_the_tree_match_one_process(tree, opt_cfg):
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    zones = [tree.add("eu-a", "zone", parent="eu"), tree.add("eu-b", "zone", parent="eu")]
    job = JobConfig(name="eq", optimizer=opt_cfg)
    results = train_mlp(zones, job, STEPS, WORKERS, PER_WORKER)
    ref = _reference(opt_cfg)
    start = [p.detach() for p in _model().parameters()]
    for i in range(WORKERS):
        for got, want, p0 in zip(results[i], ref, start):
            assert not torch.equal(want, p0)  # training moved the parameters
            rel = (got - want).norm() / want.norm()
            assert rel <= 1e-5, f"worker {i}: relative difference {rel:.2e}"
    # Every worker holds the same (published) parameters.
    for i in range(1, WORKERS):
        assert all(torch.equal(a, b) for a, b in zip(results[0], results[i]))
