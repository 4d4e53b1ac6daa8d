"""What every benchmark writes next to its figures: the machine, the versions, the time."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


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


def met(value: float, goal: float, higher_is_better: bool = True) -> str:
    ok = value >= goal if higher_is_better else value <= goal
    return "met" if ok else "NOT met"
