"""Alternate parents (issue 15) on a real multi-process cluster: a regional master killed with
SIGKILL and never restarted, its zones listing the other regional master as an alternate; a
zone killed under a worker that lists another zone. Training goes on through a pause; nothing
is applied twice; `hps status` shows the dead region as down."""

from __future__ import annotations

import io
import signal
import time
from pathlib import Path

import numpy as np

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import HpsError
from ps.core.view import KeySpec, Layout
from ps.tools.launch import Cluster
from ps.tools.status import fetch_status, print_tree
from ps.tools.wanem import Link, LinkProxy
from tests.helpers import json_lines, step_worker, wait_for
from worker import ParameterClient
from worker.sender import Sender

FAST = {"heartbeat_s": 0.2, "member_timeout_s": 1.5}
STEPS = 30


def _two_regions() -> dict:
    return {"host": "127.0.0.1", "settings": FAST, "root": {"name": "root", "port": 0},
            "regions": [{"name": "eu-1", "zones": [{"name": "eu-a", "alternates": ["eu-2"]}]},
                        {"name": "eu-2", "zones": [{"name": "eu-b", "alternates": ["eu-1"]}]}]}


def kill_region_and_train(tmp_path: Path, reap, steps: int = STEPS, kill_after: int = 8) -> dict:
    """Two workers in bsp, one below each regional master; kill -9 eu-1 after ``kill_after``
    steps. Returns what was measured (also used by benchmarks/failover.py)."""
    with Cluster.start(_two_regions(), tmp_path / "logs") as cluster:
        ws = [step_worker(reap, cluster.address(z), f"w{i}", steps, 0.02, tmp_path / f"w{i}.log")
              for i, z in enumerate(("eu-a", "eu-b"))]
        first = [json_lines(w, kill_after, 90, stamped=True) for w in ws]
        assert all(len(f) == kill_after for f in first), f"no training before the kill (logs: {tmp_path})"
        cluster.stop_tier("eu-1", signal.SIGKILL)
        killed_at = time.monotonic()
        rest = [json_lines(w, steps - kill_after, 120, stamped=True) for w in ws]
        for i, r in enumerate(rest):
            assert len(r) == steps - kill_after, f"w{i} stopped after {len(r)} more steps (log: {tmp_path}/w{i}.log)"
        # At most one step of the moved zone's workers is not applied: the round its push was in
        # when the region died, if the new parent had closed that round before the zone joined it
        # (the worker is told so and goes on from the next version). The other region loses none.
        dropped = [sum(not e["applied"] for _, e in r) for r in rest]
        assert dropped[0] <= 1 and dropped[1] == 0, dropped
        for w in ws:
            assert w.wait(timeout=30) == 0
        versions = [e["version"] for _, e in first[0] + rest[0]]
        # Recovery: from the kill to the first step that completed on a version made after it.
        last_before = max(e["version"] for f in first for _, e in f)
        resumed = min(t for r in rest for t, e in r if e["version"] > last_before + 1)
        root = fetch_status(cluster.address("root"))
        zone = fetch_status(cluster.address("eu-a"))
        out = io.StringIO()
        rc = print_tree(cluster.address("root"), out)
        return dict(versions=versions, recovery_s=resumed - killed_at, dropped=dropped[0], root=root, zone=zone,
                    tree=out.getvalue(), rc=rc, region2=cluster.address("eu-2"))


def test_killing_a_regional_master_moves_its_zone_to_the_alternate(tmp_path, reap):
    got = kill_region_and_train(tmp_path, reap)
    (j,) = got["root"].jobs
    assert j.stats.double_applied == 0
    # bsp: one version per step, each step's version the next one (none lost, none doubled)
    assert got["versions"] == list(range(1, STEPS + 1)), got["versions"]
    assert j.version == STEPS
    zone = got["zone"]
    assert zone.parent == got["region2"] and zone.parent_switches >= 1, zone
    assert zone.parents[1] == got["region2"]
    # within the member timeout and a few seconds (kill -9: nothing listens, the zone moves at once)
    assert got["recovery_s"] < FAST["member_timeout_s"] + 5.0, got["recovery_s"]
    print(f"\nrecovery after kill -9 of a regional master: {got['recovery_s']:.2f}s")
    # `hps status` from the root: the dead region is shown down, and the exit code says so
    assert got["rc"] != 0, got["tree"]
    assert "eu-1" in got["tree"] and "DOWN" in got["tree"], got["tree"]
    assert "eu-a" in got["tree"] and "1 switch" in got["tree"], got["tree"]


