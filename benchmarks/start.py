"""How long a tier process takes to serve, and the memory it holds then, per role.

    python benchmarks/start.py                          # zone, regional, global; 5 starts each
    python benchmarks/start.py --against /path/to/other/checkout   # side by side, alternating

Each start is ``python -m ps.tools.cli serve --role R`` on 127.0.0.1:0 (a relay's parent is an
address nobody listens on: it serves before it reaches it), timed from ``Popen`` to its
"hps: serving" line, then its resident memory (VmRSS) is read and it is stopped by its PID
(SIGTERM). A tier that restarts after a crash is back this much later, plus what it takes to
sync. ``--against`` runs another checkout's code (its directory first on PYTHONPATH; it needs
its generated protobuf code) in turn with this one, so drift of the shared machine hits both.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, machine, write

ARGS = {
    "zone": ["--role", "zone", "--name", "z", "--parent", "127.0.0.1:9"],
    "regional": ["--role", "regional", "--name", "eu", "--parent", "127.0.0.1:9"],
    "global": ["--role", "global", "--name", "root"],
}


def one(tree: Path, role: str, timeout_s: float = 60.0) -> tuple[float, float]:
    """(seconds to "hps: serving", resident MB then) of one start of ``role`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "ps.tools.cli", "serve", *ARGS[role], "--insecure",
                          "--listen", "127.0.0.1:0", "--metrics-port", "-1"],
                         cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert p.stdout is not None
        deadline = t0 + timeout_s
        for line in p.stdout:
            if "hps: serving" in line:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{role} from {tree} did not serve in {timeout_s:.0f} s")
        else:
            raise RuntimeError(f"{role} from {tree} exited with {p.wait()} before serving")
        seconds = time.perf_counter() - t0
        status = Path(f"/proc/{p.pid}/status").read_text()
        rss_kb = int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1])
        return seconds, rss_kb / 1024
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--roles", default="zone,regional,global")
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--against", default="", help="another checkout, run in turn with this one")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    trees = {"this": ROOT, **({"against": Path(a.against).resolve()} if a.against else {})}
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {t: {r: [] for r in a.roles.split(",")} for t in trees}
    for _ in range(a.starts):
        for role in a.roles.split(","):
            for name, tree in trees.items():
                runs[name][role].append(one(tree, role))
    rows = []
    for role in a.roles.split(","):
        for name, tree in trees.items():
            v = runs[name][role]
            row = {"tree": name, "path": str(tree), "role": role, "starts": len(v),
                   "serving_s_median": round(statistics.median(s for s, _ in v), 3),
                   "serving_s": [round(s, 3) for s, _ in v],
                   "rss_mb_median": round(statistics.median(m for _, m in v), 1)}
            rows.append(row)
            print(f"{role:9s} {name:8s} serving after {row['serving_s_median']:.2f} s (median of {len(v)}: "
                  f"{', '.join(f'{s:.2f}' for s, _ in v)}), resident {row['rss_mb_median']:.0f} MB")
    write("start", {"machine": machine(), "rows": rows}, a.out)


if __name__ == "__main__":
    main()
