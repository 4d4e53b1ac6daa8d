"""The README's contract, run as a user would: `hps demo`, `hps launch` + `hps status`, flags
and their HPS_* environment fallbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ps.launch import Cluster, default_topology

HPS = [sys.executable, "-m", "ps.cli"]


def test_demo_trains_on_the_default_topology_and_reports(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(HPS + ["demo", "--steps", "4", "--out", str(out)], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "replicas agree with the root bit for bit: yes" in r.stdout
    assert "step    4/4" in r.stdout
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert [w["steps"] for w in summary["workers"]] == [4, 4, 4, 4]
    assert {t["role"] for t in summary["tiers"]} == {"global", "regional", "zone"}
    root = next(t for t in summary["tiers"] if t["role"] == "global")
    assert root["version"] == 4 and root["push_in_bytes"] > 0


def test_launch_then_status_shows_the_whole_tree(tmp_path):
    topo = default_topology()
    topo["settings"] = {"heartbeat_s": 0.1, "member_timeout_s": 1.0}
    with Cluster.start(topo, tmp_path / "logs") as cluster:
        assert len(cluster.tiers) == 7
        text = ""
        for _ in range(50):  # relays announce themselves with their first heartbeat
            r = subprocess.run(HPS + ["status", cluster.address("root")], capture_output=True,
                               text=True, timeout=30)
            text = r.stdout
            if all(f" {n} @" in text for n in ("eu", "us", "eu-a", "eu-b", "us-a", "us-b")):
                break
        assert r.returncode == 0, r.stderr
        for name in ("root", "eu", "us", "eu-a", "eu-b", "us-a", "us-b"):
            assert f" {name} @" in text, text
    for t in cluster.tiers.values():
        assert t.proc.poll() is not None  # every tier stopped


def test_serve_flags_fall_back_to_environment_and_errors_are_sentences():
    env = {**os.environ, "HPS_ROLE": "zone"}
    r = subprocess.run(HPS + ["serve"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "needs --parent" in r.stderr
    env["HPS_MEMBER_TIMEOUT_S"] = "0.1"
    env["HPS_PARENT"] = "127.0.0.1:1"
    r = subprocess.run(HPS + ["serve"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "shorter than the member timeout (0.1s)" in r.stderr
