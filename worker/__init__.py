"""The hps worker library: what a training script imports.

>>> import torch
>>> from worker import HpsOptimizer, JobConfig, OptimizerConfig
>>> model = torch.nn.Linear(4, 1)
>>> opt = HpsOptimizer(model, address, JobConfig(name="lm", optimizer=OptimizerConfig(lr=0.1)))
>>> for x, y in [(torch.ones(8, 4), torch.zeros(8, 1))] * 2:
...     opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
StepResult(version=1, applied=True, bytes_up=20, bytes_down=20)
StepResult(version=2, applied=True, bytes_up=20, bytes_down=20)
>>> opt.close()

``address`` is the worker's tier (``"zone-eu-a:7001"``). ``ParameterClient`` is the lower level
(push/pull) for people who want control. With mutual TLS, give ``tls=TlsFiles(cert, key, ca)``
or set ``HPS_TLS_CERT``, ``HPS_TLS_KEY``, ``HPS_TLS_CA``.
"""

from ps.core.config import JobConfig, OptimizerConfig, ParamGroup
from ps.net.tls import TlsFiles
from worker.client import ParameterClient, StepResult
from worker.optimizer import HpsOptimizer
from worker.sampler import LeasedSampler

__all__ = ["HpsOptimizer", "ParameterClient", "StepResult", "JobConfig", "OptimizerConfig", "ParamGroup",
           "LeasedSampler", "TlsFiles"]
