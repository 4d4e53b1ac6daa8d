"""Invariant 1 (replica exactness) and the delta-log / snapshot paths, on real tiers."""

from __future__ import annotations

import numpy as np
import pytest

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.view import KeySpec, Layout
from ps.tools.status import fetch_status
from tests.helpers import bsp_rounds, same_bits, wait_for
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (64, 33)), KeySpec("b", (33,))])


def _grad(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.numel).astype(np.float32)


def _train(clients, steps):
    bsp_rounds(clients, steps, lambda i, s: _grad(1000 * i + s))


@pytest.mark.parametrize("delta_codec", ["fp32", "fp32+zstd", "fp16", "int8", "topk"])
def test_zone_and_worker_hold_the_roots_view_bit_for_bit(tree, delta_codec):
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    zone = tree.add("eu-a", "zone", parent="eu")
    cfg = JobConfig(name="j", delta_codec=delta_codec,
                    optimizer=OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9))
    clients = [ParameterClient(zone, "j", f"w{i}") for i in range(2)]
    clients[0].create_job(cfg, LAYOUT, np.random.default_rng(0).standard_normal(LAYOUT.numel).astype(np.float32))
    for c in clients:
        c.register()
        c.pull(min_version=0)
    for step in range(1, 6):
        _train(clients, 1)
        r_epoch, r_version, r_crc, r_values = tree.view("root", "j")
        assert r_version == step
        for name in ("eu", "eu-a"):
            epoch, version, crc, values = tree.view(name, "j")
            assert (epoch, version, crc) == (r_epoch, r_version, r_crc)
            assert same_bits(values, r_values)
        for c in clients:
            assert (c.view.epoch, c.view.version, c.view.checksum) == (r_epoch, r_version, r_crc)
            assert same_bits(c.view.values, r_values)
    # The published view trails the parameters only by what the last delta's codec dropped:
    # fp32 rounding when lossless, the codec's error when lossy. That residual (params - view)
    # goes out with the next delta, so it never accumulates (error feedback at the root).
    params = tree.lt.call(lambda: tree.tier("root").jobs["j"].params.copy())
    # (A top-k view trails by design: the 99% not sent is owed, so only dense codecs are bounded.)
    bound = {"fp32": 1e-6, "fp32+zstd": 1e-6, "fp16": 1e-2, "int8": 1e-2}.get(delta_codec)
    if bound is not None:
        assert np.abs(params - r_values).max() <= bound * np.abs(params).max()
    for c in clients:
        c.close()