def test_a_worker_whose_zone_is_killed_moves_to_its_alternate_zone(tmp_path, reap):
    topo = {"host": "127.0.0.1", "settings": FAST,
            "root": {"name": "root", "port": 0, "zones": [{"name": "z-a"}, {"name": "z-b"}]}}
    steps, kill_after = 24, 6
    with Cluster.start(topo, tmp_path / "logs") as cluster:
        both = f"{cluster.address('z-a')},{cluster.address('z-b')}"
        ws = [step_worker(reap, both, "w0", steps, 0.02, tmp_path / "w0.log"),
              step_worker(reap, cluster.address("z-b"), "w1", steps, 0.02, tmp_path / "w1.log")]
        first = [json_lines(w, kill_after, 90, stamped=True) for w in ws]
        assert all(len(f) == kill_after for f in first), f"no training before the kill (logs: {tmp_path})"
        cluster.stop_tier("z-a", signal.SIGKILL)
        rest = [json_lines(w, steps - kill_after, 120, stamped=True) for w in ws]
        for i, r in enumerate(rest):
            assert len(r) == steps - kill_after, f"w{i} stopped after {len(r)} more steps (log: {tmp_path}/w{i}.log)"
        dropped = [sum(not e["applied"] for _, e in r) for r in rest]
        assert dropped[0] <= 1 and dropped[1] == 0, dropped  # as for a moved zone, above
        for w in ws:
            assert w.wait(timeout=30) == 0
        (j,) = fetch_status(cluster.address("root")).jobs
        assert j.stats.double_applied == 0
        assert [e["version"] for _, e in first[0] + rest[0]] == list(range(1, steps + 1))
        assert f"switching to {cluster.address('z-b')}" in (tmp_path / "w0.log").read_text()


def test_a_zone_moves_back_to_its_regional_master_once_it_serves_again(tmp_path, reap):
    """After a kill -9 of its regional master the zone trains through the alternate (in a
    deployment, another region: every round across the WAN); once its own master is back and
    ready, the zone moves back to it, instead of staying on the alternate until it restarts."""
    steps = 200
    with Cluster.start(_two_regions(), tmp_path / "logs") as cluster:
        home, away = cluster.address("eu-1"), cluster.address("eu-2")
        ws = [step_worker(reap, cluster.address(z), f"w{i}", steps, 0.05, tmp_path / f"w{i}.log")
              for i, z in enumerate(("eu-a", "eu-b"))]
        seen = [json_lines(w, 8, 90) for w in ws]
        assert all(len(s) == 8 for s in seen), f"no training before the kill (logs: {tmp_path})"

        def parent() -> str:
            return fetch_status(cluster.address("eu-a")).parent

        cluster.stop_tier("eu-1", signal.SIGKILL)
        wait_for(lambda: parent() == away, "the zone on its alternate", 30)
        for s, w in zip(seen, ws):
            s += json_lines(w, 5, 60)  # training goes on through the alternate
        cluster.restart("eu-1")
        wait_for(lambda: parent() == home, "the zone back at its regional master", 30, pause_s=0.2)
        # The alternate no longer counts the zone among the job's members (it was told it left).
        wait_for(lambda: [m.member for m in fetch_status(away).jobs[0].members] == ["eu-b"],
                 "the alternate without the zone", 10, pause_s=0.2)
        for s, w in zip(seen, ws):
            s += json_lines(w, steps - len(s), 120)
            assert w.wait(timeout=30) == 0
        assert [len(s) for s in seen] == [steps, steps], f"logs: {tmp_path}"
        # Through both moves: one version per step (none lost, none doubled), at most one step
        # of the moving zone's worker not applied per move, none of the other's.
        for s in seen:
            assert [e["version"] for e in s] == list(range(1, steps + 1)), [e["version"] for e in s]
        dropped = [sum(not e["applied"] for e in s) for s in seen]
        assert dropped[0] <= 2 and dropped[1] == 0, dropped
        assert seen[0][-1]["crc"] == seen[1][-1]["crc"]
        (j,) = fetch_status(cluster.address("root")).jobs
        assert j.stats.double_applied == 0 and j.version == steps
        zone = fetch_status(cluster.address("eu-a"))
        assert zone.parent == home and zone.parent_switches == 2, zone
        log = (tmp_path / "logs" / "eu-a.log").read_text()
        assert f"moving back to it from {away}" in log, log[-2000:]


