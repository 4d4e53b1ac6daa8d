"""A cluster across emulated WAN links (hps launch honours latency_ms / bandwidth_mbit per edge):
training goes through them, every tier agrees with the root, and the links carry the bytes.
Only lower timing bounds are asserted (a BSP step crosses the region's link at least once)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from ps.tools.launch import Cluster
from ps.tools.status import fetch_status

LINK = {"latency_ms": 40, "bandwidth_mbit": 50}


def _topology() -> dict:
    return {"host": "127.0.0.1", "settings": {"heartbeat_s": 0.2, "member_timeout_s": 3.0},
            "root": {"name": "root"},
            "regions": [{"name": "eu", **LINK, "zones": [{"name": "eu-a"}]}],
            "links": [{"name": "far", "to": "root", **LINK}]}


def test_training_across_emulated_links(tmp_path, reap):
    with Cluster.start(_topology(), tmp_path / "logs") as cluster:
        assert set(cluster.links) == {"eu-root", "far"}
        region = cluster.tiers["eu"]
        assert region.parent == cluster.links["eu-root"].address != cluster.address("root")
        # One worker below the zone (zone -> region -> link -> root), one straight to the root
        # across its own link: both in the same BSP job.
        ws = []
        for wid, addr in (("w0", cluster.address("eu-a")), ("w1", cluster.address("far"))):
            p = subprocess.Popen([sys.executable, "-m", "tests.integration._worker", "--address", addr,
                                  "--worker-id", wid, "--steps", "6"], stdout=subprocess.PIPE,
                                 stderr=open(tmp_path / f"{wid}.log", "wb"), text=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
            reap(p)
            ws.append(p)
        lines = []
        for w in ws:
            out, _ = w.communicate(timeout=120)
            assert w.returncode == 0, (tmp_path / "w0.log").read_text()[-2000:]
            lines.append([json.loads(line) for line in out.splitlines()])
        assert [len(x) for x in lines] == [6, 6]
        assert all(r["applied"] for x in lines for r in x)
        # Both workers ended on the same version, bit for bit.
        assert lines[0][-1]["version"] == lines[1][-1]["version"]
        assert lines[0][-1]["crc"] == lines[1][-1]["crc"]
        t0 = time.monotonic()
        st = fetch_status(cluster.address("far"))  # status across a link: at least one round trip
        assert time.monotonic() - t0 >= LINK["latency_ms"] / 1000 * 0.99
        root, eu = fetch_status(cluster.address("root")), fetch_status(cluster.address("eu"))
        assert st.name == root.name
        assert {(j.version, j.checksum) for j in root.jobs} == {(j.version, j.checksum) for j in eu.jobs}
    # Stopped last, each link reports what crossed it.
    for name in ("eu-root", "far"):
        log = (tmp_path / "logs" / f"link-{name}.log").read_text()
        m = re.search(r"(\d+) bytes up, (\d+) bytes down", log)
        assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, log
