"""What a version's checksum costs: CRC-32 (the first), XXH3-64 (today's), XXH3-128, CRC32C.

    python benchmarks/hashes.py --runs 7

Every version the root publishes carries ``ps.core.view.checksum`` of the whole float32 vector
(zlib's CRC-32 until this measurement; XXH3-64 since), and every tier that applies a delta
recomputes it: at 100M parameters that is 400 MB hashed per version per tier. Issue 18 asks
for a hash at >= 5 GB/s (per block, so a tier can hash blocks as they land).
This measures, on this machine, one thread each:
- zlib.crc32 (what view.checksum used), xxhash's XXH3-64 and XXH3-128, and CRC32C (Castagnoli,
  hardware-accelerated where the CPU has SSE4.2) via ``google-crc32c`` when it is installed
  (``pip install google-crc32c``; it is not a dependency of hps);
- over one 400 MB float32 buffer and one 4 MB buffer (a frame's worth), and over the 400 MB
  buffer hashed as 100 independent 4 MB blocks (a digest per block, what "per block" needs);
- GB/s (10^9 bytes per second) of the median of --runs timings;
- the view checksum as tiers compute it now (``ps.core.view``: an XXH3-64 digest per 64Ki-element
  block, combined): a whole version, and a version that changed only one fragment of four (an
  outer job with F=4) or 1% of the view (a fine-tune's trained keys), which a tier hashes
  block by block (``View.rehash``; a replica the blocks its chunks covered), side by side.
Nothing is asserted.

Writes benchmarks/results/hashes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ps.core.view import KeySpec, Layout, View, checksum

ROOT = Path(__file__).resolve().parent.parent
GOAL_GBPS = 5.0
BLOCK = 4 * 1000 * 1000  # bytes per block: a frame's worth (4 MB)


def _hashes() -> tuple[dict[str, Callable[[np.ndarray], object]], dict[str, str]]:
    fns: dict[str, Callable[[np.ndarray], object]] = {
        "zlib.crc32 (view.checksum until 2026-11-26)": zlib.crc32,
        "xxhash XXH3-64": xxhash.xxh3_64_intdigest,
        "xxhash XXH3-128": xxhash.xxh3_128_intdigest,
    }
    notes = {}
    try:
        import google_crc32c  # type: ignore[import-not-found]  # a measurement-only extra
    except ImportError as exc:
        notes["crc32c"] = f"google-crc32c not installed ({exc}); pip install google-crc32c to measure it"
    else:
        fns["CRC32C (google-crc32c)"] = google_crc32c.value
        notes["crc32c"] = f"google-crc32c implementation: {google_crc32c.implementation}"
    return fns, notes


def _gbps(fn: Callable[[], object], nbytes: int, runs: int) -> dict:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return dict(gbps=nbytes / med / 1e9, median_s=med, runs=runs,
                gbps_runs=[round(nbytes / t / 1e9, 3) for t in times])


def _view_rows(big: np.ndarray, runs: int) -> dict:
    """The view checksum of a whole version, and the rehash of a version that changed a part."""
    n = big.size
    quarter, percent = n // 4, n // 100
    layout = Layout([KeySpec("fragment0", (quarter,)), KeySpec("rest", (n - quarter,))])
    view = View(layout)
    view.values = big.copy()
    rows = {"whole version (ps.core.view.checksum)": _gbps(lambda: checksum(view.values), big.nbytes, runs),
            "one fragment of four (View.rehash)": _gbps(lambda: view.rehash([(0, quarter)]), big.nbytes, runs),
            "1% of the view (View.rehash)": _gbps(lambda: view.rehash([(0, percent)]), big.nbytes, runs),
            "whole version, one XXH3-64 pass (before)": _gbps(lambda: xxhash.xxh3_64_intdigest(big), big.nbytes,
                                                              runs)}
    whole = rows["whole version (ps.core.view.checksum)"]["median_s"]
    for r in rows.values():
        r["vs_whole"] = r["median_s"] / whole
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7, help="timings per figure over the large buffer (median)")
    p.add_argument("--small-runs", type=int, default=200, help="timings per figure over the 4 MB buffer")
    p.add_argument("--mb", type=int, default=400, help="size of the large buffer, MB (10^6 bytes)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hashes.json"))
    args = p.parse_args()

    rng = np.random.default_rng(0)
    big = rng.standard_normal(args.mb * 1_000_000 // 4, dtype=np.float32)   # a gradient-like vector
    small = big[: BLOCK // 4].copy()
    # Read-only arrays, passed as they are: google-crc32c's C entry point parses its argument
    # with "y#", which refuses writable buffers and every memoryview (it has a release hook) but
    # takes a read-only numpy array without a copy; zlib and xxhash take any buffer.
    big.flags.writeable = small.flags.writeable = False
    big_b, small_b = big, small
    blocks = [big[i:i + BLOCK // 4] for i in range(0, big.size, BLOCK // 4)]
    fns, notes = _hashes()
    rows = {}
    for name, fn in fns.items():
        fn(small_b)  # warm: first call, page faults of the buffer already taken by numpy
        rows[name] = {
            f"{args.mb} MB": _gbps(lambda fn=fn: fn(big_b), big.nbytes, args.runs),
            "4 MB": _gbps(lambda fn=fn: fn(small_b), small.nbytes, args.small_runs),
            f"{args.mb} MB as 4 MB blocks": _gbps(lambda fn=fn: [fn(b) for b in blocks], big.nbytes, args.runs),
        }
    print(f"one thread; GB/s = 10^9 bytes/s, median of {args.runs} runs ({args.small_runs} for 4 MB); "
          f"goal >= {GOAL_GBPS:g} GB/s")
    cols = list(next(iter(rows.values())))
    print(f"{'hash':34s}" + "".join(f"{c:>24s}" for c in cols))
    for name, r in rows.items():
        print(f"{name:34s}" + "".join(f"{r[c]['gbps']:24.2f}" for c in cols))
    for note in notes.values():
        print(note)
    view_rows = _view_rows(big, args.runs)
    print(f"\nthe view checksum per version ({args.mb} MB view, median of {args.runs}):")
    for name, r in view_rows.items():
        print(f"  {name:44s} {1e3 * r['median_s']:8.1f} ms   {r['vs_whole']:.3f}x the whole view's")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        benchmark="hashes", goal_gbps=GOAL_GBPS, block_bytes=BLOCK, rows=rows, notes=notes, view_rows=view_rows,
        machine=dict(platform=platform.platform(), cores=os.cpu_count(), python=platform.python_version(),
                     numpy=np.__version__, xxhash=xxhash.VERSION, date=time.strftime("%Y-%m-%d")),
    ), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
