"""Run every benchmark in turn (what ``make bench`` does) and write a summary of the headline
ratios, each next to its goal.

    python benchmarks/run_all.py            # full sizes: under 15 minutes on 2 idle cores
    python benchmarks/run_all.py --quick    # small sizes (a smoke run, ~4 minutes): not the figures
    python benchmarks/run_all.py --only dataplane,wan_loss

Each benchmark runs as its own process with the arguments below and writes its own
``benchmarks/results/<name>.json`` (and PNG where it plots); this writes
``benchmarks/results/summary.json``: every benchmark's exit status, duration and headline
figures. A benchmark that fails is reported and the others still run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import RESULTS, ROOT, write

# name -> (full arguments, --quick arguments)
BENCHES = {
    "wanem": ([], ["--megabytes", "5", "--pings", "10"]),
    # 4 reps: the first one or two after the warm-up still grow the servers' heaps (median of 4)
    "dataplane": (["--params", "100000000", "--reps", "4"], ["--params", "10000000", "--reps", "2"]),
    "bsp_vs_gloo": (["--params", "4000000", "--steps", "12"], ["--params", "1000000", "--steps", "6"]),
    "wan_loss": (["--steps", "80"], ["--steps", "20"]),
    "bsp_step": (["--loops", "asyncio", "--steps", "30"], ["--loops", "asyncio", "--steps", "15"]),
    "codecs": ([], ["--numel", "1048576", "--runs", "3"]),
    # the demo's 150 steps: at 40 the loss still falls steeply and one run's noise is ~10%
    "modes": (["--steps", "150", "--repeats", "2"], ["--steps", "20"]),
    "delayed": (["--steps", "150"], ["--steps", "10", "--delays", "0,3"]),
    "reconnect": ([], ["--quick"]),
}


def headline(name: str) -> dict:
    """The figures worth a line in the README, read back from the benchmark's JSON."""
    try:
        r = json.loads((RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}
    if name == "wanem":
        return {k: round(v["ratio"], 3) for k, v in r["figures"].items()}
    if name == "dataplane":  # TLS rows (", mutual TLS") also carry their time over the plaintext row's
        return {k: dict(push_vs_tcp=round(v["push_vs_tcp"], 3), pull_vs_tcp=round(v["pull_vs_tcp"], 3),
                        **({"tls_over_plain": dict(push=round(v["tls_over_plain"]["push"], 3),
                                                   pull=round(v["tls_over_plain"]["pull"], 3))}
                           if "tls_over_plain" in v else {}))
                for k, v in r["rows"].items() if "push_vs_tcp" in v}
    if name == "bsp_vs_gloo":
        return {n: {c: round(v["vs_gloo"], 2) if "vs_gloo" in v else v.get("status") for c, v in row["hps"].items()}
                for n, row in r["rows"].items()}
    if name == "wan_loss":
        return {m: {k: v for k, v in c.items()} for m, c in r.get("comparisons", {}).items()}
    if name == "bsp_step":
        return dict(bsp_over_compute_only=r.get("bsp_over_compute_only"), bsp_over_floor=r.get("bsp_over_floor"),
                    tls_over_plain={k: round(v["tls_over_plain"], 3) for k, v in (r.get("tls") or {}).items()})
    if name == "modes":
        return {k: dict(speedup_vs_bsp=v.get("speedup_vs_bsp"), val_loss_vs_bsp_pct=v.get("val_loss_vs_bsp_pct"),
                        staleness_mean=v.get("staleness_mean"))
                for k, v in r.get("modes", {}).items()}
    if name == "delayed":
        return {k: round(v["val_loss_vs_bsp_pct"], 1) for k, v in r.get("rows", {}).items()}
    if name == "reconnect":
        return {f"{row['options']} after {row['outage_s']:g}s": round(row["median_s"], 2) for row in r["rows"]}
    return {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not the figures")
    p.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(BENCHES))
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(BENCHES)
    summary = {}
    t_all = time.monotonic()
    for name in names:
        argv = BENCHES[name][1 if args.quick else 0]
        print(f"\n=== {name} {' '.join(argv)}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *argv], cwd=ROOT).returncode
        summary[name] = dict(exit_status=rc, seconds=round(time.monotonic() - t0, 1), args=argv,
                             headline=headline(name) if rc == 0 else {})
        print(f"=== {name}: exit {rc} after {summary[name]['seconds']:.0f}s", flush=True)
    total = time.monotonic() - t_all
    # A partial run (--only) must not overwrite the summary of a full one.
    if not args.only:
        write("summary", dict(quick=args.quick, total_seconds=round(total, 1), benchmarks=summary))
    print(f"\nall benchmarks: {total / 60:.1f} min; "
          f"{sum(1 for s in summary.values() if s['exit_status'] == 0)} of {len(summary)} ran to completion")
    return 0 if all(s["exit_status"] == 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
