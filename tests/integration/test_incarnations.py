"""Exactly once across incarnations (invariant 4) on real tiers: a worker or a relay that
restarts is a new incarnation of its member id. Its predecessor's unacknowledged push leaves
the open round (the round restarts, the others resend), its own pushes are never taken for the
old one's, and a retry its restart left unplaceable is resolved at the root before anyone is
told "not applied"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.view import KeySpec, Layout
from ps.net.wire import pb, stubs
from ps.tools.launch import Cluster
from ps.tools.status import fetch_status
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (8,))])
FAST = {"heartbeat_s": 0.2, "member_timeout_s": 1.5}


def _clients(addrs: list[str], ids: list[str], lr: float = 1.0, mode: str = "bsp", **kw) -> list[ParameterClient]:
    out = [ParameterClient(a, "j", i, timeout_s=10, **kw) for a, i in zip(addrs, ids)]
    out[0].create_job(JobConfig(name="j", mode=mode, optimizer=OptimizerConfig(kind="sgd", lr=lr)), LAYOUT,
                      np.zeros(LAYOUT.numel, np.float32))
    for c in out:
        c.register()
        c.pull()
    return out


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except Exception as exc:  # asserted on by the caller
            out["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    return t, out


def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_restarted_worker_is_not_answered_with_its_old_incarnations_acks(tree):
    """Its previous push still waits in the round when it comes back with the same id: that
    push leaves the round, and the new process's pushes 1, 2, ... are applied, not answered as
    duplicates of the old ones (which left them acknowledged and never applied)."""
    root = tree.add("root", "global")
    old, b = _clients([root, root], ["a", "b"])
    t, pending = _in_thread(old.push, np.full(LAYOUT.numel, 100.0, np.float32))
    _until(lambda: tree.lt.call(lambda: "a" in tree.tier("root").jobs["j"].round.pushed), "a's push")
    old._hb_stop.set()  # the old process is gone (it stops heart-beating) ...
    new = ParameterClient(root, "j", "a", timeout_s=10)  # ... and a new one takes its id
    new.register()
    new.pull()
    t.join(10)
    assert "error" in pending  # the old push was taken out of the round, never applied
    results = {}
    tb, rb = _in_thread(b.push, np.full(LAYOUT.numel, 2.0, np.float32))
    results["a"] = new.push(np.full(LAYOUT.numel, 4.0, np.float32))
    tb.join(30)
    assert results["a"][0] == rb["result"][0] == 1
    new.pull(min_version=1)
    np.testing.assert_array_equal(new.view.values, np.full(LAYOUT.numel, -3.0, np.float32))  # (4+2)/2
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.restarted_rounds) == 1
    for c in (new, b):
        c.close()


def _applied_then_dead(tree, relay: str, w: ParameterClient) -> tuple[threading.Thread, dict, int]:
    """``w`` pushes (in a thread); ``relay`` forwards it and the root applies it as version 1,
    but the relay dies before it answers. (The thread, what its push returns, the relay's port.)"""
    forward = tree.tier(relay)._forward_one

    async def forward_then_die(js, agg, keys, floor, fut, seq):  # the ack never goes down
        import asyncio
        await forward(js, agg, keys, floor, asyncio.get_running_loop().create_future(), seq)
        await asyncio.sleep(3600)
    tree.tier(relay)._forward_one = forward_then_die
    t, out = _in_thread(w.push, np.ones(LAYOUT.numel, np.float32))
    _until(lambda: tree.view("root", "j")[1] == 1, "the root to apply version 1")
    port = tree.servers[relay][1]
    tree.stop(relay)
    return t, out, port


def _restarted_before_answering(tree, relay: str, role: str, parent: str, w: ParameterClient) -> dict:
    """``_applied_then_dead``, and a new incarnation starts on its port. What w's push returned."""
    t, out, port = _applied_then_dead(tree, relay, w)
    tree.add(relay, role, parent=parent, listen=f"127.0.0.1:{port}")  # a new incarnation
    t.join(60)
    return out


@pytest.mark.parametrize("mode", ["bsp", "ssp", "async"])
def test_a_retry_after_a_relay_restart_is_resolved_as_applied_not_stale(tree, mode):
    """The zone forwarded round 0 and the root applied it, but the zone died before it told its
    worker. The worker's retry reaches a new zone, which remembers nothing of it: the root,
    which knows the push was applied in version 1, decides before it is placed again. In bsp
    the new zone's round (1) would refuse it anyway; in ssp and async nothing did, and the new
    zone forwarded it as new: applied twice (found by a review)."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    (w,) = _clients([zone], ["w0"], mode=mode)
    out = _restarted_before_answering(tree, "z", "zone", "root", w)
    assert out.get("result", (None,))[0] == 1, out  # acknowledged as applied in version 1, once
    assert w.lost_steps == 0
    assert tree.view("root", "j")[1] == 1
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0
    w.pull(min_version=1)
    v, _ = w.push(np.ones(LAYOUT.numel, np.float32), clock=1)  # and training goes on
    assert v == 2
    w.close()


@pytest.mark.parametrize("mode", ["ssp", "async"])
def test_a_forward_retried_after_its_parent_restarted_is_resolved_not_applied_again(tree, mode):
    """The same one hop up: the regional master forwarded the zone's round and the root applied
    it, but it died before it told the zone. The zone's retry reaches a new regional master,
    which would place it as new: the root decides first, and the worker gets version 1."""
    tree.add("root", "global")
    tree.add("r", "regional", parent="root")
    zone = tree.add("z", "zone", parent="r")
    (w,) = _clients([zone], ["w0"], mode=mode)
    out = _restarted_before_answering(tree, "r", "regional", "root", w)
    assert out.get("result", (None,))[0] == 1, out  # acknowledged as applied in version 1, once
    assert tree.view("root", "j")[1] == 1
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0
    w.pull(min_version=1)
    v, _ = w.push(np.ones(LAYOUT.numel, np.float32), clock=1)  # and training goes on
    assert v == 2
    w.close()


def _both_answered(tree, applied, innocent, clients) -> None:
    """The raced push is answered as applied in version 1 (once), and the innocent push that
    shared the new tier's window with it is applied as version 2, not refused with it."""
    (ta, ra), (tb, rb) = applied, innocent
    ta.join(60)
    tb.join(60)
    assert ra.get("result", (None,))[0] == 1, ra
    assert rb.get("result", (None,))[0] == 2, rb
    assert tree.view("root", "j")[1] == 2
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0
    for c in clients:
        c.close()


def test_a_resend_that_reaches_a_restarted_zone_before_its_sender_noticed_is_resolved_first(tree):
    """The race a sender cannot close alone. a's push was forwarded and applied as version 1,
    but the zone died before it answered. a's heartbeat registers it at the zone's new
    incarnation while a's resend is on its way, so a still believes it talks to the zone it
    sent to and does not ask the root first. The new zone, remembering nothing, placed the push
    as new in one window with b's: the root refuses such a window whole (it sums an applied
    push with new ones), so b's innocent push failed too (Conflict). The resend now says it is
    one (its end marker, outside the digest); the zone asks the root before placing it."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    a, b = _clients([zone, zone], ["a", "b"], mode="async")
    a._hb_stop.set()  # the registration the race needs is the test's own (below)
    ta, ra, port = _applied_then_dead(tree, "z", a)
    old_epoch = a.server_epoch
    raced: dict = {}
    call = a._call

    def racing_call(name, request, timeout=None):
        if name == "Push" and not raced:
            # The heartbeat's registration at the new zone lands while the resend is on its
            # way; b's push opens a window there (held 3 s) that the resend joins.
            with grpc.insecure_channel(zone) as ch:
                raced["epoch"] = stubs(ch)["Register"](pb.RegisterRequest(
                    job="j", member="a", role=pb.ROLE_WORKER, last_seq=0, incarnation=a.incarnation),
                    timeout=10).server_epoch
            raced["b"] = _in_thread(b.push, np.full(LAYOUT.numel, 2.0, np.float32))
            _until(lambda: tree.lt.call(lambda: bool(tree.tier("z").jobs["j"].window.pushed)),
                   "b's push in the new zone's window")
            raced["a_epoch"] = a.server_epoch
        return call(name, request, timeout)
    a._call = racing_call
    # It remembers nothing; it keeps a (whose heartbeat is stopped) through the 3 s window.
    tree.add("z", "zone", parent="root", listen=f"127.0.0.1:{port}", flush_ms=3000, member_timeout_s=30.0)
    ta.join(60)
    assert raced and raced["a_epoch"] == old_epoch != raced["epoch"], raced  # a had not noticed
    _both_answered(tree, (ta, ra), raced["b"], (a, b))


def test_a_forward_resent_to_a_restarted_parent_before_the_relay_noticed_is_resolved_first(tree):
    """The same race one hop up: zone z1's forward was applied as version 1, but the regional
    master died before it answered. z1 is registered at the new regional master (as its
    heartbeat would) while its resend is on its way, and z2's forward opens a window there:
    the resend says it is one, so the regional master asks the root before placing it, and
    z2's push is not refused with it."""
    import asyncio
    tree.add("root", "global")
    tree.add("r", "regional", parent="root")
    z1, z2 = tree.add("z1", "zone", parent="r"), tree.add("z2", "zone", parent="r")
    a, b = _clients([z1, z2], ["a", "b"], mode="async")
    relay = tree.tier("z1")
    tree.lt.call(lambda: [t.cancel() for t in relay._tasks if t.get_name() == "heartbeat"])  # registered below
    ta, ra, port = _applied_then_dead(tree, "r", a)
    old_epoch = relay.up.server_epoch
    raced: dict = {}
    push = relay.up.push

    def race() -> None:
        with grpc.insecure_channel(tree.addr("r")) as ch:
            raced["epoch"] = stubs(ch)["Register"](pb.RegisterRequest(
                job="j", member=relay.member_id, role=pb.ROLE_ZONE, address=relay.up.own_address,
                last_seq=0, incarnation=relay.epoch), timeout=10).server_epoch
        raced["b"] = _in_thread(b.push, np.full(LAYOUT.numel, 2.0, np.float32))
        _until(lambda: tree.lt.call(lambda: bool(tree.tier("r").jobs["j"].window.pushed)),
               "z2's forward in the new regional master's window")

    async def racing_push(frames, timeout, job=None):
        if not raced:
            await asyncio.to_thread(race)
            raced["relay_epoch"] = relay.up.server_epoch
        return await push(frames, timeout, job)
    relay.up.push = racing_push
    tree.add("r", "regional", parent="root", listen=f"127.0.0.1:{port}", flush_ms=3000, member_timeout_s=30.0)
    ta.join(60)
    assert raced and raced["relay_epoch"] == old_epoch != raced["epoch"], raced  # z1 had not noticed
    _both_answered(tree, (ta, ra), raced["b"], (a, b))


def _topology() -> dict:
    # A member timeout longer than a restart: the new eu replaces the old one while the root's
    # round still waits for it (with a shorter one the root drops eu and moves on without its
    # push, which is then honestly "not applied"). 30 s: under load a restarted tier has taken
    # 9 s to register again (two suites at once), past the 8 s this used.
    slow = {"heartbeat_s": 0.2, "member_timeout_s": 30.0}
    return {"host": "127.0.0.1", "settings": slow, "root": {"name": "root", "port": 0},
            "regions": [{"name": "eu", "zones": [{"name": "eu-a"}]},
                        {"name": "us", "zones": [{"name": "us-a"}]}]}


def test_kill_9_of_a_regional_master_with_a_push_in_the_roots_open_round_applies_it_once(tmp_path):
    """The root holds eu's aggregate in its open round when eu is killed. eu comes back as a new
    incarnation; its zone resends the same gradient. Tagged gradients (1 from eu, 10 from us)
    show what the root applied: (1 + 10) / 2 once, not (1 + 1 + 10) / 3."""
    with Cluster.start(_topology(), tmp_path / "logs") as cluster:
        ce, cu = _clients([cluster.address("eu-a"), cluster.address("us-a")], ["we", "wu"])
        te, oe = _in_thread(ce.push, np.ones(LAYOUT.numel, np.float32))
        _until(lambda: fetch_status(cluster.address("root")).jobs[0].round_pushed == 1,
               "eu's aggregate to reach the root's open round")
        cluster.restart("eu", signal.SIGKILL)
        # The new eu registers (its zone's resend brings it) and replaces the dead one, whose
        # aggregate leaves the root's open round; only then does us push.
        log = tmp_path / "logs" / "root.log"
        _until(lambda: "restarted without 'eu' (was replaced by a new incarnation" in log.read_text(),
               "the root to take the dead eu's aggregate out of its open round", timeout=60.0)
        tu, ou = _in_thread(cu.push, np.full(LAYOUT.numel, 10.0, np.float32))
        te.join(60)
        tu.join(60)
        assert oe.get("result", (None,))[0] == 1 and ou.get("result", (None,))[0] == 1, (oe, ou)
        root = fetch_status(cluster.address("root")).jobs[0]
        assert root.version == 1
        for c in (ce, cu):
            c.pull(min_version=1)
            np.testing.assert_array_equal(c.view.values, np.full(LAYOUT.numel, -5.5, np.float32))
        # Training goes on through the new regional master.
        tu, ou = _in_thread(cu.push, np.ones(LAYOUT.numel, np.float32), 1)
        assert ce.push(np.ones(LAYOUT.numel, np.float32), clock=1)[0] == 2
        tu.join(30)
        assert ou.get("result", (None,))[0] == 2, ou
        for c in (ce, cu):
            c.close()


@pytest.mark.parametrize("overlap", ["0", "1"], ids=["whole-pushes", "streamed-from-backward"])
def test_a_zone_restart_does_not_end_the_training_loop_and_loses_nothing(tmp_path, reap, overlap):
    """kill -9 and restart a zone while its worker trains: the loop runs to its end without an
    exception, and every step the worker was told was applied is in the root's versions once
    (a single worker makes one version per applied step). Also with pushes streamed from
    backward hooks (HPS_OVERLAP=1), which a kill can cut after the header or mid-gradient."""
    topo = {"host": "127.0.0.1", "settings": FAST, "root": {"name": "root", "port": 0},
            "regions": [{"name": "eu", "zones": [{"name": "eu-a"}]}]}
    with Cluster.start(topo, tmp_path / "logs") as cluster:
        log = open(tmp_path / "w0.log", "wb")
        w = subprocess.Popen([sys.executable, "-m", "tests.integration._worker", "--address",
                              cluster.address("eu-a"), "--worker-id", "w0", "--steps", "40", "--sleep",
                              "0.05"], stdout=subprocess.PIPE, stderr=log, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "HPS_OVERLAP": overlap})
        reap(w)
        lines = [json.loads(w.stdout.readline()) for _ in range(8)]
        cluster.restart("eu-a", signal.SIGKILL)
        lines += [json.loads(line) for line in w.stdout]
        assert w.wait(timeout=60) == 0, Path(tmp_path / "w0.log").read_text()[-3000:]
        assert len(lines) == 40
        applied = sum(e["applied"] for e in lines)
        root = fetch_status(cluster.address("root")).jobs[0]
        assert root.version == applied, (root.version, applied)
        assert lines[-1]["version"] == root.version and lines[-1]["crc"] == root.checksum

