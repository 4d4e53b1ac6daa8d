"""Issue 15 end to end: relays that list both roots of a hot-standby pair (``--parent A,B``) and a
kill -9 of the primary root during BSP training. The standby takes over, the regional master
moves to it and resumes from deltas (same view epoch, same version numbers), the workers train
on without an exception, no acknowledged version is lost and no push is applied twice."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from ps.net.rpc import Caller
from ps.net.wire import decode_pull_reply, pb
from ps.tools.launch import Cluster
from ps.tools.status import fetch_status
from tests.helpers import json_lines, step_worker

FAST = {"heartbeat_s": 0.2, "member_timeout_s": 1.5}
LEASE_S = 1.0
STEPS, KILL_AFTER = 30, 10


def _topology(tmp: Path) -> dict:
    return {"host": "127.0.0.1", "settings": FAST,
            "root": {"name": "root-a", "port": 0, "checkpoint_dir": str(tmp / "a"), "lease_s": LEASE_S,
                     "standby": {"name": "root-b", "checkpoint_dir": str(tmp / "b"), "lease_s": LEASE_S}},
            "regions": [{"name": "eu", "zones": [{"name": "eu-a"}, {"name": "eu-b"}]}]}


def _history(address: str, epoch: int) -> dict[int, int]:
    """(version -> checksum) of every delta the root at ``address`` holds, read as a relay would."""
    with Caller(address) as rpc:
        rpc.call("Register", pb.RegisterRequest(job="t", member="audit", role=pb.ROLE_ZONE, incarnation=1), 10)
        frames = rpc.stream("Pull", pb.PullRequest(job="t", member="audit", view_epoch=epoch, since_version=0), 10)
    meta, versions = decode_pull_reply(frames)
    assert not meta.snapshot
    return {vm.version: vm.checksum for vm, _ in versions}


def test_a_killed_primary_root_moves_the_relays_to_the_standby_and_training_goes_on(tmp_path, reap):
    with Cluster.start(_topology(tmp_path), tmp_path / "logs") as cluster:
        a, b = cluster.address("root-a"), cluster.address("root-b")
        assert cluster.tiers["eu"].cmd[cluster.tiers["eu"].cmd.index("--parent") + 1] == f"{a},{b}"
        ws = [step_worker(reap, cluster.address(z), f"w{i}", STEPS, 0.02, tmp_path / f"w{i}.log")
              for i, z in enumerate(("eu-a", "eu-b"))]
        first = [json_lines(w, KILL_AFTER, 90, stamped=True) for w in ws]
        assert all(len(f) == KILL_AFTER for f in first), f"no training before the kill (logs: {tmp_path})"
        assert fetch_status(b).root_state == "standby"
        cluster.stop_tier("root-a", signal.SIGKILL)
        killed_at = time.monotonic()
        rest = [json_lines(w, STEPS - KILL_AFTER, 120, stamped=True) for w in ws]
        for i, r in enumerate(rest):
            assert len(r) == STEPS - KILL_AFTER, f"w{i} stopped after {len(r)} more steps (logs: {tmp_path})"
        for w in ws:
            assert w.wait(timeout=30) == 0  # no exception in the workers
        steps = [f + r for f, r in zip(first, rest)]
        last_before = max(e["version"] for f in first for _, e in f)
        resumed = min(t for r in rest for t, e in r if e["version"] > last_before + 1)
        print(f"\nkill -9 of the primary root to the next step on a new version: {resumed - killed_at:.2f}s "
              f"(lease {LEASE_S}s, member timeout {FAST['member_timeout_s']}s)")
        assert resumed - killed_at < 5.0
        st = fetch_status(b)
        assert (st.root_state, st.term) == ("primary", 1)
        (j,) = st.jobs
        assert j.stats.double_applied == 0
        # the round in flight at the kill may be refused to its workers (told, not applied); no other
        dropped = [sum(not e["applied"] for _, e in s) for s in steps]
        assert max(dropped) <= 1, dropped
        # bsp: one version per step, none lost, none doubled; the lineage is kept (deltas, same epoch)
        for s in steps:
            versions = [e["version"] for _, e in s]
            assert versions == list(range(1, STEPS + 1)), versions
            assert {e["epoch"] for _, e in s} == {j.view_epoch}
        # every acknowledged version is on the new primary, with the checksum its workers saw
        held = _history(b, j.view_epoch)
        seen = {e["view"]: e["crc"] for s in steps for _, e in s if e["view"] == e["version"]}
        assert seen and {v: held[v] for v in seen} == seen
        assert j.version == STEPS
        # the regional master moved to the standby: its second parent
        eu = fetch_status(cluster.address("eu"))
        assert eu.parent == b and eu.parent_switches >= 1, eu
        assert "resynced from a snapshot" not in (tmp_path / "logs" / "eu.log").read_text()


def test_a_relay_restarted_after_a_takeover_leaves_the_old_primary_now_a_standby(tmp_path, reap):
    """The relay lists the old primary first; restarted after the takeover (and after the old
    primary came back as the new one's standby) it finds a root that answers but refuses
    registrations, and moves to the next parent in its list after the member timeout."""
    steps = 150  # slow enough (50 ms a step, and more) to still be training once both restarts are done
    with Cluster.start(_topology(tmp_path), tmp_path / "logs") as cluster:
        b = cluster.address("root-b")
        ws = [step_worker(reap, cluster.address(z), f"w{i}", steps, 0.05, tmp_path / f"w{i}.log")
              for i, z in enumerate(("eu-a", "eu-b"))]
        got = [json_lines(w, 5, 90, stamped=True) for w in ws]
        cluster.stop_tier("root-a", signal.SIGKILL)
        got = [g + json_lines(w, 5, 60, stamped=True) for g, w in zip(got, ws)]
        assert all(len(g) == 10 for g in got), f"no training on the standby (logs: {tmp_path})"
        cluster.restart("root-a")  # with --standby root-b: it finds b took over and follows it
        a = cluster.address("root-a")
        deadline = time.monotonic() + 30
        while (st := fetch_status(a)).term != 1 and time.monotonic() < deadline:  # until b's hello
            time.sleep(0.05)
        assert (st.root_state, st.term) == ("standby", 1)
        before = fetch_status(b).jobs[0].version
        assert before < steps - 20, "training ended before the relay's restart: slow the workers down"
        restarted = time.time()
        cluster.restart("eu")  # kill -9, then on the same port with --parent root-a,root-b
        rest = [json_lines(w, steps - 10, 120, stamped=True) for w in ws]
        for i, r in enumerate(rest):
            assert len(r) == steps - 10, f"w{i} stopped after {len(r)} more steps (logs: {tmp_path})"
        for w in ws:
            assert w.wait(timeout=30) == 0
        eu = fetch_status(cluster.address("eu"))
        assert eu.parent == b and eu.parent_switches == 1, eu
        after = min(e["t"] for r in rest for _, e in r if e["version"] > before + 1)
        print(f"\nrelay restarted with the standby first: training again after {after - restarted:.2f}s "
              f"(member timeout {FAST['member_timeout_s']}s)")
        (j,) = fetch_status(b).jobs
        assert j.stats.double_applied == 0 and j.version == steps
        assert "refused writes" in (tmp_path / "logs" / "eu.log").read_text()


def test_a_sharded_root_with_a_standby_per_shard_loses_a_primary_and_training_goes_on(tmp_path):
    """`hps launch`'s sharded root with `standby:`: shard I's standby follows shard I, the zone's
    relay for shard I lists both. A kill -9 of shard 1's primary mid-run: its standby takes over,
    the relay moves to it, and the job ends as many local torch SGD steps (no acknowledged
    version lost or doubled at either shard)."""
    import torch

    from ps.core.config import JobConfig, OptimizerConfig
    from tests.helpers import mlp_batches, mlp_loss, small_mlp
    from worker import HpsOptimizer

    topo = {"host": "127.0.0.1", "settings": FAST,
            "root": {"name": "root", "shards": [{"weight": 2}, {"weight": 1}], "checkpoint_dir": str(tmp_path / "a"),
                     "lease_s": LEASE_S, "zones": [{"name": "eu-a"}],
                     "standby": {"name": "sb", "checkpoint_dir": str(tmp_path / "b"), "lease_s": LEASE_S}}}
    steps, kill_after = 10, 5
    with Cluster.start(topo, tmp_path / "logs") as cluster:
        pairs = cluster.address("root").split(";")
        assert pairs == [f"{cluster.address(f'root-{i}')},{cluster.address(f'sb-{i}')}" for i in range(2)]
        relay = cluster.tiers["eu-a-1"]
        assert relay.cmd[relay.cmd.index("--parent") + 1] == pairs[1]
        assert fetch_status(cluster.address("sb-1")).root_state == "standby"
        model, ref = small_mlp(), small_mlp()
        ref.load_state_dict(model.state_dict())
        x, y = mlp_batches(steps, 8)
        job = JobConfig(name="t", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
        with HpsOptimizer(model, cluster.address("eu-a"), job, worker_id="w0", timeout_s=10) as opt:
            for s in range(steps):
                if s == kill_after:
                    cluster.stop_tier("root-1", signal.SIGKILL)
                opt.zero_grad()
                mlp_loss(model, x[s], y[s]).backward()
                assert opt.step().applied, s
            assert opt.version == steps
        st = fetch_status(cluster.address("sb-1"))
        assert (st.root_state, st.term) == ("primary", 1)
        assert st.jobs[0].version == steps and st.jobs[0].stats.double_applied == 0
        assert fetch_status(cluster.address("eu-a-1")).parent == cluster.address("sb-1")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(steps):
        ref_opt.zero_grad()
        mlp_loss(ref, x[s], y[s]).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
