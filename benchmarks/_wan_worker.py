"""One demo-model worker of benchmarks/wan_loss.py: trains TinyLM through hps with the job given
as JSON, printing one JSON line per step (wall-clock time, loss) and a final line.

    python benchmarks/_wan_worker.py --address 127.0.0.1:7001 --worker-id w0 --seed 0 --steps 100 \
        --job '{"name": "lm", "mode": "async", "push_codec": "topk"}'

The same as ``hps demo``'s worker (ps/demo/train.py: same model, data and batches; Adam 3e-3
with 20 warm-up steps unless --job names an "optimizer") except that the whole job comes from
--job, and time stamps are absolute (time.time()) so the driver can put every worker on one
clock.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ps.core.config import JobConfig, OptimizerConfig
from ps.demo.corpus import BatchSampler, load_corpus
from ps.demo.model import ModelConfig, build_model
from worker import HpsOptimizer


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


@torch.no_grad()
def _val_loss(model, data, context: int, batches: int = 8, split: str = "val") -> float:
    sampler = BatchSampler(data, context=context, batch_size=16, seed=1234, split=split)
    losses = [model(*sampler.next_batch())[1].item() for _ in range(batches)]
    return sum(losses) / len(losses)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--job", required=True, help="JobConfig fields as JSON (optimizer: Adam 3e-3, warm-up 20)")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="stop after this many seconds of training (0: run every step), whichever comes first")
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="compute this many times slower: sleep (slowdown - 1) x each step's forward and backward")
    args = p.parse_args()
    torch.set_num_threads(1)
    fields = json.loads(args.job)
    opt_fields = fields.pop("optimizer", None) or dict(kind="adam", lr=3e-3, warmup_steps=20)
    job = JobConfig(optimizer=OptimizerConfig(**opt_fields), **fields)
    cfg = ModelConfig()
    data = load_corpus()
    model = build_model(cfg, seed=0)
    sampler = BatchSampler(data, context=cfg.context, batch_size=args.batch, seed=1000 + args.seed)
    with HpsOptimizer(model, args.address, job, worker_id=args.worker_id, round_timeout_s=900) as opt:
        _emit(event="start", worker=args.worker_id, t=time.time())
        deadline = time.monotonic() + args.seconds if args.seconds > 0 else math.inf
        for step in range(args.steps):
            if time.monotonic() >= deadline:  # a time budget: a faster site gets more steps
                break
            x, y = sampler.next_batch()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = model(x, y)[1]
            loss.backward()
            if args.slowdown > 1.0:  # a slower site (a smaller GPU): the same work, taking longer
                time.sleep((args.slowdown - 1.0) * (time.perf_counter() - t0))
            r = opt.step()
            _emit(event="step", worker=args.worker_id, step=step, t=time.time(), loss=loss.item(),
                  version=r.version, bytes_up=r.bytes_up, bytes_down=r.bytes_down)
        before = _val_loss(model, data, cfg.context)  # on the last view trained on
        train_eval = _val_loss(model, data, cfg.context, split="train")
        opt.sync(timeout_s=300)
        val = _val_loss(model, data, cfg.context)
        _emit(event="done", worker=args.worker_id, t=time.time(), version=opt.version,
              val_loss=val if math.isfinite(val) else None, val_loss_before_sync=before,
              train_eval_before_sync=train_eval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
