"""What recording an encode costs a lossy relay: ``Encoder.begin()`` before each forward (bsp,
ssp, outer syncs) copies the error-feedback residual of every chunk it touches, so a refused
round can be rolled back (ps/tiers/relay.py). Side by side in one process, alternating.

    python benchmarks/encode_recording.py            # ~1 minute on 2 cores

Rows: top-k 1% and int8 over 4M and 25M float32 values (4 keys), each the median of --reps
encodes per round over --rounds alternating rounds of plain and recorded encodes (the encoder
already holds residuals). Run it with the allocator ``hps launch`` gives servers
(``ps.tools.launch.MALLOC_ENV``) to see what a relay sees; it sets that for itself unless the
environment has it. Writes benchmarks/results/encode_recording.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import write

from ps.tools.launch import MALLOC_ENV


def _row(codec: str, n: int, args) -> dict:
    import numpy as np
    import torch

    from ps.core.encoder import Encoder
    from ps.core.view import KeySpec, Layout

    torch.set_num_threads(1)  # as hps launch runs tiers
    layout = Layout([KeySpec(f"k{i}", (n // 4,)) for i in range(4)])
    g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for recorded in (False, True):
            enc = Encoder(codec, topk=0.01)
            enc.split(layout, g, copy=False)  # residuals exist, as at a relay after its first round
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                if recorded:
                    enc.begin()
                enc.split(layout, g, copy=False)
                if recorded:
                    enc.commit()
                ts.append(time.perf_counter() - t0)
            times[recorded].append(statistics.median(ts))
    plain, rec = statistics.median(times[False]), statistics.median(times[True])
    return dict(codec=codec, values=n, plain_ms=round(1000 * plain, 1), recorded_ms=round(1000 * rec, 1),
                ratio=round(rec / plain, 3))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4000000,25000000")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out")
    args = p.parse_args()
    if any(k not in os.environ for k in MALLOC_ENV):  # glibc reads these at start: run again with them
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    rows = [_row(codec, int(n), args) for n in args.sizes.split(",") for codec in ("topk", "int8")]
    for r in rows:
        print(f"{r['codec']:5s} {r['values'] / 1e6:4.0f}M: plain {r['plain_ms']:7.1f} ms, recorded "
              f"{r['recorded_ms']:7.1f} ms ({r['ratio']:.2f}x)", flush=True)
    write("encode_recording", dict(settings={**vars(args), "malloc": MALLOC_ENV}, rows=rows), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