def test_a_child_behind_the_delta_log_gets_a_snapshot_and_one_within_it_gets_deltas(tree):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    # async: the reader below is a member that only pulls, and must not hold up w's updates.
    cfg = JobConfig(name="j", mode="async", delta_log_length=3, optimizer=OptimizerConfig(lr=0.1))
    w = ParameterClient(zone, "j", "w0")
    w.create_job(cfg, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    w.register()
    w.pull()
    reader = ParameterClient(zone, "j", "reader")
    reader.register()
    reader.pull(min_version=0)
    assert reader.view.version == 0

    def stats() -> dict:
        return tree.lt.call(lambda: dict(tree.tier("z").jobs["j"].stats.__dict__))
    _train([w], 1)
    before = stats()
    reader.pull(min_version=1)            # 1 version behind, log holds 3: a delta
    after = stats()
    assert after["deltas_served"] - before["deltas_served"] == 1
    assert after["snapshots_served"] == before["snapshots_served"]

    _train([w], 2)                        # 2 dense deltas behind: a worker keeps no log, and
    before = stats()                      # the view itself is smaller than the two deltas
    reader.pull(min_version=3)
    after = stats()
    assert after["snapshots_served"] == before["snapshots_served"] + 1
    assert after["deltas_served"] == before["deltas_served"]
    assert (reader.view.version, reader.view.checksum) == tree.view("root", "j")[1:3]

    _train([w], 4)                        # now 4 behind a 3-entry log: snapshot
    before = stats()
    reader.pull(min_version=7)
    after = stats()
    assert after["snapshots_served"] == before["snapshots_served"] + 1
    assert after["deltas_served"] == before["deltas_served"]
    _, version, crc, values = tree.view("root", "j")
    assert (reader.view.version, reader.view.checksum) == (version, crc) == (7, crc)
    assert same_bits(reader.view.values, values)
    # The zone, a relay, keeps the log its children are served from: it took every version
    # from the root as a delta, after its first snapshot.
    root_stats = tree.lt.call(lambda: dict(tree.tier("root").jobs["j"].stats.__dict__))
    assert root_stats["snapshots_served"] == 1 and root_stats["deltas_served"] == 7
    w.close()
    reader.close()


def test_a_tier_behind_a_caller_of_its_lineage_does_not_take_the_caller_back(tree):
    """A caller holding a version this tier has not reached (a worker come over from another
    zone, a relay that failed over; the tier is cut off from its parent, or a moment behind)
    was served a snapshot of the tier's older version: the caller's version went back (a
    relay's whole subtree with it). It waits for the tier, then gets NotReady; once the tier
    catches up the caller goes forward. A tier in touch with its parent that announced less
    than the caller holds (a standby promoted by force) still serves the authority's view."""
    from ps.core.errors import Unavailable

    tree.add("root", "global")
    z1, z2 = tree.add("z1", "zone", parent="root"), tree.add("z2", "zone", parent="root")
    cfg = JobConfig(name="j", mode="async", optimizer=OptimizerConfig(lr=0.1))
    w = ParameterClient(z1, "j", "w0")
    w.create_job(cfg, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    w.register()
    w.pull()
    r = ParameterClient(z2, "j", "r0", retry_s=1)
    r.register()
    r.pull(min_version=0)
    up = tree.tier("z2").up

    async def cut_off(*a, **kw):  # z2 loses its parent: no pull, no heartbeat gets through
        up.reachable = False
        raise Unavailable("cut off (test)")
    tree.lt.call(lambda: setattr(up, "_call", cut_off))
    _train([w], 3)
    w.pull(min_version=3)
    held = tree.view("z2", "j")[1]  # (the long-poll it had out may have brought version 1)
    v = w.view
    epoch, version, values = v.epoch, v.version, v.values.copy()
    assert held < version
    r.view.load_snapshot(epoch, version, values.copy(), v.checksum, v.clock_min)  # r came over from z1
    with pytest.raises(Unavailable, match=f"holds version {held} of job 'j', behind the caller's {version}, and "
                       "is cut off from its parent"):
        r.pull(wait_s=0)  # as an async worker pulls (Unavailable: a client with alternates moves)
    assert r.view.version == version and same_bits(r.view.values, values)

    tree.lt.call(lambda: delattr(up, "_call"))  # back in touch: z2 catches up, r goes forward
    _train([w], 1)
    r.pull(min_version=version + 1, wait_s=30)
    assert (r.view.version, r.view.checksum) == tree.view("root", "j")[1:3]

    # Past what the root holds (a history its promoted standby never had): the authority's view.
    r.view.load_snapshot(epoch, 99, r.view.values.copy(), r.view.checksum, r.view.clock_min)
    r.pull(wait_s=0)
    assert (r.view.version, r.view.checksum) == tree.view("root", "j")[1:3]
    r.close(), w.close()


def test_a_relay_backs_off_from_bad_snapshots_and_its_follow_loop_outlives_a_bug(tree, monkeypatch, caplog):
    """A relay whose parent's snapshots fail their checksum (a corrupting link, releases apart)
    pulled the whole model back to back, forever; an exception that is no hps error (a reply
    nothing had checked) ended its follow loop without a word, the view frozen and ready."""
    import logging
    import time

    import ps.tiers.relay as relay_mod
    from ps.core.errors import Stale

    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    w = ParameterClient(zone, "j", "w0")
    w.create_job(JobConfig(name="j", mode="async", optimizer=OptimizerConfig(lr=0.1)), LAYOUT,
                 np.zeros(LAYOUT.numel, np.float32))
    w.register()
    w.pull()
    real, pulled = relay_mod.apply_pull, []

    def corrupt(view, layout, meta, versions, *applied):
        pulled.append(meta.snapshot)
        raise Stale("version fails its checksum (test)")
    monkeypatch.setattr(relay_mod, "apply_pull", corrupt)
    caplog.set_level(logging.WARNING, "hps.relay")
    w.push(_grad(0))  # applied at the root (async acknowledges then); the zone cannot take it
    time.sleep(1.5)
    assert 3 <= len(pulled) <= 12, f"{len(pulled)} pulls in 1.5 s"  # backoff 0.05 s .. 0.5 s
    assert any(r.levelno == logging.ERROR and "snapshot(s) in a row" in r.getMessage() for r in caplog.records)
    # and it says it lags (its status, hps_replica_lag_seconds), though its parent answers
    wait_for(lambda: fetch_status(zone).jobs[0].lag_s > 0, "the zone's lag while its pulls fail")

    def bug(view, layout, meta, versions, *applied):
        monkeypatch.setattr(relay_mod, "apply_pull", real)
        raise IndexError("a bug (test)")
    monkeypatch.setattr(relay_mod, "apply_pull", bug)
    w.push(_grad(1))
    w.pull(min_version=2, wait_s=20)  # the zone's loop went on
    assert tree.view("z", "j")[1:3] == tree.view("root", "j")[1:3]
    assert any("following job j failed" in r.getMessage() for r in caplog.records)
    w.close()
