"""A tiny training process for fault tests: prints one JSON line per step."""

import argparse
import json
import time

import torch

from ps.core.config import JobConfig, OptimizerConfig
from worker import HpsOptimizer

p = argparse.ArgumentParser()
p.add_argument("--address", required=True)
p.add_argument("--worker-id", required=True)
p.add_argument("--steps", type=int, default=50)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
x, y = torch.randn(16, 8), torch.randn(16, 2)
job = JobConfig(name="t", optimizer=OptimizerConfig(kind="sgd", lr=0.05))
with HpsOptimizer(model, args.address, job, worker_id=args.worker_id, round_timeout_s=60) as opt:
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        r = opt.step()
        print(json.dumps(dict(step=step, version=r.version, applied=r.applied, loss=loss.item(),
                              epoch=opt.client.view.epoch, crc=opt.client.view.checksum,
                              view=opt.client.view.version, t=time.time())), flush=True)
        time.sleep(args.sleep)
