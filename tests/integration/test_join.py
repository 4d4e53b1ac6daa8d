"""Joining a running job: no initial values cross the network again, and a worker that asks
for another configuration is refused with a sentence."""

from __future__ import annotations

import pytest
import torch

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import Conflict
from worker import HpsOptimizer, ParameterClient


def test_a_joining_worker_sends_no_initial_values_and_starts_from_the_published_view(tree, monkeypatch):
    tree.add("root", "global")
    zone = tree.add("eu-a", "zone", parent="root")
    job = JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 2)
    creates = []
    real = ParameterClient.create_job
    monkeypatch.setattr(ParameterClient, "create_job",
                        lambda self, *a: creates.append(self.worker_id) or real(self, *a))
    with HpsOptimizer(first, zone, job, worker_id="w0") as a:
        torch.manual_seed(1)
        second = torch.nn.Linear(4, 2)  # other initial values: they must not matter
        with HpsOptimizer(second, zone, job, worker_id="w1") as b:
            assert creates == ["w0"]  # w1 joined without shipping its model
            assert b.client.view.checksum == a.client.view.checksum
            assert torch.equal(second.weight, first.weight)
        other = JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=0.2))
        with pytest.raises(Conflict, match="another configuration"):
            HpsOptimizer(torch.nn.Linear(4, 2), zone, other, worker_id="w2")
        # ... and it left again: it does not hold up the job's rounds
        assert "w2" not in tree.lt.call(lambda: tree.tier("eu-a").jobs["j"].members)
        first(torch.ones(1, 4)).sum().backward()
        assert a.step().applied
