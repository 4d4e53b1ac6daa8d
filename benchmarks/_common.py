"""What every benchmark writes next to its figures: the machine, the versions, the time."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import json_lines  # noqa: E402  (after the path: one reader for tests and benchmarks)

__all__ = ["ROOT", "RESULTS", "machine", "write", "plot", "met", "failover_workers", "json_lines"]


def machine() -> dict:
    info = dict(platform=platform.platform(), cores=os.cpu_count(), python=platform.python_version(),
                date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    for mod in ("torch", "grpc", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            pass
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def write(name: str, result: dict, out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **result}, indent=2))
    print(f"wrote {path}")
    return path


def plot(path: Path, draw) -> Path | None:
    """Call ``draw(ax)`` on a fresh figure and save it as PNG; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def loss_curve(events: list[dict]) -> tuple[float, list, list]:
    """(t0, curve, smoothed) from workers' "start" and "step" events: t0 the first start; the
    curve (seconds since t0, mean loss over workers) at each step, stamped when its last
    worker finished it; smoothed over 10 steps."""
    t0 = min(e["t"] for e in events if e["event"] == "start")
    per_step: dict[int, list] = {}
    for e in events:
        if e["event"] == "step":
            per_step.setdefault(e["step"], []).append(e)
    curve = []
    for s in sorted(per_step):
        es = per_step[s]
        curve.append((max(e["t"] for e in es) - t0, sum(e["loss"] for e in es) / len(es)))
    smooth = [(t, sum(v for _, v in curve[max(0, i - 9):i + 1]) / len(curve[max(0, i - 9):i + 1]))
              for i, (t, _) in enumerate(curve)]
    return t0, curve, smooth


def met(value: float, goal: float, higher_is_better: bool = True) -> str:
    ok = value >= goal if higher_is_better else value <= goal
    return "met" if ok else "NOT met"


FAILOVER_WORKER = ROOT / "benchmarks" / "_failover_worker.py"


def failover_workers(cluster, zones: tuple[str, ...], steps: int, logdir: Path) -> list[subprocess.Popen]:
    """One bsp worker (benchmarks/_failover_worker.py, a JSON line per step) per zone of
    ``cluster``; stderr to ``logdir/w<i>.log``. The caller stops them by PID."""
    return [subprocess.Popen([sys.executable, str(FAILOVER_WORKER), cluster.address(z), f"w{i}", str(steps)],
                             stdout=subprocess.PIPE, stderr=open(logdir / f"w{i}.log", "wb"), text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
            for i, z in enumerate(zones)]


