"""A training process over leased data shards, for the fault tests: parameter i counts how
often sample i's gradient was applied (the gradient of a batch is minus its one-hot). Prints
one JSON line per step, then {"done": true}."""

import argparse
import json
import time

import numpy as np

from ps.core.config import JobConfig, OptimizerConfig, OuterConfig
from ps.core.errors import Stale
from ps.core.types import StepInfo
from ps.core.view import KeySpec, Layout
from worker import ParameterClient
from worker.sampler import LeasedSampler

p = argparse.ArgumentParser()
p.add_argument("--address", required=True)
p.add_argument("--worker-id", required=True)
p.add_argument("--samples", type=int, default=96)
p.add_argument("--shard-size", type=int, default=16)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--lease-timeout", type=float, default=2.0)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--wait-workers", type=int, default=1)
p.add_argument("--outer", type=int, default=0, help="an outer job syncing every this many inner steps "
               "(lossless, outer SGD lr 1: the root's deltas still count the applied one-hots)")
p.add_argument("--asynchronous", action="store_true", help="--outer: the regions do not wait for each other")
args = p.parse_args()

N = args.samples
SGD = OptimizerConfig(kind="sgd", lr=1.0)
JOB = JobConfig(name="data", optimizer=SGD, delta_log_length=10_000)
if args.outer:
    JOB = JobConfig(name="data", mode="outer", optimizer=SGD, delta_log_length=10_000,
                    outer=OuterConfig(inner_steps=args.outer, codec="fp32", delta_codec="fp32", optimizer=SGD,
                                      asynchronous=args.asynchronous))
client = ParameterClient(args.address, "data", args.worker_id, timeout_s=10, round_timeout_s=60)
client.create_job(JOB, Layout([KeySpec("counts", (N,))]), np.zeros(N, np.float32))
client.register()
client.pull()
info = client.wait_workers(args.wait_workers, timeout_s=60)
print(json.dumps(dict(rank=info.rank, world=info.world_size)), flush=True)


def push(grad: np.ndarray, step: StepInfo, contributors: int = 1) -> int:
    while True:
        try:
            version, _ = client.push(grad, step=step, contributors=contributors)
            client.pull(min_version=version)
            return version
        except Stale:  # not applied (its round was abandoned): the same batch again
            client.pull()


def idle() -> None:
    """bsp: every shard left is someone else's; an empty contribution keeps their rounds going
    (no gradient in it, as HpsOptimizer.idle sends)."""
    push(np.zeros(N, np.float32), StepInfo(), contributors=0)


sampler = LeasedSampler(client, N, args.batch, shard_size=args.shard_size, seed=7, idle=idle,
                        lease_timeout_s=args.lease_timeout)
sampler.set_epoch(0)
for batch in sampler:
    grad = np.zeros(N, np.float32)
    grad[batch] = -1.0
    progress = sampler.step_progress()
    version = push(grad, StepInfo(progress=progress))
    print(json.dumps(dict(batch=batch, progress=progress, version=version)), flush=True)
    time.sleep(args.sleep)
client.close()
print(json.dumps(dict(done=True)), flush=True)
