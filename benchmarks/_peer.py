"""One worker of benchmarks/bsp_vs_gloo.py: BSP steps of a fixed gradient, through hps or gloo.

    python benchmarks/_peer.py gloo --rank 0 --world 4 --port 29500 --params 4000000 --steps 20
    python benchmarks/_peer.py hps --address 127.0.0.1:7001 --worker-id w0 --params ... --codec topk

Prints one JSON line: the seconds of every step. A step is what each side needs to move from
version v to v+1 given this worker's gradient: gloo ``all_reduce`` (sum) then the local SGD
update; hps ``push`` (applied at the root once every worker's gradient is in) then ``pull``
of the new version (decoded, applied, checksum-verified). Gradients are the same in both:
normal random, scaled per worker, seeded by rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def gradient(params: int, rank: int, step: int) -> np.ndarray:
    g = np.random.default_rng(1000 * rank + step % 4).standard_normal(params, dtype=np.float32)
    return g * np.float32(1e-3)


def run_gloo(args) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    params = torch.zeros(args.params)
    grads = [torch.from_numpy(gradient(args.params, args.rank, s)) for s in range(4)]
    dist.barrier()
    times = []
    for step in range(args.steps):
        g = grads[step % 4].clone()
        t0 = time.perf_counter()
        dist.all_reduce(g)
        params.add_(g, alpha=-0.01)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    return times


def run_hps(args) -> list[float]:
    from ps.core.config import JobConfig, OptimizerConfig
    from ps.core.view import KeySpec, Layout
    from worker.sharded import connect

    layout = Layout([KeySpec(f"layer{i}.weight", (min(args.key_elems, args.params - off),))
                     for i, off in enumerate(range(0, args.params, args.key_elems))])
    job = JobConfig(name=f"bench-{args.codec}", optimizer=OptimizerConfig(kind="sgd", lr=0.01), push_codec=args.codec,
                    delta_codec=args.delta_codec or args.codec, topk=args.topk, delta_log_length=8)
    # One tier, or root shards separated by ';' (the job then placed over them by equal weights).
    c = connect(args.address, job.name, args.worker_id, timeout_s=120, round_timeout_s=300)
    grads = [gradient(args.params, args.rank, s) for s in range(4)]
    c.create_job(job, layout, np.zeros(args.params, np.float32))
    c.register()
    c.pull(min_version=c.start_version)
    times, up, down = [], 0, 0
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            version, nbytes = c.push(grads[step % 4])
            down += c.pull(min_version=version)
            up += nbytes
            times.append(time.perf_counter() - t0)
    finally:
        c.close()
    args.bytes = dict(up=up / args.steps, down=down / args.steps)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["gloo", "hps"])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--address", default="")
    p.add_argument("--worker-id", default="w0")
    p.add_argument("--params", type=int, default=4_000_000)
    p.add_argument("--key-elems", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--codec", default="fp32")
    p.add_argument("--delta-codec", default="")
    p.add_argument("--topk", type=float, default=0.01)
    args = p.parse_args()
    torch.set_num_threads(1)
    args.bytes = {}
    times = run_gloo(args) if args.kind == "gloo" else run_hps(args)
    print(json.dumps(dict(rank=args.rank, times=times, bytes=args.bytes)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
