"""Encode/decode time and wire bytes of every codec on one dense gradient, side by side.

    python benchmarks/codecs.py --numel 16777216 --runs 5

Reports (and writes benchmarks/results/codecs.json), for a normal random float32 gradient:
- every codec (powersgd at rank 4 on the gradient viewed as a near-square matrix; a random
  matrix is its worst case for accuracy, not for time or size): median encode and decode time
  over --runs, payload bytes, and how many times smaller than dense fp32 the payload is;
- top-k at --k under error feedback (``ErrorFeedback.encode``: residual add, sampled selection,
  zstd, and the residual update from the payload itself), at steady state (residual warm);
- the sampled top-k selection alone against ``torch.topk`` on the same tensor;
- the goals for top-k + error feedback + zstd next to the measured values. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ps.core.codecs import CODEC_NAMES, ErrorFeedback, get_codec  # noqa: E402
from ps.core.codecs.topk import select  # noqa: E402

GOAL_RATIO = 130.0     # top-k 1% + EF + zstd: at least this many times smaller than fp32
GOAL_ENCODE_MS = 25.0  # ... and encoded in at most this long (16M elements)


def _median_ms(fn, runs: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=16 * 1024 * 1024, help="gradient elements")
    p.add_argument("--runs", type=int, default=5, help="runs per figure (the median is reported)")
    p.add_argument("--k", type=float, default=0.01, help="top-k density")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "codecs.json"))
    args = p.parse_args()

    gen = torch.Generator().manual_seed(args.seed)
    grads = [torch.randn(args.numel, generator=gen) for _ in range(2)]
    x, dense = grads[0], 4 * args.numel
    rows = {}
    codecs = [(n, get_codec(n)) for n in CODEC_NAMES if n not in ("topk", "powersgd")]
    codecs.append((f"topk {args.k:g}", get_codec("topk", k=args.k)))
    # powersgd factors a matrix: the gradient as a square-ish one (a 16M vector: 4096 x 4096)
    width = next(w for w in range(int(args.numel ** 0.5), 0, -1) if args.numel % w == 0)
    codecs.append((f"powersgd 4 ({args.numel // width}x{width})", get_codec("powersgd", rank=4, width=width)))
    for label, codec in codecs:
        enc_ms, payload = _median_ms(lambda codec=codec: codec.encode(x), args.runs)
        dec_ms, _ = _median_ms(lambda codec=codec, payload=payload: codec.decode(payload, args.numel), args.runs)
        rows[label] = dict(encode_ms=enc_ms, decode_ms=dec_ms, bytes=len(payload),
                           x_smaller=dense / len(payload))

    # Error feedback at steady state: one warm-up step, then alternate two gradients so the
    # residual keeps its realistic mixture of old error and new gradient.
    ef, topk = ErrorFeedback(), get_codec("topk", k=args.k)
    ef.encode("g", topk, grads[1])
    step = iter(range(1 << 30))
    enc_ms, payload = _median_ms(lambda: ef.encode("g", topk, grads[next(step) % 2]), args.runs)
    dec_ms, _ = _median_ms(lambda: topk.decode(payload, args.numel), args.runs)
    ef_label = f"topk {args.k:g} + EF + zstd"
    rows[ef_label] = dict(encode_ms=enc_ms, decode_ms=dec_ms, bytes=len(payload),
                          x_smaller=dense / len(payload))

    k = topk.count(args.numel)
    sel_gen = torch.Generator().manual_seed(args.seed)
    select_ms, _ = _median_ms(lambda: select(x, k, sel_gen), args.runs)
    torch_topk_ms, _ = _median_ms(lambda: torch.topk(x.abs(), k, sorted=False), max(3, args.runs // 2))

    print(f"{args.numel} float32 elements ({dense / 2**20:.0f} MiB dense), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"median of {args.runs} runs")
    print(f"{'codec':28s} {'encode ms':>10s} {'decode ms':>10s} {'bytes':>12s} {'x smaller':>10s}")
    for label, r in rows.items():
        print(f"{label:28s} {r['encode_ms']:10.1f} {r['decode_ms']:10.1f} {r['bytes']:12d} "
              f"{r['x_smaller']:10.1f}")
    print(f"top-k selection of k={k}: sampled {select_ms:.1f} ms, torch.topk {torch_topk_ms:.1f} ms "
          f"({torch_topk_ms / select_ms:.1f}x)")
    ef_row = rows[ef_label]
    goals = {
        "x_smaller": dict(goal=f">= {GOAL_RATIO:g}", measured=round(ef_row["x_smaller"], 1),
                          met=ef_row["x_smaller"] >= GOAL_RATIO),
        "encode_ms": dict(goal=f"<= {GOAL_ENCODE_MS:g}", measured=round(ef_row["encode_ms"], 1),
                          met=ef_row["encode_ms"] <= GOAL_ENCODE_MS),
    }
    for name, g in goals.items():
        print(f"goal {ef_label}, {name}: {g['goal']}; measured {g['measured']} -> "
              f"{'met' if g['met'] else 'NOT met'}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        numel=args.numel, runs=args.runs, k=args.k, dense_bytes=dense, rows=rows,
        topk_select_ms=select_ms, torch_topk_ms=torch_topk_ms, goals=goals,
        machine=dict(cores=os.cpu_count(), threads=torch.get_num_threads(),
                     torch=torch.__version__, python=platform.python_version(),
                     date=time.strftime("%Y-%m-%d")),
    ), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
