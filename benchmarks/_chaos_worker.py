"""One worker of benchmarks/chaos.py: a small MLP on synthetic data trained through hps in BSP
until the job reaches --versions, printing one JSON line per event on stdout.

    python benchmarks/_chaos_worker.py --address 127.0.0.1:7001 --worker-id w0 --index 0 \
        --seed 0 --versions 300

Deterministic given the seed: the data set is fixed (a random teacher network, its own seed),
the model's initial values come from --seed, and the batch a worker computes on version v is
drawn from (seed, index, v) -- so a worker killed and started again resumes on the server's
parameters with the batch it would have used, and a faulted run differs from the fault-free
run of the same seed only by the steps the faults lost.

Events (``t`` is time.time(), so the driver puts every process on one clock):
  start  registered and holding the job's view (incarnation, version); with --wait-go it then
         waits for a line on stdin
  send   a gradient computed on ``base`` is being pushed as ``seq`` of this incarnation
  ack    push ``seq`` acknowledged as applied in ``version``
  stale  push ``seq`` refused as not applied (its round closed without it)
  done   the job reached --versions: final version, checksum and held-out loss
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import Stale
from worker import HpsOptimizer

DATA_SEED = 12345
TRAIN, HELD_OUT, BATCH = 65536, 2048, 32
JOB = JobConfig(name="chaos", mode="bsp", optimizer=OptimizerConfig(kind="sgd", lr=0.03, momentum=0.9))


def dataset() -> tuple[torch.Tensor, ...]:
    """Inputs N(0, 1)^32, labels the argmax of a fixed random 32-64-10 tanh network."""
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(TRAIN + HELD_OUT, 32, generator=g)
    w1, w2 = torch.randn(32, 64, generator=g), torch.randn(64, 10, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def batch_index(seed: int, index: int, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + index * 100_003 + version)
    return torch.randint(0, TRAIN, (BATCH,), generator=g)


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--index", type=int, required=True, help="this worker's share of the data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--versions", type=int, default=300, help="train until the job holds this version")
    p.add_argument("--wait-go", action="store_true",
                   help="after registering, wait for a line on stdin before the first step (the first "
                        "workers start together, so no early round closes with fewer of them)")
    args = p.parse_args()
    torch.set_num_threads(1)
    xt, yt, xv, yv = dataset()
    model = build_model(args.seed)
    me = args.worker_id
    with HpsOptimizer(model, args.address, JOB, worker_id=me, round_timeout_s=600) as opt:
        client = opt.client
        _emit(event="start", worker=me, inc=client.incarnation, pid=os.getpid(), version=opt.version,
              t=time.time())
        if args.wait_go:
            sys.stdin.readline()
        push = client.push

        def logged_push(grad, *a, **kw):
            # bsp pushes one at a time: the number is the next after the last acknowledged
            # (a push refused as not applied gives its number to the next gradient).
            seq = client.acked_seq + 1
            _emit(event="send", worker=me, inc=client.incarnation, seq=seq, base=client.view.version,
                  t=time.time())
            try:
                version, nbytes = push(grad, *a, **kw)
            except Stale as exc:
                _emit(event="stale", worker=me, inc=client.incarnation, seq=seq, wait=exc.wait_version,
                      t=time.time())
                raise
            _emit(event="ack", worker=me, inc=client.incarnation, seq=seq, version=version, t=time.time())
            return version, nbytes
        client.push = logged_push
        while opt.version < args.versions:
            idx = batch_index(args.seed, args.index, opt.version)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step(loss=loss)
        with torch.no_grad():
            held_out = torch.nn.functional.cross_entropy(model(xv), yv).item()
        _emit(event="done", worker=me, inc=client.incarnation, version=opt.version,
              crc=client.view.checksum, loss=held_out, lost_steps=client.lost_steps, t=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
