"""A tier killed under a real Prometheus (5 s scrapes, the project's rules): the alert that
names the fault fires, no alert outside the expected set fires, and after Alertmanager's
inhibit rules exactly one page is left. The same run as ``benchmarks/alerts.py`` (one zone
kill); the time it took is printed, never asserted (the benchmark measures it: 15 s median).

Needs the Prometheus server binary (`make tools` extracts it from Debian's package into
.venv/bin, as it does promtool); skips with the reason where it could not."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = os.environ.get("PROMETHEUS") or shutil.which("prometheus", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(not PROMETHEUS, reason="no prometheus binary (make tools extracts it; needs apt)")
def test_a_killed_zone_pages_once_with_the_right_alert(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    alerts = importlib.import_module("alerts")
    r = alerts.one("zone", PROMETHEUS, warmup_s=10.0, watch_s=35.0)
    print(f"zone killed: {r['firing']} (seconds from the kill); pages {r['pages']}")
    assert r["alerts_before"] == [], r          # quiet on a healthy, training tree
    assert r["fault_to_alert_s"] is not None, r  # HpsTierDown for the zone fired
    assert r["only_expected"], r                 # nothing outside the expected set
    assert r["pages_once"], r                    # one page left after inhibition
