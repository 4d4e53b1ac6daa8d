"""Issue 13 on real tiers: stable ranks and min_workers through a zone, and leased data shards
-- a worker killed with SIGKILL mid-epoch, and still every sample of the epoch is trained
exactly once (its shard's lease expires and another worker resumes it where the root's applied
versions left it); a root killed with SIGKILL keeps the ranks, leases and trained offsets."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import Conflict, TimedOut
from ps.core.leases import GRANTED, Dataset
from ps.core.tensors import assemble
from ps.core.types import StepInfo
from ps.core.view import KeySpec, Layout
from ps.tools.launch import Cluster
from tests.helpers import json_lines, spawn_worker
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (4,))])


def _client(addr: str, wid: str, job: str = "r", **cfg) -> ParameterClient:
    c = ParameterClient(addr, job, wid, timeout_s=10)
    c.create_job(JobConfig(name=job, **cfg), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    c.register()
    return c


def test_ranks_are_stable_through_a_zone_restart_included(tree):
    root = tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    cs = [_client(zone, f"w{i}") for i in range(3)]
    assert [c.rank().rank for c in cs] == [0, 1, 2]
    assert cs[1].rank().rank == 1                     # the same on every call
    info = cs[2].rank()
    assert (info.world_size, info.joined, info.holders) == (3, 3, ((0, "w0"), (1, "w1"), (2, "w2")))
    cs[1]._hb_stop.set()                              # w1 "dies" (no clean exit) ...
    again = _client(zone, "w1")                       # ... and its replacement gets rank 1 back
    assert again.rank().rank == 1
    cs[0].close()                                     # a clean exit frees rank 0
    late = _client(root, "w9")
    assert late.rank().rank == 0
    asked = _client(zone, "w5")
    assert asked.rank(requested=7).rank == 7          # RANK honoured when free
    refused = _client(zone, "w6")
    with pytest.raises(Conflict, match="rank 7 of this job is held by worker 'w5'"):
        refused.rank(requested=7)
    for c in (cs[2], again, late, asked, refused):
        c.close()


def test_wait_workers_returns_once_min_workers_hold_ranks_and_times_out_naming_who(tree):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    w0 = _client(zone, "a", job="m", min_workers=2)
    with pytest.raises(TimedOut, match=r"1 of 2 workers joined job 'm' within 0.5s \(ranks held: 0: 'a'\)"):
        w0.wait_workers(timeout_s=0.5)
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("info", w0.wait_workers(timeout_s=30)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()                                # still waiting for the second
    w1 = _client(zone, "b", job="m", min_workers=2)
    assert w1.rank().rank == 1
    t.join(30)
    assert got["info"].joined == 2 and got["info"].world_size == 2
    for c in (w0, w1):
        c.close()


def _spawn(reap, address: str, wid: str, log: Path, sleep: float, wait: int = 1) -> subprocess.Popen:
    return spawn_worker(reap, "tests.integration._lease_worker", log, "--address", address, "--worker-id", wid,
                        "--sleep", str(sleep), "--wait-workers", str(wait))


def _trained_counts(tree, job: str = "data") -> np.ndarray:
    """How many times each sample's gradient was applied, from the root's published deltas: a
    version averages its contributors' gradients (SGD, lr 1), so delta * contributors is the
    sum of the one-hots it applied."""
    def read():
        js = tree.tier("root").jobs[job]
        return js.layout, js.log.since(0, js.view.version)
    layout, entries = tree.lt.call(read)
    assert entries is not None, "the delta log no longer holds version 1"
    total = np.zeros(layout.numel, np.float64)
    for e in entries:
        total += assemble(layout, list(e.chunks), what="delta").astype(np.float64) * e.contributors
    return total


def test_kill_9_of_a_worker_mid_epoch_every_sample_is_trained_exactly_once(tree, reap, tmp_path):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    ws = [_spawn(reap, zone, f"w{i}", tmp_path / f"w{i}.log", sleep=0.15, wait=2) for i in range(2)]
    first = [json_lines(w, 3, 60) for w in ws]  # its rank, then two batches: half of its first shard
    assert all(len(f) == 3 for f in first), (first, tmp_path)
    os.kill(ws[1].pid, signal.SIGKILL)
    ws[1].wait(timeout=10)
    rest = json_lines(ws[0], 100, 120)
    assert rest and rest[-1] == {"done": True}, f"w0 did not finish the epoch (log: {tmp_path}/w0.log)"
    assert ws[0].wait(timeout=30) == 0
    killed_shard = first[1][2]["progress"][0][1]
    resumed = [e["progress"][0][2] for e in rest if e.get("progress", [[0, -1]])[0][1] == killed_shard]
    # w1 had two batches (8 samples) of it applied: w0 went on from there, not from the start
    assert resumed and resumed[0] >= 12, (resumed, first[1])
    counts = _trained_counts(tree)
    assert np.array_equal(counts, np.ones(96)), {i: c for i, c in enumerate(counts) if c != 1}
    book = tree.lt.call(lambda: tree.tier("root").jobs["data"].leases)
    assert 0 in book.finished
    assert tree.lt.call(lambda: tree.tier("root").jobs["data"].stats.double_applied) == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_outer_jobs_regions_train_every_sample_of_an_epoch_exactly_once(tree, reap, tmp_path, asynchronous):
    """Two regions, a worker each, on one leased epoch of an outer job (H = 2, lossless, outer
    SGD lr 1): each region's trained data reaches the root with its syncs, and a worker leaving
    keeps its leases until its data arrived. Asynchronous, the fast region runs out of shards
    and waits in empty rounds, which send its held data up. Every sample's one-hot is applied
    at the root exactly once (synchronous: a version averages the regions' pushes, as bsp does;
    asynchronous: each region's is applied at its share of the workers, a half)."""
    tree.add("root", "global")
    zones = []
    for r in ("eu", "us"):
        tree.add(r, "regional", parent="root")
        zones.append(tree.add(f"{r}-a", "zone", parent=r))
    ws = [spawn_worker(reap, "tests.integration._lease_worker", tmp_path / f"w{i}.log", "--address", z,
                       "--worker-id", f"w{i}", "--wait-workers", "2", "--outer", "2", "--sleep", str(0.3 * i),
                       *(["--asynchronous"] if asynchronous else []))
          for i, z in enumerate(zones)]  # w1 slower: w0 runs out of shards first
    for i, w in enumerate(ws):
        lines = json_lines(w, 100, 120)
        assert lines and lines[-1] == {"done": True}, f"w{i} did not finish the epoch (log: {tmp_path}/w{i}.log)"
        assert w.wait(timeout=30) == 0
    deadline = time.monotonic() + 30  # the last region's final sync lands after its worker left
    while not tree.lt.call(lambda: 0 in tree.tier("root").jobs["data"].leases.finished):
        assert time.monotonic() < deadline, "the root never saw the epoch's last data"
        time.sleep(0.1)
    counts = _trained_counts(tree) * (2 if asynchronous else 1)  # asynchronous: each region's at half
    assert np.array_equal(counts, np.ones(96)), {i: c for i, c in enumerate(counts) if c != 1}
    syncs = [tree.lt.call(lambda r=r: tree.tier(r).inner.jobs["data"].stats.outer_syncs) for r in ("eu", "us")]
    assert min(syncs) >= 2, syncs
    assert tree.lt.call(lambda: tree.tier("root").jobs["data"].stats.double_applied) == 0


def test_a_restarted_outer_worker_resumes_its_shard_where_its_region_trained_it(tree, caplog):
    """Data a region trained is at the root only after its next sync (H = 50 here: none
    happens). A worker restarted meanwhile (a new incarnation: the root hands its shard back
    from the root's offset) is told by its region where that shard really stands: from 8, and,
    trained to its end, the next shard -- never the samples again. A lease timeout shorter than twice
    the region's time between syncs is said (once) in the region's log."""
    import logging

    from ps.core.config import OuterConfig

    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    zone = tree.add("eu-a", "zone", parent="eu")
    sgd = OptimizerConfig(kind="sgd", lr=1.0)
    job = JobConfig(name="ol", mode="outer", optimizer=sgd,
                    outer=OuterConfig(inner_steps=50, codec="fp32", delta_codec="fp32", optimizer=sgd))
    ds = Dataset(length=32, shard_size=16, lease_timeout_s=30)

    def incarnation(end: int | None):
        c = ParameterClient(zone, "ol", "w0", timeout_s=10)
        c.create_job(job, LAYOUT, np.zeros(4, np.float32))
        c.register()
        c.pull()
        g = c.lease(ds, epoch=0)
        if end is not None:
            version, _ = c.push(np.zeros(4, np.float32), step=StepInfo(progress=((0, g.shard, end),)))
            c.pull(min_version=version)
        return c, g

    first, g = incarnation(8)
    assert (g.status, g.shard, g.start) == (GRANTED, 0, 0)
    second, g = incarnation(16)       # the root would start it at 0 again
    assert (g.status, g.shard, g.start) == (GRANTED, 0, 8)
    tree.lt.call(lambda: setattr(tree.tier("eu").outer["ol"].rate, "rate", 1.0))  # 50 steps at 1/s per sync
    with caplog.at_level(logging.WARNING, logger="hps.outer"):
        third, g = incarnation(None)
    assert caplog.text.count("lease timeout (30.0s) is under twice this region's time between syncs") == 1
    assert (g.status, g.shard) == (GRANTED, 1)  # shard 0 is trained to its end, at the region: the next
    assert tree.lt.call(lambda: tree.tier("root").jobs["ol"].leases.done[0][0]) == 0  # the root has none of it
    for c in (first, second, third):
        c.close()


def test_kill_9_of_the_root_keeps_ranks_leases_and_trained_offsets(tmp_path):
    """The ranks and leases are in roster.json before they are answered; the trained offsets
    come back from the checkpoint and the write-ahead log (progress is logged with versions)."""
    topo = {"host": "127.0.0.1", "settings": {"heartbeat_s": 0.2, "member_timeout_s": 1.5},
            "root": {"name": "root", "port": 0, "checkpoint_dir": str(tmp_path / "ckpt"), "zones": [{"name": "z"}]}}
    ds = Dataset(length=40, shard_size=16, lease_timeout_s=30)
    with Cluster.start(topo, tmp_path / "logs", extra_root_args=["--checkpoint-every", "2"]) as cluster:
        zone = cluster.address("z")
        a = ParameterClient(zone, "k", "a", timeout_s=10)
        a.create_job(JobConfig(name="k", optimizer=OptimizerConfig(lr=1.0)), LAYOUT, np.zeros(4, np.float32))
        a.register()
        a.pull()
        b = ParameterClient(zone, "k", "b", timeout_s=10)
        assert (a.rank().rank, b.rank().rank) == (0, 1)
        g = a.lease(ds, epoch=0)
        assert (g.status, g.shard, g.start) == (GRANTED, 0, 0)
        for end in (4, 8, 12):  # three versions, the first two in a checkpoint, the third logged
            version, _ = a.push(np.zeros(4, np.float32), step=StepInfo(progress=((0, 0, end),)))
            a.pull(min_version=version)
        # An epoch opened after the last checkpoint: its lease is in the roster, its offsets in
        # no checkpoint -- the restored root dropped the lease and handed b's shard to c.
        assert b.lease(ds, epoch=1).shard == 0
        cluster.restart("root", signal.SIGKILL)
        c = ParameterClient(zone, "k", "c", timeout_s=10)
        assert c.rank().rank == 2                         # a and b still hold 0 and 1
        assert b.rank().rank == 1
        got = c.lease(ds, epoch=0)
        assert (got.status, got.shard) == (GRANTED, 1)    # shard 0 is still a's
        assert c.lease(ds, epoch=1, held=((0, 1),)).shard == 1  # and shard 0 of epoch 1 b's
        a2 = ParameterClient(zone, "k", "a", timeout_s=10)  # a restarts: its shard, from 12
        again = a2.lease(ds, epoch=0)
        assert (again.status, again.shard, again.start) == (GRANTED, 0, 12)
        assert a2.rank().rank == 0
        for x in (a, b, c, a2):
            x.close()


def test_a_lease_refused_for_its_epoch_declares_no_dataset(tree):
    """The dataset was declared before the epoch was checked: a refused call left it declared
    in memory only (not in the roster), and a restart forgot it -- the job then agreed with
    another dataset than before."""
    from ps.core.errors import BadInput

    c = _client(tree.add("root", "global"), "w0")
    with pytest.raises(BadInput, match="an epoch must be in"):
        c.lease(Dataset(length=40, shard_size=16), epoch=1 << 41)
    assert tree.lt.call(lambda: tree.tier("root").jobs["r"].leases.dataset) is None
    assert c.lease(Dataset(length=48, shard_size=16), epoch=0).status == GRANTED  # declares it now
    c.close()
