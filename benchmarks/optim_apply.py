"""How fast the root applies an update (issue 18: "the root applies an SGD update of 100M
parameters at >= 4 GB/s of gradient; numpy's in-place add measured 16 GB/s here").

    python benchmarks/optim_apply.py                  # 100M parameters, 5 reps
    python benchmarks/optim_apply.py --numel 10000000 --reps 3

Each row times the root's own ``ps.core.optim.ServerOptimizer.step`` (what a version costs the
root besides the log and the publish: the gradient copied into the optimizer's buffer, torch's
step over one flat tensor per key) on a gradient of --numel float32, against numpy's in-place
add and axpy (``p -= lr * g``) on the same arrays, side by side in one run; medians of --reps
after one warm-up. GB/s counts the gradient's bytes (4 per parameter). One key (the whole
vector), one torch thread (`hps launch` runs tiers with OMP_NUM_THREADS=1). Nothing is asserted.
The root steps with torch's fused kernel where it has one (``ps.core.optim.fuses``); the
"unfused" rows set ``foreach=False`` as a job's option, which is how every step ran before.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from _common import write

from ps.core.config import OptimizerConfig
from ps.core.optim import ServerOptimizer

GOAL_GBPS = 4.0


def timed(fn, reps: int) -> float:
    fn()  # warm-up: first-touch page faults, torch's lazy state
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=100_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (hps launch: 1)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, gb = args.numel, 4 * args.numel / 1e9
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(n, dtype=np.float32)
    params = rng.standard_normal(n, dtype=np.float32)
    lr = np.float32(1e-3)
    rows: dict[str, float] = {}
    rows["numpy p += g"] = timed(lambda: np.add(params, grad, out=params), args.reps)
    scratch = np.empty_like(grad)

    def axpy() -> None:
        np.multiply(grad, lr, out=scratch)
        np.subtract(params, scratch, out=params)
    rows["numpy p -= lr * g"] = timed(axpy, args.reps)
    unfused = (("foreach", False),)  # the job's own choice: torch's per-tensor loop, as before
    for label, cfg in (("root sgd", OptimizerConfig(kind="sgd", lr=1e-3)),
                       ("root sgd momentum 0.9", OptimizerConfig(kind="sgd", lr=1e-3, momentum=0.9)),
                       ("root sgd momentum 0.9, unfused", OptimizerConfig(kind="sgd", lr=1e-3, momentum=0.9,
                                                                          options=unfused)),
                       ("root adam", OptimizerConfig(kind="adam", lr=1e-3)),
                       ("root adam, unfused", OptimizerConfig(kind="adam", lr=1e-3, options=unfused))):
        opt = ServerOptimizer(cfg, params)
        rows[label] = timed(lambda opt=opt: opt.step(grad), args.reps)
        del opt
    out = {k: dict(seconds=v, gbps=gb / v) for k, v in rows.items()}
    add = out["numpy p += g"]["gbps"]
    for k, v in out.items():
        v["vs_numpy_add"] = v["gbps"] / add
        goal = f"  (goal >= {GOAL_GBPS:g} GB/s: {'met' if v['gbps'] >= GOAL_GBPS else 'NOT met'})" \
            if k.startswith("root sgd") and "momentum" not in k else ""
        print(f"{k:24s} {1e3 * v['seconds']:8.1f} ms  {v['gbps']:6.2f} GB/s of gradient  "
              f"{v['vs_numpy_add']:.2f}x numpy's add{goal}", flush=True)
    write("optim_apply", dict(numel=n, reps=args.reps, torch_threads=args.threads, goal_gbps=GOAL_GBPS, rows=out),
          args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
