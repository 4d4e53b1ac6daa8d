"""SSP clock floors (invariant 3) count only applied pushes: a push raises its sender's floor
when its batch is applied, not when it is accepted, so a batch that fails (a member leaving
restarts the open window; a refused window) leaves the floor as it was. And a floor the root
could not publish is sent again, not left for the round timeout."""

from __future__ import annotations

import asyncio

import numpy as np

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
from ps.core.errors import Unavailable
from ps.core.tensors import split
from ps.core.types import PushMeta
from ps.core.view import KeySpec, Layout
from ps.tiers.root import Root

LAYOUT = Layout([KeySpec("w", (3,))])


def _push(root: Root, who: str, seq: int, clock: int):
    meta = PushMeta("j", who, seq=seq, base_version=0, incarnation=7, clock_min=clock, clock_max=clock,
                    clock_floor=clock + 1)
    return root.push(meta, split(LAYOUT, np.ones(3, np.float32), get_codec("fp32")), bytes(16))


async def _root(flush_ms: float) -> Root:
    root = Root(ServerConfig(role="global", flush_ms=flush_ms, member_timeout_s=600.0))
    await root.start()
    await root.create_job(JobConfig(name="j", mode="ssp", staleness=0, optimizer=OptimizerConfig(lr=0.1)), LAYOUT,
                          np.zeros(3, np.float32))
    for who in ("a", "b", "c"):
        await root.register("j", who, "worker", "", last_seq=0, incarnation=7)
    return root


def test_pushes_of_a_window_that_restarts_raise_no_floor():
    """a, b and c push clock 0 into a window that has not closed; c leaves, the window
    restarts and a and b are asked to push again. Their floors had been raised to 1 on
    acceptance, so the floor-only version published at c's leaving said every live worker
    had clock 0 applied: a and b then trained at clock 1 without their clock-0 gradients."""

    async def run() -> tuple[int, int, list]:
        root = await _root(flush_ms=60_000)
        pushes = [asyncio.ensure_future(_push(root, who, 1, 0)) for who in ("a", "b", "c")]
        await asyncio.sleep(0.2)
        await root.leave("j", "c")
        outcomes = await asyncio.gather(*pushes, return_exceptions=True)
        await asyncio.sleep(0.2)
        js = root.job("j")
        out = js.view.version, js.view.clock_min, [type(o).__name__ for o in outcomes]
        await root.stop()
        return out

    version, clock_min, outcomes = asyncio.run(run())
    assert outcomes[:2] == ["Unavailable", "Unavailable"]
    assert (version, clock_min) == (0, 0)


def test_a_floor_only_version_that_could_not_be_applied_is_tried_again():
    """a and b have clock 0 applied; c never pushed and leaves. The floor-only version that
    news makes was refused (the log could not be written once): nothing sent it again, and a
    and b waited for floor 1 until the round timeout."""

    async def run() -> int:
        root = await _root(flush_ms=0)
        for who in ("a", "b"):
            t = asyncio.ensure_future(_push(root, who, 1, 0))
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        js = root.job("j")
        assert js.view.clock_min == 0  # c holds the floor
        refused = []
        writable = root.writable

        def once():
            if not refused:
                refused.append(True)
                raise Unavailable("the log cannot be written (simulated)")
            return writable()
        root.writable = once
        await root.leave("j", "c")
        deadline = asyncio.get_running_loop().time() + 5.0
        while js.view.clock_min < 1 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        del t
        out = js.view.clock_min
        await root.stop()
        assert refused
        return out

    assert asyncio.run(run()) == 1


def test_a_worker_joining_through_a_zone_starts_at_the_floor_the_zone_sent_up(tree):
    """The root keeps a zone's highest reported floor. A worker joining the zone started at
    the zone's view floor, below what the zone had reported, so the root's floor could pass
    the new worker's clock with none of its gradients in (ssp(1): w2 ran ahead of w3)."""
    from ps.core.config import JobConfig
    from worker.client import ParameterClient
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    root = tree.addr("root")
    job = JobConfig(name="floors", mode="ssp", staleness=1, optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    w1 = ParameterClient(zone, job="floors", worker_id="w1")
    w1.create_job(job, LAYOUT, np.zeros(3, np.float32))
    w1.register()
    w2 = ParameterClient(root, job="floors", worker_id="w2")
    w2.register()
    clients = [w1, w2]
    try:
        g = np.ones(3, np.float32)
        for c in range(4):
            w1.pull(wait_s=5.0)
            w1.push(g, c)  # zone floor 4
        for c in range(3):
            w2.pull(wait_s=5.0)
            w2.push(g, c)  # w2's floor 3: the root's floor is 3
        w3 = ParameterClient(zone, job="floors", worker_id="w3")
        clients.append(w3)
        w3.register()
        for c in range(3, 5):
            w2.pull(wait_s=5.0)
            w2.push(g, c)  # w2's floor 5
        clock_min = tree.lt.call(lambda: tree.tier("root").jobs["floors"].view.clock_min)
        assert clock_min <= w3.start_clock, (clock_min, w3.start_clock)
    finally:
        for c in clients:
            c.close()


def test_a_zones_floor_the_root_refused_is_sent_again(tree):
    """A zone counts a floor as reported only once the root acknowledged it: counted when sent,
    a floor the root refused was never sent again (nothing above it had changed), and the root
    kept the workers at the old floor until a push brought it. Here c never pushes and leaves
    the zone; the root refuses the zone's floor-only push once, and the zone sends it again."""
    from ps.core.errors import BadInput
    from tests.helpers import wait_for
    from worker.client import ParameterClient
    tree.add("root", "global", flush_ms=0)
    zone = tree.add("z", "zone", parent="root", flush_ms=0)
    job = JobConfig(name="fl", mode="ssp", staleness=0, optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    cs = [ParameterClient(zone, job="fl", worker_id=w) for w in "abc"]
    cs[0].create_job(job, LAYOUT, np.zeros(3, np.float32))
    for c in cs:
        c.register()
    root = tree.tier("root")
    apply, refused = root._apply_durably, []

    async def refusing_a_floor(js, agg, rec, keys, step, fut):
        if not refused and not agg.contributors:  # the floor-only version the zone's news makes
            refused.append(agg.clock_max)
            root._refuse(js, agg, fut, BadInput("refused by the test: nothing was applied"))
            return
        await apply(js, agg, rec, keys, step, fut)

    root._apply_durably = refusing_a_floor
    try:
        for c in cs[:2]:
            c.pull(wait_s=5.0)
            c.push(np.ones(3, np.float32), 0)
        assert tree.lt.call(lambda: root.jobs["fl"].view.clock_min) == 0  # c holds the floor
        cs[2].close()  # leaves: the zone's floor is 1
        wait_for(lambda: tree.lt.call(lambda: root.jobs["fl"].view.clock_min) == 1, "the root's floor at 1", 10)
        assert refused
    finally:
        root._apply_durably = apply
        for c in cs[:2]:
            c.close()