def test_a_worker_moves_back_to_its_zone_once_it_serves_again(tmp_path, reap):
    """A worker whose zone was killed trains through the alternate zone it lists; once its own
    zone is back and ready (two health checks a member timeout apart), the worker moves back
    between two pushes, leaving the alternate at once (its rounds do not wait a member timeout
    for a worker that left), instead of staying there until it restarts."""
    topo = {"host": "127.0.0.1", "settings": FAST,
            "root": {"name": "root", "port": 0, "zones": [{"name": "z-a"}, {"name": "z-b"}]}}
    steps = 200
    with Cluster.start(topo, tmp_path / "logs") as cluster:
        home, away = cluster.address("z-a"), cluster.address("z-b")
        ws = [step_worker(reap, f"{home},{away}", "w0", steps, 0.05, tmp_path / "w0.log"),
              step_worker(reap, away, "w1", steps, 0.05, tmp_path / "w1.log")]
        seen = [json_lines(w, 8, 90) for w in ws]
        assert all(len(s) == 8 for s in seen), f"no training before the kill (logs: {tmp_path})"

        def members(address: str) -> list[str]:
            try:
                jobs = fetch_status(address).jobs
            except HpsError:  # down, or restarting
                return []
            return sorted(m.member for m in jobs[0].members) if jobs else []

        cluster.stop_tier("z-a", signal.SIGKILL)
        wait_for(lambda: members(away) == ["w0", "w1"], "the worker on the alternate zone", 30, pause_s=0.2)
        for s, w in zip(seen, ws):
            s += json_lines(w, 5, 60)  # training goes on through the alternate
        cluster.restart("z-a")
        wait_for(lambda: members(home) == ["w0"], "the worker back at its zone", 30, pause_s=0.2)
        wait_for(lambda: members(away) == ["w1"], "the alternate without the worker", 10, pause_s=0.2)
        for s, w in zip(seen, ws):
            s += json_lines(w, steps - len(s), 120)
            assert w.wait(timeout=30) == 0
        assert [len(s) for s in seen] == [steps, steps], f"logs: {tmp_path}"
        for s in seen:  # one version per step through both moves: none lost, none doubled
            assert [e["version"] for e in s] == list(range(1, steps + 1)), [e["version"] for e in s]
        dropped = [sum(not e["applied"] for e in s) for s in seen]
        assert dropped[0] <= 1 and dropped[1] == 0, dropped  # the kill's; the move back is between pushes
        assert seen[0][-1]["crc"] == seen[1][-1]["crc"]
        (j,) = fetch_status(cluster.address("root")).jobs
        assert j.stats.double_applied == 0 and j.version == steps
        assert f"moving back to it from {away}" in (tmp_path / "w0.log").read_text()


def test_an_async_worker_moves_back_to_its_zone_once_it_serves_again(tree):
    """Pipelined pushes (async, up to 4 in flight) move back too, between two pushes with none
    in flight: a move with a push still out would leave it to the alternate's round after the
    worker left it. In one process, the first zone behind a link that is cut and restored."""
    tree.add("root", "global")
    za, zb = tree.add("za", "zone", parent="root"), tree.add("zb", "zone", parent="root")
    link = tree.lt.run(LinkProxy(Link(), za).start())
    c = ParameterClient(f"{link.address},{zb}", "as", "w0", timeout_s=10)
    layout = Layout([KeySpec("w", (8,))])
    c.create_job(JobConfig(name="as", mode="async", optimizer=OptimizerConfig(kind="sgd", lr=0.01)), layout,
                 np.zeros(8, np.float32))
    c.register()
    c.pull()
    sender = Sender(c, in_flight=4)
    clock = [0]

    def push_until(cond, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
            sender.submit(np.ones(8, np.float32), clock[0], c.view.version, c.view.epoch)  # raises a push's error
            clock[0] += 1
            time.sleep(0.02)

    back = None
    try:
        push_until(lambda: clock[0] >= 10, "10 pushes", 30)
        tree.lt.run(link.close())
        push_until(lambda: c._rpc.index == 1, "the worker on its alternate zone", 30)
        assert sender.drain(30)
        back = tree.lt.run(LinkProxy(Link(), za, listen=link.address).start())
        push_until(lambda: c._rpc.index == 0, "the worker back at its first zone", 30)
        before = clock[0]
        push_until(lambda: clock[0] >= before + 5, "5 more pushes", 30)
        assert sender.drain(30)
        wait_for(lambda: tree.lt.call(lambda: "w0" not in tree.tier("zb").jobs["as"].members),
                 "the alternate no longer counting the worker", 10)
        assert tree.lt.call(lambda: tree.tier("za").jobs["as"].members.find("w0").pushes) > 0
        assert c.lost_steps == 0
        assert tree.lt.call(lambda: tree.tier("root").jobs["as"].stats.double_applied) == 0
    finally:
        sender.close()
        c.close()
        if back is not None:
            tree.lt.run(back.close())
