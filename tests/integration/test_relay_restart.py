"""A relay that restarts knows no jobs until its children register again: its children must
treat that as "register again", not as "the job ended" (a regression found in review)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import UnknownJob
from ps.core.view import KeySpec, Layout
from tests.helpers import same_bits, wait_for
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (16, 8))])


def test_a_regional_master_restart_does_not_end_the_job_below_it(tree):
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    # A slow heartbeat: the zone's follow loop reaches the new parent before a heartbeat tells
    # the zone that its parent restarted (the order that exposed the bug).
    zone = tree.add("eu-a", "zone", parent="eu", heartbeat_s=2.0, member_timeout_s=8.0)
    job = JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    w = ParameterClient(zone, "j", "w0", timeout_s=10)
    w.create_job(job, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    w.register()
    w.pull(min_version=0)
    for s in range(3):
        v, _ = w.push(np.ones(LAYOUT.numel, np.float32), clock=s)
        w.pull(min_version=v)
    port = tree.servers["eu"][1]
    tree.stop("eu")
    tree.add("eu", "regional", parent="root", listen=f"127.0.0.1:{port}")  # a new incarnation
    # The zone's follow loop now hears "no such job" from its parent until it registers again.
    deadline = time.monotonic() + 30
    done = threading.Event()
    while time.monotonic() < deadline and not done.is_set():
        try:
            v, _ = w.push(np.ones(LAYOUT.numel, np.float32), clock=3)
            w.pull(min_version=v)
            done.set()
        except Exception as exc:  # Stale (aborted round) or a transient NotReady: catch up, retry
            assert "ended" not in str(exc), exc
            time.sleep(0.2)
            try:
                w.pull(wait_s=1.0)
            except Exception as exc2:
                assert "ended" not in str(exc2), exc2
    assert done.is_set(), "the worker could not train after its regional master restarted"
    assert "j" not in tree.lt.call(lambda: dict(tree.tier("eu-a").ended))
    r = tree.view("root", "j")
    assert r[1] >= 4
    assert (w.view.version, w.view.checksum) == r[1:3] and same_bits(w.view.values, r[3])
    w.close()


def _one_worker_below_a_zone(tree, root: dict | None = None, **client) -> ParameterClient:
    """A root (``root``: its settings), zone "eu-a" below it, and bsp job "j" (SGD, lr 0.1)
    created, joined and pulled by worker "w0" at the zone (``client``: its settings)."""
    tree.add("root", "global", **(root or {}))
    w = ParameterClient(tree.add("eu-a", "zone", parent="root"), "j", "w0", **client)
    w.create_job(JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=0.1)), LAYOUT,
                 np.zeros(LAYOUT.numel, np.float32))
    w.register()
    w.pull(min_version=0)
    return w


def test_a_bsp_push_on_the_held_version_moves_an_empty_round_left_behind(tree):
    """After a refusal a relay reopens the refused round; if its parent went on meanwhile, the
    relay holds a newer version than its open round (seen after a root kill -9: a zone at round
    7 holding version 8). A worker's push on the held version must open that round, not be told
    to retry forever."""
    from ps.core.consistency import BspRound

    w = _one_worker_below_a_zone(tree, timeout_s=10)
    g = np.ones(LAYOUT.numel, np.float32)
    for _ in range(2):
        version, _ = w.push(g)
        w.pull(min_version=version)
    assert w.view.version == 2

    def leave_round_behind():
        js = tree.tier("eu-a").jobs["j"]
        js.round = BspRound(round=1, numel=js.layout.numel)  # empty, behind version 2
    tree.lt.call(leave_round_behind)
    version, _ = w.push(g)  # on version 2
    assert version == 3
    w.pull(min_version=3)
    assert (w.view.version, w.view.checksum) == tree.view("root", "j")[1:3]
    w.close()


def test_children_registering_at_once_start_one_follow_loop(tree, caplog):
    """Workers register together while the parent does not hold the job yet: the first
    registration fails, the second was waiting behind it, a third comes while the second is
    on the wire. The relay holds one view and follows it with one pull loop: two loops would
    each apply every delta, the second to a view already past it, and resync from a snapshot
    at every version (found in CI as a zone warning once per version)."""
    root = tree.add("root", "global")
    zone = tree.add("eu-a", "zone", parent="root")
    relay = tree.tier("eu-a")
    job = JobConfig(name="late", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    w = ParameterClient(root, "late", "w0", timeout_s=10)
    w.create_job(job, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    real, calls = relay.up.register, []

    async def register(name: str, **kw):
        calls.append(name)
        await asyncio.sleep(0.1)  # on the wire
        if len(calls) == 1:
            raise UnknownJob("job late is not known here")  # the parent learns of it later
        return await real(name, **kw)

    async def three_children() -> list:
        relay.up.register = register
        first, second = (asyncio.create_task(relay.attach("late")) for _ in range(2))
        await asyncio.wait([first])  # the second one now takes the job's lock
        await asyncio.sleep(0.05)  # ... and its registration is on the wire
        third = asyncio.create_task(relay.attach("late"))
        return await asyncio.gather(first, second, third, return_exceptions=True)

    results = tree.lt.run(three_children())
    assert isinstance(results[0], UnknownJob) and results[1:] == [None, None], results
    assert len(calls) == 2  # the third found the job attached by the second

    def loops():
        return [t for t in relay._tasks if t.get_name() == "follow-late" and not t.done()]
    assert len(tree.lt.call(loops)) == 1
    assert tree.lt.call(lambda: len(relay._locks)) == 0  # no lock outlives its callers
    relay.up.register = real
    child = ParameterClient(zone, "late", "w1", timeout_s=10)
    child.register()
    child.pull(min_version=0)
    caplog.clear()
    for s in range(4):
        v, _ = child.push(np.ones(LAYOUT.numel, np.float32), clock=s)
        child.pull(min_version=v)
    assert child.view.version == 4 and child.view.checksum == tree.view("root", "late")[2]
    assert not [r for r in caplog.records if "does not apply" in r.getMessage()]
    child.close()
    w.close()


def test_a_child_registering_while_the_relay_leaves_its_parent_finds_it_attached(tree):
    """The last child leaves, so the relay leaves the job at its parent; a new child registers
    while that leave is still on the wire. The registration waits for the leave and attaches
    again after it: had it gone first, the leave landing after it would drop the relay at the
    parent while the relay believed itself attached (the next push then hears "forgot us")."""
    tree.add("root", "global")
    zone = tree.add("eu-a", "zone", parent="root")
    relay = tree.tier("eu-a")
    job = JobConfig(name="turn", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    first = ParameterClient(zone, "turn", "w0", timeout_s=10)
    first.create_job(job, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    first.register()
    real, left = relay.up.leave, threading.Event()

    async def slow_leave(name: str):
        left.set()
        await asyncio.sleep(0.3)  # on the wire
        return await real(name)

    relay.up.leave = slow_leave
    closing = threading.Thread(target=first.close)  # the relay's last child: it leaves the job at the root
    closing.start()
    assert left.wait(10)
    second = ParameterClient(zone, "turn", "w1", timeout_s=10)
    second.register()
    closing.join(10)
    relay.up.leave = real

    def members_at_root() -> list[str]:
        return [m.id for m in tree.tier("root").jobs["turn"].members]
    assert tree.lt.call(lambda: "turn" in relay.attached)
    assert "eu-a" in tree.lt.call(members_at_root)
    second.pull(min_version=0)
    v, _ = second.push(np.ones(LAYOUT.numel, np.float32), clock=0)
    assert v == 1
    second.close()


def test_a_forward_whose_channel_is_closed_under_it_is_sent_again_not_left_unanswered(tree):
    """grpc.aio ends a call whose channel is closed (a relay retiring an old parent's channel
    after a few switches, a certificate rotation) with asyncio.CancelledError. That escaped the
    relay's forward, so the round's batch was never answered: its workers' pushes timed out and
    their retries waited on it for good (review). It is an unknown outcome now, retried under
    the same number, and the round completes once its other member pushes."""
    from ps.net.rpc import AsyncCaller

    tree.add("root", "global", round_timeout_s=30.0)
    zone = tree.add("eu-a", "zone", parent="root", round_timeout_s=30.0)
    job = JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    below = ParameterClient(zone, "j", "w-zone", timeout_s=40, retry_s=20)
    direct = ParameterClient(tree.addr("root"), "j", "w-root", timeout_s=40, retry_s=20)
    below.create_job(job, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    below.register()
    direct.register()
    answers: list = []
    pushing = threading.Thread(target=lambda: answers.append(below.push(np.ones(LAYOUT.numel, np.float32))))
    pushing.start()
    root_job = lambda: tree.tier("root").jobs["j"]  # noqa: E731
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not tree.lt.call(lambda: root_job().round.pushed):
        time.sleep(0.05)  # the zone's forward waits in the root's round for the direct worker
    assert tree.lt.call(lambda: root_job().round.pushed), "the zone's forward never reached the root"

    async def close_under_it():
        up = tree.tier("eu-a").up
        old, up._rpc = up._rpc, AsyncCaller(up.current)
        await old.close()  # no grace: the forward's call is cancelled on the zone's side
    tree.lt.run(close_under_it())
    time.sleep(0.5)
    direct.push(np.ones(LAYOUT.numel, np.float32))
    pushing.join(timeout=30)
    assert not pushing.is_alive(), "the push through the zone was never answered"
    assert answers and answers[0][0] == 1, answers
    assert tree.view("root", "j")[1] == 1  # applied once
    below.close()
    direct.close()


def test_a_forward_broken_in_transit_with_a_grpc_status_is_retried_not_reported_refused(tree):
    """A forward whose stream was reset under it (gRPC UNKNOWN "Stream removed", no hps error
    named) while its parent applied it was passed to the workers as a final refusal; the next
    round, another sum under the same number, was then refused as a Conflict for good (review).
    It is an unknown outcome now: sent again under its number, answered with its version."""
    import grpc

    from ps.net.rpc import error_from

    class Reset(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNKNOWN

        def details(self):
            return "Stream removed"

        def trailing_metadata(self):
            return ()

    w = _one_worker_below_a_zone(tree, timeout_s=20, retry_s=10)
    up = tree.tier("eu-a").up
    real, delivered = up.push, []

    async def reset_once(frames, **kw):
        if not delivered:  # the parent gets it and applies it; the answer is lost on the way back
            delivered.append(await real(frames, **kw))
            raise error_from(Reset())
        return await real(frames, **kw)
    tree.lt.call(lambda: setattr(up, "push", reset_once))
    g = np.ones(LAYOUT.numel, np.float32)
    for step in range(3):
        version, _ = w.push(g, clock=step)
        assert version == step + 1
        w.pull(min_version=version)
    assert delivered and delivered[0].applied_version == 1
    root = tree.view("root", "j")
    assert root[1] == 3  # each step applied once
    assert (w.view.version, w.view.checksum) == root[1:3]
    w.close()


def test_a_round_closed_on_one_root_lineage_is_not_sent_up_on_the_next(tree, tmp_path):
    """A zone's closed round waits for its turn to go up (the forward lock, or settling a
    forward given up on) while the zone's view moves to the root's new lineage. It went up
    stamped with the new lineage's epoch, so the root placed gradients computed on the old
    lineage's parameters on the new one (invariant 5; after a forced takeover the numbers no
    longer name the same values). It is refused Stale, as the open rounds are (review)."""
    from ps.core.errors import Stale

    ckpt = str(tmp_path / "ckpt")
    w = _one_worker_below_a_zone(tree, dict(checkpoint_dir=ckpt), timeout_s=30, retry_s=20)
    g = np.ones(LAYOUT.numel, np.float32)
    assert w.push(g)[0] == 1
    w.pull(min_version=1)
    z = tree.tier("eu-a")
    release = asyncio.Event()

    async def hold_turn():  # another forward of the job holds the turn
        async with z._fwd_locks.setdefault("j", asyncio.Lock()):
            await release.wait()
    held = asyncio.run_coroutine_threadsafe(hold_turn(), tree.lt.loop)
    outcome: list = []

    def push() -> None:
        try:
            outcome.append(w.push(g))
        except Exception as exc:
            outcome.append(exc)
    t = threading.Thread(target=push)
    t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not tree.lt.call(lambda: any(
            task.get_coro().__name__ == "_forward" for task in z._tasks if not task.done())):
        time.sleep(0.05)  # the round closed (one worker); its forward waits for the turn
    port, epoch = tree.servers["root"][1], tree.view("eu-a", "j")[0]
    tree.stop("root")
    tree.add("root", "global", checkpoint_dir=ckpt, listen=f"127.0.0.1:{port}")
    wait_for(lambda: tree.view("eu-a", "j")[0] not in (0, epoch), "the zone to follow the new lineage", timeout=20)
    tree.lt.call(release.set)
    held.result(10)
    t.join(30)
    assert outcome and isinstance(outcome[0], Stale), outcome
    assert tree.view("root", "j")[1] == 1  # nothing of it applied
    w.close()


def test_a_snapshot_longer_than_a_calls_deadline_still_reaches_a_zone_over_a_slow_link(tree):
    """A relay's pull had one deadline for the whole call: the long-poll plus the upstream
    timeout (5 + 10 s by default). A reply that took longer to cross its link -- the first
    snapshot of a 100M-parameter model, 400 MB at 100 Mbit/s: 32 s -- never arrived, and the
    relay pulled it again, from the start, for good (review). The first frame must come within
    that time, and each next one within the upstream timeout, however long the whole takes."""
    from ps.core.config import ServerConfig
    from ps.server import create_server
    from ps.tools.wanem import Link, LinkProxy

    root = tree.add("root", "global")
    link = tree.lt.run(LinkProxy(Link(bandwidth_mbit=24.0), root).start())  # 3 MB/s: a 4 MiB frame in 1.4 s
    tree.servers["eu-a"] = tree.lt.run(create_server(ServerConfig(role="zone", name="eu-a", parent=link.address,
                                                                  upstream_timeout_s=2.0, heartbeat_s=0.1,
                                                                  member_timeout_s=5.0)))
    big = Layout([KeySpec("w", (8_000_000,))])  # 32 MB: ~11 s across the link, past 5 s + 2 s
    maker = ParameterClient(root, "big", "maker", timeout_s=30)
    w = ParameterClient(tree.addr("eu-a"), "big", "w0", timeout_s=60, retry_s=60)
    try:
        maker.create_job(JobConfig(name="big", optimizer=OptimizerConfig(kind="sgd", lr=0.1)), big,
                         np.arange(big.numel, dtype=np.float32))
        maker.close()
        w.register()
        w.pull(min_version=0, wait_s=60)
        assert w.view.ready and same_bits(w.view.values, tree.view("root", "big")[3])
    finally:
        w.close()
        tree.stop("eu-a")
        tree.lt.run(link.close())
