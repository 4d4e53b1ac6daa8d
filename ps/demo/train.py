"""One demo worker process: trains TinyLM through hps and reports JSON lines on stdout.

    python -m ps.demo.train --address 127.0.0.1:7001 --worker-id w0 --seed 0 --steps 100

Every worker builds the same initial model (seed 0); the first to arrive creates the job with
it, the others start from the published snapshot. Each worker samples its own batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

import torch

from ps.core.config import JobConfig, OptimizerConfig, OuterConfig
from ps.demo.budget import StepBudget
from ps.demo.corpus import BatchSampler, load_corpus
from ps.demo.model import ModelConfig, build_model
from worker import HpsOptimizer

__all__ = ["demo_job", "main"]


def demo_job(name: str = "demo", mode: str = "bsp", staleness: int = 0, codec: str = "fp32",
             topk: float = 0.01, delta_codec: str = "fp32", damping: bool = False,
             inner_steps: int = 10) -> JobConfig:
    """The demo's job; ``codec`` is the push codec of workers and relays (lossy ones with
    error feedback at every tier).

    top-k follows Deep Gradient Compression's recipe: SGD with momentum whose momentum the
    workers keep and sparsify (momentum correction), and a density warm-up over 20 steps.
    Adam at the root with top-1% pushes measured ~30% worse after 150 steps (the sparse,
    stale sums defeat its per-coordinate normalisation); the other codecs keep Adam.

    outer (DiLoCo): AdamW inner steps at each regional master, every ``inner_steps`` an outer
    Nesterov step at the root on int8 pseudo-gradients; ``codec`` stays inside the regions.
    """
    if mode == "outer":
        return JobConfig(name=name, mode=mode, optimizer=OptimizerConfig(kind="adamw", lr=3e-3, warmup_steps=20),
                         push_codec=codec, topk=topk, delta_codec=delta_codec,
                         outer=OuterConfig(inner_steps=inner_steps))
    if codec == "topk":
        return JobConfig(name=name, mode=mode, staleness=staleness if mode == "ssp" else 0,
                         optimizer=OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9, warmup_steps=20),
                         push_codec=codec, topk=topk, topk_warmup_steps=20, momentum_correction=True,
                         delta_codec=delta_codec, damping=damping)
    return JobConfig(name=name, mode=mode, staleness=staleness if mode == "ssp" else 0,
                     optimizer=OptimizerConfig(kind="adam", lr=3e-3, warmup_steps=20), push_codec=codec,
                     delta_codec=delta_codec, damping=damping)


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


@torch.no_grad()
def _val_loss(model, data, context: int, batches: int = 8) -> float:
    sampler = BatchSampler(data, context=context, batch_size=16, seed=1234, split="val")
    losses = [model(*sampler.next_batch())[1].item() for _ in range(batches)]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--job", default="demo")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=100, help="steps of this worker (at most, with --budget)")
    p.add_argument("--budget", help="a step pool shared with the other workers (ps.demo.budget): "
                                    "claim each step from it, stop when it is empty")
    p.add_argument("--budget-total", type=int, default=0, help="the pool's size, in steps")
    p.add_argument("--budget-parties", type=int, default=1,
                   help="workers sharing the pool: the first step waits until all are up")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mode", default="bsp", choices=["bsp", "ssp", "async", "outer"])
    p.add_argument("--inner-steps", type=int, default=10, help="--mode outer: inner steps between syncs")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--codec", default="fp32", help="push codec (e.g. topk, fp16, int8, sign)")
    p.add_argument("--topk", type=float, default=0.01, help="density of --codec topk")
    p.add_argument("--delta-codec", default="fp32", help="the root's codec for published deltas")
    p.add_argument("--slow", type=float, default=1.0,
                   help="emulate a slower accelerator: each step's compute takes this many times longer")
    p.add_argument("--damping", action="store_true", help="ssp/async: the root scales lr by 1/(1+staleness)")
    p.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by this much")
    args = p.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    torch.set_num_threads(1)  # several workers share a small machine
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

    cfg = ModelConfig()
    data = load_corpus()
    model = build_model(cfg, seed=0)
    sampler = BatchSampler(data, context=cfg.context, batch_size=args.batch, seed=1000 + args.seed)
    budget = StepBudget(args.budget, args.budget_total) if args.budget else None
    job = demo_job(args.job, args.mode, args.staleness, args.codec, args.topk, args.delta_codec, args.damping,
                   args.inner_steps)
    with HpsOptimizer(model, args.address, job, worker_id=args.worker_id) as opt:
        if budget is not None and not budget.start_together(args.budget_parties):
            print(f"{args.worker_id}: not every worker came up within the wait; starting anyway",
                  file=sys.stderr, flush=True)
        _emit(event="start", worker=args.worker_id, version=opt.version,
              params=sum(p.numel() for p in model.parameters()), t=time.time())
        for step in range(args.steps):
            if stop or (budget is not None and not budget.claim()):
                break
            t0 = time.perf_counter()
            x, y = sampler.next_batch()
            opt.zero_grad()
            loss = model(x, y)[1]
            loss.backward()
            if args.slow > 1.0:  # a slower device: the same work, stretched
                time.sleep((args.slow - 1.0) * (time.perf_counter() - t0))
            r = opt.step(loss=loss)  # the loss travels with the push: every tier exports it
            _emit(event="step", worker=args.worker_id, step=step, loss=loss.item(), version=r.version,
                  applied=r.applied, bytes_up=r.bytes_up, bytes_down=r.bytes_down,
                  step_s=time.perf_counter() - t0)
        opt.sync()  # ssp/async: every gradient applied, the newest parameters loaded
        synced = time.time()
        val = _val_loss(model, data, cfg.context)
        _emit(event="done", worker=args.worker_id, version=opt.version, checksum=opt.client.view.checksum,
              val_loss=val if math.isfinite(val) else None, lost_steps=opt.client.lost_steps, t=synced)
    return 0


if __name__ == "__main__":
    sys.exit(main())
