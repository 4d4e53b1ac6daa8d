"""What staleness alone costs: the demo model trained in one process, no hps, with every gradient
computed on parameters D optimizer steps old (delayed SGD, what async is), beside bsp's
equivalent (a 4x larger batch, no delay).

    python benchmarks/delayed.py --steps 150

Same model, data, batches and Adam (3e-3, warm-up 20) as ``hps demo``: "bsp" takes steps of
4 x 16 sequences on the newest parameters; every other row takes 4 x steps single-batch
steps at lr x 1/4 (the root's per-sample scaling of a one-worker update), each gradient
computed on the parameters of D steps before. Async on 4 workers has D >= 3 by construction
(the other workers' steps while one computes); ``modes.py`` measures hps's actual staleness.
If hps's async loses about what this loses at that D, the loss is the algorithm's, not hps's.
Writes benchmarks/results/delayed.json.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ps.demo.corpus import BatchSampler, load_corpus  # noqa: E402
from ps.demo.model import ModelConfig, build_model  # noqa: E402
from ps.demo.train import _val_loss  # noqa: E402

LR, WARMUP, WORKERS = 3e-3, 20, 4


def train(steps: int, delay: int, group: int, beta1: float = 0.9) -> float:
    """``steps`` bsp-equivalent steps = WORKERS x steps batches of 16, applied ``group`` at a
    time (their mean, lr scaled by group / WORKERS) on parameters ``delay`` updates old."""
    cfg, data = ModelConfig(), load_corpus()
    model, stale = build_model(cfg, seed=0), build_model(cfg, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(beta1, 0.999))
    samplers = [BatchSampler(data, context=cfg.context, batch_size=16, seed=1000 + w) for w in range(WORKERS)]
    history = collections.deque([copy.deepcopy(model.state_dict())], maxlen=delay + 1)
    pending: list[list[torch.Tensor]] = []
    updates = 0
    for i in range(WORKERS * steps):
        stale.load_state_dict(history[0])  # the parameters ``delay`` updates ago
        stale.zero_grad()
        x, y = samplers[i % WORKERS].next_batch()
        stale(x, y)[1].backward()
        pending.append([p.grad.clone() for p in stale.parameters()])
        if len(pending) < group:
            continue
        for p, *grads in zip(model.parameters(), *pending):
            p.grad = torch.stack(grads).mean(0)
        for g in opt.param_groups:
            g["lr"] = LR * min(1.0, group / WORKERS) * min(1.0, (updates + 1) / WARMUP)
        opt.step()
        updates += 1
        pending.clear()
        history.append(copy.deepcopy(model.state_dict()))
    return _val_loss(model, data, cfg.context)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150, help="bsp-equivalent steps (the demo's default)")
    p.add_argument("--delays", default="0,3,5,8", help="delays (in single-batch updates) to train at")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "delayed.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    rows = {"bsp": dict(delay=0, group=WORKERS, val_loss=train(args.steps, 0, WORKERS))}
    print(f"bsp (4 x 16 per step, no delay)        val loss {rows['bsp']['val_loss']:.4f}", flush=True)
    for d in (int(x) for x in args.delays.split(",")):
        rows[f"delay {d}"] = dict(delay=d, group=1, val_loss=train(args.steps, d, 1))
        print(f"delay {d:2d} (1 x 16 per update, lr / 4)   val loss {rows[f'delay {d}']['val_loss']:.4f}", flush=True)
    base = rows["bsp"]["val_loss"]
    for r in rows.values():
        r["val_loss_vs_bsp_pct"] = 100.0 * (r["val_loss"] - base) / base
    result = dict(benchmark="delayed", machine=dict(platform=platform.platform(), cores=os.cpu_count(),
                                                    python=platform.python_version()),
                  settings=dict(steps=args.steps, workers=WORKERS, optimizer=f"adam {LR}, warm-up {WARMUP}",
                                batch=16, seconds=round(time.monotonic() - t0, 1)),
                  rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\n{'row':10s} {'val loss':>9s} {'vs bsp':>8s}")
    for name, r in rows.items():
        print(f"{name:10s} {r['val_loss']:9.4f} {r['val_loss_vs_bsp_pct']:+7.2f}%")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
