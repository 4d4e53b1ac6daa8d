"""One worker of ``overlap.py``: an MLP trained through hps in bsp, with or without
``overlap=True``; prints one JSON line with each measured step's times.

    python benchmarks/_overlap_worker.py ADDRESS JOB WORKER_ID OVERLAP STEPS WARMUP WIDTH DEPTH BATCH BUCKET_MB N

The step is timed from the forward's start to ``step()``'s return (forward, backward, the
push, the round, the pull), and backward on its own. One torch thread: the machine's two cores
are shared by the workers, the tiers and the link.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from _common import ROOT  # noqa: F401  (puts the project on the path)

from ps.core.config import JobConfig, OptimizerConfig
from worker import HpsOptimizer


def main() -> int:
    address, job, wid, overlap, steps, warmup, width, depth, batch, bucket_mb, n = sys.argv[1:12]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(int(depth)):
        layers += [torch.nn.Linear(int(width), int(width)), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(int(width), 10))
    g = torch.Generator().manual_seed(int(wid[-1]) if wid[-1].isdigit() else 0)
    x, y = torch.randn(int(batch), int(width), generator=g), torch.randint(0, 10, (int(batch),), generator=g)
    cfg = JobConfig(name=job, min_workers=int(n), optimizer=OptimizerConfig(kind="sgd", lr=0.01))
    steps_s, backward_s = [], []
    with HpsOptimizer(model, address, cfg, worker_id=wid, overlap=overlap == "1", bucket_mb=float(bucket_mb)) as opt:
        for s in range(int(warmup) + int(steps)):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            assert opt.step().applied
            t3 = time.perf_counter()
            if s >= int(warmup):
                steps_s.append(t3 - t0)
                backward_s.append(t2 - t1)
    print(json.dumps(dict(worker=wid, overlap=overlap == "1", steps_s=steps_s, backward_s=backward_s,
                          params=sum(p.numel() for p in model.parameters()))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
