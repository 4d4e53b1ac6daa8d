"""The hps worker library: what a training script imports.

    from worker import HpsOptimizer, JobConfig, OptimizerConfig
    opt = HpsOptimizer(model, "zone-eu-a:7001", JobConfig(name="lm", optimizer=OptimizerConfig(lr=0.1)))
    for x, y in batches:
        opt.zero_grad(); model(x, y)[1].backward(); opt.step()

``ParameterClient`` is the lower level (push/pull) for people who want control.
"""

from ps.core.config import JobConfig, OptimizerConfig
from worker.client import ParameterClient, StepResult
from worker.optimizer import HpsOptimizer

__all__ = ["HpsOptimizer", "ParameterClient", "StepResult", "JobConfig", "OptimizerConfig"]
