"""One BSP training process for benchmarks/failover.py: prints a JSON line per step.

    python benchmarks/_failover_worker.py ADDRESS WORKER_ID STEPS
"""

import json
import sys
import time

import torch

from ps.core.config import JobConfig, OptimizerConfig
from worker import HpsOptimizer

address, wid, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
x, y = torch.randn(16, 8), torch.randn(16, 2)
job = JobConfig(name="failover", optimizer=OptimizerConfig(kind="sgd", lr=0.05))
with HpsOptimizer(model, address, job, worker_id=wid, round_timeout_s=120) as opt:
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        r = opt.step()
        print(json.dumps(dict(step=step, version=r.version, applied=r.applied, t=time.time())), flush=True)
