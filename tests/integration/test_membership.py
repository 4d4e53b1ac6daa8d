"""Membership in BSP: a worker joining mid-run starts from a snapshot and is waited for from
its first round on; a worker that leaves no longer holds the round."""

from __future__ import annotations

import threading
import time

import numpy as np

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.view import KeySpec, Layout
from tests.helpers import same_bits
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (100,))])


def _loop(client, steps, errors):
    try:
        for s in range(steps):
            v, _ = client.push(np.full(LAYOUT.numel, 0.01 * (s + 1), np.float32), clock=s)
            client.pull(min_version=v)
    except Exception as exc:
        errors.append(exc)


def test_late_joiner_starts_from_a_snapshot_and_joins_the_rounds(tree):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    a = ParameterClient(zone, "j", "a")
    a.create_job(JobConfig(name="j", optimizer=OptimizerConfig(lr=0.1)), LAYOUT,
                 np.zeros(LAYOUT.numel, np.float32))
    a.register()
    a.pull()
    errors: list = []
    _loop(a, 5, errors)
    assert not errors and a.view.version == 5

    late = ParameterClient(zone, "j", "late")
    late.register()
    assert late.start_version == 5
    snaps = tree.lt.call(lambda: tree.tier("z").jobs["j"].stats.snapshots_served)
    late.pull(min_version=late.start_version)
    assert tree.lt.call(lambda: tree.tier("z").jobs["j"].stats.snapshots_served) == snaps + 1
    assert same_bits(late.view.values, a.view.values) and late.view.version == 5

    # From round 5 on, both are in every round: a alone cannot complete one.
    ta = threading.Thread(target=_loop, args=(a, 1, errors))
    ta.start()
    ta.join(1.0)
    assert ta.is_alive(), "the round closed without the member that joined"
    _loop(late, 1, errors)
    ta.join(10)
    assert not errors and a.view.version == late.view.version == 6
    contributors = tree.lt.call(lambda: tree.tier("root").jobs["j"].log.since(5, 6)[0].contributors)
    assert contributors == 2

    # A member that leaves stops holding rounds at once (no timeout needed).
    late.close()
    _loop(a, 2, errors)
    assert not errors and a.view.version == 8
    a.close()


def test_a_silent_member_is_dropped_after_the_timeout_and_the_round_completes(tree):
    tree.add("root", "global", member_timeout_s=0.6, heartbeat_s=0.1)
    a, b = ParameterClient(tree.addr("root"), "j", "a"), ParameterClient(tree.addr("root"), "j", "b")
    a.create_job(JobConfig(name="j"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    for c in (a, b):
        c.register()
        c.pull()
    b._hb_stop.set()  # b goes silent (as if its process hung) without leaving
    errors: list = []
    _loop(a, 3, errors)
    assert not errors and a.view.version == 3
    members = tree.lt.call(lambda: [m.id for m in tree.tier("root").jobs["j"].members])
    assert members == ["a"]
    a.close()


def test_a_failed_pass_of_member_expiry_does_not_end_expiry(tree, caplog):
    """One pass that raises is logged, and the next pass runs: a silent member is still
    dropped and the round it held completes (before, the exception ended the expiry task
    for good, and every later round waited forever for members long gone)."""
    tree.add("root", "global", member_timeout_s=0.6, heartbeat_s=0.1)
    root = tree.tier("root")
    passes: list[float] = []
    real = root._expire

    async def flaky(now: float) -> None:
        passes.append(now)
        if len(passes) == 1:
            raise RuntimeError("a pass that fails")
        await real(now)

    tree.lt.call(lambda: setattr(root, "_expire", flaky))
    a = ParameterClient(tree.addr("root"), "j", "a", round_timeout_s=15)  # a round held forever fails
    b = ParameterClient(tree.addr("root"), "j", "b")
    a.create_job(JobConfig(name="j"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    for c in (a, b):
        c.register()
        c.pull()
    b._hb_stop.set()  # b goes silent without leaving
    errors: list = []
    _loop(a, 2, errors)
    assert not errors and a.view.version == 2
    assert len(passes) > 2 and "expiring members failed" in caplog.text
    assert tree.lt.call(lambda: [m.id for m in root.jobs["j"].members]) == ["a"]
    a.close()


def test_a_stall_of_the_tiers_own_loop_is_not_its_members_silence(tree, caplog):
    """The tier's event loop blocked for 3x the member timeout (a long synchronous step, a GC
    pause, a starved CPU): the heartbeats sent meanwhile wait in its queue, and no member is
    dropped for that (before, every member of every job was dropped at once, and an outer
    job's workers lost a step each). A member silent after the stall still is dropped."""
    tree.add("root", "global", member_timeout_s=0.6, heartbeat_s=0.1)
    root = tree.tier("root")
    a, b = ParameterClient(tree.addr("root"), "j", "a"), ParameterClient(tree.addr("root"), "j", "b")
    a.create_job(JobConfig(name="j"), LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    for c in (a, b):
        c.register()
        c.pull()
    tree.lt.call(lambda: time.sleep(1.8))  # on the loop's thread: nothing else runs there meanwhile
    time.sleep(0.5)  # expiry passes after the stall
    assert tree.lt.call(lambda: sorted(m.id for m in root.jobs["j"].members)) == ["a", "b"]
    assert tree.lt.call(lambda: root.jobs["j"].stats.members_expired) == 0
    assert "stalled for" in caplog.text
    b._hb_stop.set()  # b goes silent without leaving
    errors: list = []
    _loop(a, 2, errors)
    assert not errors and a.view.version == 2
    assert tree.lt.call(lambda: [m.id for m in root.jobs["j"].members]) == ["a"]
    a.close()
