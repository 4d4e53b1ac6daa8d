"""Faults on a real multi-process cluster: a worker killed with SIGKILL, the root restarted."""

from __future__ import annotations

import os
import re
import signal
import time

from ps.tools.launch import Cluster
from ps.tools.status import fetch_status
from tests.helpers import json_lines, step_worker

FAST = {"heartbeat_s": 0.2, "member_timeout_s": 1.5}


def _topology(ckpt: str | None = None) -> dict:
    root = {"name": "root", "port": 0}
    if ckpt:
        root["checkpoint_dir"] = ckpt
    return {"host": "127.0.0.1", "settings": FAST, "root": root,
            "regions": [{"name": "eu", "zones": [{"name": "eu-a"}]}]}


def test_killing_a_worker_mid_run_does_not_hang_the_others(tmp_path, reap):
    with Cluster.start(_topology(), tmp_path / "logs") as cluster:
        zone = cluster.address("eu-a")
        ws = [step_worker(reap, zone, f"w{i}", 40, 0.02, tmp_path / f"w{i}.log") for i in range(3)]
        first = [json_lines(w, 5, 60) for w in ws]
        assert all(len(f) == 5 for f in first), first
        os.kill(ws[2].pid, signal.SIGKILL)
        ws[2].wait(timeout=10)
        t0 = time.monotonic()
        rest = [json_lines(w, 35, 90) for w in ws[:2]]
        for i, r in enumerate(rest):
            assert len(r) == 35, f"w{i} stopped after {len(r)} more steps (log: {tmp_path}/w{i}.log)"
            assert all(e["applied"] for e in r)
        assert time.monotonic() - t0 < 60
        members = {m.member for j in fetch_status(zone).jobs for m in j.members}
        assert "w2" not in members
        for w in ws[:2]:
            assert w.wait(timeout=30) == 0


def test_root_restart_children_resync_from_a_snapshot_not_a_wrong_base(tmp_path, reap):
    """Invariant 5: the root restarts from an older checkpoint under a new epoch (its
    write-ahead log lost, as when restoring a backup); the region, the zone and the worker must
    notice and take a snapshot rather than apply the new root's deltas to their old views
    (same version numbers, different values)."""
    ckpt = tmp_path / "ckpt"
    topo = _topology(str(ckpt))
    with Cluster.start(topo, tmp_path / "logs", extra_root_args=["--checkpoint-every", "4"]) as cluster:
        zone = cluster.address("eu-a")
        w = step_worker(reap, zone, "w0", 30, 0.05, tmp_path / "w0.log")
        before = json_lines(w, 6, 60)
        assert len(before) == 6
        old_epoch = before[-1]["epoch"]
        # Version 6 is acknowledged; the newest checkpoint holds version 4; without the
        # write-ahead log the root comes back at version 4.
        cluster.stop_tier("root", signal.SIGKILL)
        for wal in ckpt.glob("*/wal-*.log"):
            wal.unlink()
        cluster.restart("root")
        after = json_lines(w, 24, 120)
        assert len(after) == 24, f"worker stalled after the restart (log: {tmp_path}/w0.log)"
        new_epoch = after[-1]["epoch"]
        assert new_epoch != old_epoch
        root, region = fetch_status(cluster.address("root")), fetch_status(cluster.address("eu"))
        zst = fetch_status(zone)
        rj, gj, zj = root.jobs[0], region.jobs[0], zst.jobs[0]
        assert rj.view_epoch == gj.view_epoch == zj.view_epoch == new_epoch
        assert w.wait(timeout=30) == 0
        # Quiescent now: every tier and the worker hold the root's view, checksum for checksum.
        root, region, zst = (fetch_status(cluster.address(n)) for n in ("root", "eu", "eu-a"))
        assert root.jobs[0].version == region.jobs[0].version == zst.jobs[0].version == after[-1]["version"]
        assert root.jobs[0].checksum == region.jobs[0].checksum == zst.jobs[0].checksum == after[-1]["crc"]
        # The versions went back to the checkpoint (4) and forward again: without epochs, a
        # delta for version 7 of the new root would have been applied onto the old view 6.
        # (Compared with the old root's last version the worker saw, not 6: a step can still
        # be acknowledged between reading the sixth line and the kill.)
        last_old = max(r["version"] for r in before + after if r["epoch"] == old_epoch)
        first_new = next(r for r in after if r["epoch"] == new_epoch)
        assert first_new["version"] <= last_old or not first_new["applied"], (last_old, first_new)
        logs = (tmp_path / "logs" / "eu.log").read_text() + (tmp_path / "logs" / "eu-a.log").read_text()
        assert "resynced from a snapshot" in logs


def test_kill_9_of_the_root_loses_no_acknowledged_version(tmp_path, reap):
    """The root acknowledges a version only once its write-ahead log record is on disk: after
    kill -9 it replays the log on top of the newest checkpoint, bit for bit."""
    ckpt = tmp_path / "ckpt"
    with Cluster.start(_topology(str(ckpt)), tmp_path / "logs", extra_root_args=["--checkpoint-every", "4"]) as cluster:
        w = step_worker(reap, cluster.address("eu-a"), "w0", 12, 0.05, tmp_path / "w0.log")
        seen = json_lines(w, 7, 60)
        assert len(seen) == 7
        acked = {e["version"]: e["crc"] for e in seen}
        cluster.restart("root", signal.SIGKILL)
        log = (tmp_path / "logs" / "root.log").read_text()
        m = re.findall(r"checkpoint version (\d+) \+ (\d+) replayed from the write-ahead log = version "
                       r"(\d+), checksum (0x[0-9a-f]+)", log)
        assert m, log[-2000:]
        ckpt_version, replayed, version, crc = int(m[-1][0]), int(m[-1][1]), int(m[-1][2]), int(m[-1][3], 16)
        assert version >= max(acked), f"acknowledged {max(acked)}, restored {version}"
        assert replayed > 0 and ckpt_version < version
        if version in acked:  # the replayed view is the one the worker was given
            assert crc == acked[version]
        rest = json_lines(w, 5, 90)
        assert len(rest) == 5 and w.wait(timeout=30) == 0
