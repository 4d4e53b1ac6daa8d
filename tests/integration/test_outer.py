"""Mode outer (issue 17): regions run bsp inner loops and sync pseudo-gradients with the root.

Real tiers on loopback: a root, two regional masters (each runs its region's inner loop), a zone
under each, two workers per zone.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import ps.tiers.outersync
from ps.core.config import JobConfig, OptimizerConfig, OuterConfig, ServerConfig
from ps.core.errors import BadInput, HpsError
from ps.core.outer import OuterPlan, StepRate
from ps.core.view import KeySpec, Layout
from ps.server import create_server
from ps.tools.wanem import Link, LinkProxy
from tests.helpers import FAST, ServeProcess, mlp_batches, mlp_loss, same_bits, small_mlp, train_mlp, wait_for
from worker import HpsOptimizer, ParameterClient

STEPS, WORKERS, PER_WORKER = 12, 4, 8


def _model() -> torch.nn.Module:
    return small_mlp()


def _data():
    return mlp_batches(STEPS, WORKERS * PER_WORKER)


_loss = mlp_loss


def _two_regions(tree, zones_each: int = 1) -> list[str]:
    """Zones in the order workers are spread over them (worker i on zone i % len): eu, us, eu, ..."""
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    tree.add("us", "regional", parent="root")
    return [tree.add(f"{r}-{z}", "zone", parent=r) for z in "ab"[:zones_each] for r in ("eu", "us")]


def _zone_under(tree, name: str, parent: str) -> str:
    """A zone in this process under a parent elsewhere (a regional master's process)."""
    cfg = ServerConfig(role="zone", name=name, parent=parent, **FAST)
    tree.servers[name] = tree.lt.run(create_server(cfg))
    return tree.addr(name)


def _train(zones: list[str], job: JobConfig, steps: int = STEPS) -> dict[int, list[torch.Tensor]]:
    """Four workers, worker i on zone i % len(zones), each on its slice of every step's batch."""
    return train_mlp(zones, job, steps, WORKERS, PER_WORKER, data_steps=STEPS)


def test_outer_with_one_inner_step_equals_bsp(tree):
    """H = 1, one fragment, lossless codecs, inner SGD, outer SGD at lr 1 without momentum: the
    outer job makes the bsp job's parameters, to fp32 summation order."""
    zones = _two_regions(tree)
    inner = OptimizerConfig(kind="sgd", lr=0.1)
    bsp = _train(zones, JobConfig(name="eq-bsp", optimizer=inner, min_workers=WORKERS))
    outer = OuterConfig(inner_steps=1, codec="fp32", delta_codec="fp32", optimizer=OptimizerConfig(kind="sgd", lr=1.0))
    got = _train(zones, JobConfig(name="eq-outer", mode="outer", optimizer=inner, outer=outer,
                                  min_workers=WORKERS))
    start = [p.detach() for p in _model().parameters()]
    for i in range(WORKERS):
        for a, b, p0 in zip(got[i], bsp[i], start):
            assert not torch.equal(b, p0)
            rel = float((a - b).norm() / b.norm())
            assert rel <= 1e-5, f"worker {i}: outer differs from bsp by {rel:.2e}"
    # Both regions hold the same outer version, and it was synced once per inner step.
    for name in ("eu", "us"):
        st = tree.lt.call(lambda n=name: tree.tier(n).inner.jobs["eq-outer"].stats)
        assert st.outer_syncs == STEPS and st.outer_sync_failures == 0
    eu, us = tree.view("eu", "eq-outer"), tree.view("us", "eq-outer")  # the relay side: the outer view
    assert eu[1] == us[1] == STEPS and eu[2] == us[2] and same_bits(eu[3], us[3])


def test_wrong_outer_arithmetic_would_be_caught(tree):
    """The equality above is not loose: outer lr 0.5 (half of each step) is far from bsp."""
    zones = _two_regions(tree)
    inner = OptimizerConfig(kind="sgd", lr=0.1)
    bsp = _train(zones, JobConfig(name="ne-bsp", optimizer=inner, min_workers=WORKERS), steps=4)
    outer = OuterConfig(inner_steps=1, codec="fp32", delta_codec="fp32", optimizer=OptimizerConfig(kind="sgd", lr=0.5))
    got = _train(zones, JobConfig(name="ne-outer", mode="outer", optimizer=inner, outer=outer,
                                  min_workers=WORKERS), steps=4)
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(got[0], bsp[0]))
    assert rel > 1e-3


def _step_in_turn(zones: list[str], job: JobConfig, steps: int, tag: str) -> list[torch.nn.Module]:
    """One worker per region (eu on zones[0], us on zones[1]), stepping in turn: eu, us, eu, ...
    (one region's sync at a time), each on its half of every step's batch; their models."""
    x, y = mlp_batches(steps, 2 * PER_WORKER)
    models = [_model(), _model()]
    opts = [HpsOptimizer(m, zones[i], job, worker_id=f"{tag}-w{i}", timeout_s=10) for i, m in enumerate(models)]
    try:
        for s in range(steps):
            for i, opt in enumerate(opts):
                sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
                opt.zero_grad()
                _loss(models[i], x[s, sl], y[s, sl]).backward()
                assert opt.step().applied
    finally:
        for opt in opts:
            opt.close()
    return models


def _grad_at(model: torch.nn.Module, values: list[torch.Tensor], x, y) -> list[torch.Tensor]:
    """The loss gradient of ``model`` with its parameters set to ``values`` (a region's base)."""
    for p, v in zip(model.parameters(), values, strict=True):
        p.data.copy_(v)
        p.grad = None
    _loss(model, x, y).backward()
    return [p.grad for p in model.parameters()]


def test_asynchronous_outer_steps_apply_each_regions_pseudo_gradient_at_its_share(tree):
    """Asynchronous outer steps, H = 1, lossless, inner SGD, outer SGD at lr 1 without momentum,
    one worker per region, steps alternating eu, us, eu, ...: the root applies each region's
    pseudo-gradient alone, at its share of the workers (1/2), and the region rebases on the
    outer view. Computed by hand beside it: each region's pseudo-gradient is taken from its own
    base (the outer view at its last sync, which the other region has moved since). Fails if
    the root waited for both regions, applied a region at full weight, or a region differenced
    against the latest outer view."""
    zones = _two_regions(tree)
    lr, steps = 0.1, 4
    outer = OuterConfig(inner_steps=1, codec="fp32", delta_codec="fp32", asynchronous=True,
                        optimizer=OptimizerConfig(kind="sgd", lr=1.0))
    job = JobConfig(name="as-eq", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=lr), outer=outer)
    models, (x, y) = _step_in_turn(zones, job, steps, "as"), mlp_batches(steps, 2 * PER_WORKER)
    ref = _model()
    # By hand: the outer parameters, and each region's base (what it last rebased on).
    outer_p = [p.detach().clone() for p in ref.parameters()]
    bases = [[p.clone() for p in outer_p] for _ in range(2)]
    for s in range(steps):
        for i in range(2):
            sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
            pseudo = [lr * g for g in _grad_at(ref, bases[i], x[s, sl], y[s, sl])]  # base - (base - lr g)
            outer_p = [o - 0.5 * g for o, g in zip(outer_p, pseudo, strict=True)]  # its share: 1 of 2
            bases[i] = [o.clone() for o in outer_p]
    for a, b in zip(models[1].parameters(), outer_p, strict=True):  # us synced last: it holds the outer view
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    root = tree.view("root", job.name)
    assert root[1] == 2 * steps  # one outer version per region's sync: none waited for the other
    flat = np.concatenate([t.reshape(-1).numpy() for t in outer_p])
    np.testing.assert_allclose(root[3], flat, rtol=1e-5, atol=1e-6)


def test_a_region_whose_workers_left_weighs_its_last_syncs_by_the_workers_that_trained_them(tree):
    """Asynchronous: the root applies a region's pseudo-gradient at its share of the workers.
    eu's two workers train one step of four and leave, and eu sends that step: it counted as
    one worker (a memberless region's floor): with two workers at us, the root would apply it
    at 2/3 of a step instead of 2/4, and us's next ones at 2/3 (review). Checked here on the
    share eu reports once its workers are gone."""
    zones = _two_regions(tree)
    outer = OuterConfig(inner_steps=4, codec="fp32", delta_codec="fp32", asynchronous=True)
    job = JobConfig(name="as-left", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.1), outer=outer,
                    min_workers=2)
    x, y = mlp_batches(1, 2 * PER_WORKER)
    eu = tree.tier("eu")

    def worker(i: int) -> None:
        model = _model()
        with HpsOptimizer(model, zones[0], job, worker_id=f"as-left-{i}", timeout_s=20) as opt:
            opt.zero_grad()
            sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
            _loss(model, x[0, sl], y[0, sl]).backward()
            assert opt.step().applied
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    wait_for(lambda: tree.lt.call(lambda: "as-left" not in eu.attached), "eu leaving the root's rounds", 30)
    assert tree.lt.call(lambda: eu.inner.jobs["as-left"].stats.outer_syncs) == 1
    assert tree.lt.call(lambda: eu.workers_below(eu.jobs["as-left"])) == 2


def test_delayed_nesterov_moves_the_outer_momentum_once_per_round_of_regions(tree):
    """The same alternating run with the outer optimizer SGD, Nesterov 0.9, lr 0.7 and
    ``nesterov_delay=2`` (two regions): each region's update moves the outer parameters by its
    own pseudo-gradient at once, and every second update adds the momentum (m = 0.9 m + the two
    updates' sum), computed by hand beside it."""
    zones = _two_regions(tree)
    lr, steps, olr, beta = 0.1, 4, 0.7, 0.9
    outer = OuterConfig(inner_steps=1, codec="fp32", delta_codec="fp32", asynchronous=True, nesterov_delay=2,
                        optimizer=OptimizerConfig(kind="sgd", lr=olr, momentum=beta, nesterov=True))
    job = JobConfig(name="as-dn", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=lr), outer=outer)
    _step_in_turn(zones, job, steps, "dn")
    x, y = mlp_batches(steps, 2 * PER_WORKER)
    ref = _model()
    outer_p = [p.detach().clone() for p in ref.parameters()]
    bases = [[p.clone() for p in outer_p] for _ in range(2)]
    momentum: list | None = None
    for s in range(steps):
        total = [torch.zeros_like(p) for p in outer_p]
        for i in range(2):
            sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
            g = [0.5 * lr * d for d in _grad_at(ref, bases[i], x[s, sl], y[s, sl])]  # its share of its own
            outer_p = [o - olr * d for o, d in zip(outer_p, g, strict=True)]
            total = [t + d for t, d in zip(total, g, strict=True)]
            if i == 1:  # the second update of the round: the momentum
                momentum = total if momentum is None else [beta * m + t for m, t in zip(momentum, total, strict=True)]
                outer_p = [o - olr * beta * m for o, m in zip(outer_p, momentum, strict=True)]
            bases[i] = [o.clone() for o in outer_p]
    flat = np.concatenate([t.reshape(-1).numpy() for t in outer_p])
    np.testing.assert_allclose(tree.view("root", job.name)[3], flat, rtol=1e-5, atol=1e-6)


def test_asynchronous_updates_arriving_together_are_applied_one_at_a_time(tree, monkeypatch):
    """Three regions sync every inner step, at the same time (a worker each, in threads), and
    the root takes 50 ms over each version (its event loop free meanwhile), so two regions'
    updates arrive while a third's is applied: each is still an outer version of its own, never
    summed with another (delayed Nesterov counts them, damping is by each one's staleness).
    The root's version is the regions' syncs, exactly (summed when they met, as before this
    was refused: 17 and 18 of 24 in two runs)."""
    import asyncio

    from ps.tiers.root import Root

    async def slow(self, js, rec):
        await asyncio.sleep(0.05)
    monkeypatch.setattr(Root, "_after_version", slow)  # the global root's (a region's own root overrides it)
    tree.add("root", "global")
    regions = ("eu", "us", "ap")
    for r in regions:
        tree.add(r, "regional", parent="root")
    zones = [tree.add(f"{r}-a", "zone", parent=r) for r in regions]
    outer = OuterConfig(inner_steps=1, codec="fp32", delta_codec="fp32", asynchronous=True, nesterov_delay=3,
                        optimizer=OptimizerConfig(kind="sgd", lr=0.7, momentum=0.9, nesterov=True))
    job = JobConfig(name="as-together", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.1), outer=outer)
    train_mlp(zones, job, 8, 3, PER_WORKER)
    syncs = [tree.lt.call(lambda r=r: tree.tier(r).inner.jobs[job.name].stats.outer_syncs) for r in regions]
    assert syncs == [8, 8, 8]
    assert tree.view("root", job.name)[1] == 24


def test_a_slow_region_does_not_hold_a_fast_one_with_asynchronous_outer_steps(tree):
    """The slow region's worker does not step at all until the fast region's worker has done
    all of its steps (an event, not a timing): with synchronous outer steps the fast region's
    first sync would wait for the slow one for ever; asynchronous, it syncs H = 2 inner steps at a
    time, alone, and the slow region then joins the outer view the fast one left."""
    zones = _two_regions(tree)
    outer = OuterConfig(inner_steps=2, codec="int8", asynchronous=True)
    job = JobConfig(name="as-slow", mode="outer", optimizer=OptimizerConfig(kind="adamw", lr=0.01), outer=outer,
                    damping=True)
    x, y = mlp_batches(STEPS, 2 * PER_WORKER)
    fast_done, errors = threading.Event(), []
    models = [_model(), _model()]
    opts = [HpsOptimizer(m, zones[i], job, worker_id=f"sl-w{i}", timeout_s=10) for i, m in enumerate(models)]

    def run(i: int, steps: int) -> None:
        try:
            if i == 1:
                assert fast_done.wait(120), "the fast region never finished"
            for s in range(steps):
                sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
                opts[i].zero_grad()
                _loss(models[i], x[s, sl], y[s, sl]).backward()
                assert opts[i].step().applied
            if i == 0:
                fast_done.set()
        except Exception as exc:  # surfaced below
            errors.append(exc)
            fast_done.set()
    threads = [threading.Thread(target=run, args=(0, STEPS)), threading.Thread(target=run, args=(1, 4))]
    try:
        [t.start() for t in threads]
        [t.join(180) for t in threads]
    finally:
        for opt in opts:
            opt.close()
    assert not errors, errors
    eu = tree.lt.call(lambda: tree.tier("eu").inner.jobs[job.name].stats)
    us = tree.lt.call(lambda: tree.tier("us").inner.jobs[job.name].stats)
    assert (eu.outer_syncs, us.outer_syncs) == (STEPS // 2, 2)
    assert eu.outer_sync_failures == us.outer_sync_failures == 0
    root = tree.view("root", job.name)
    assert root[1] == STEPS // 2 + 2 and tree.view("us", job.name)[1] == root[1]
    # The slow region's first pseudo-gradient was computed from outer version 0 and applied after
    # the fast region's STEPS // 2: that is its staleness (damping scales it by 1 / (1 + it)).
    # Labelled with the version it was sent at, it read 0 and damping did nothing.
    stats = tree.lt.call(lambda: tree.tier("root").jobs[job.name].stats)
    assert stats.staleness_max >= STEPS // 2, stats.staleness_max


class _FixedRate(StepRate):
    """A region's inner step rate, fixed (the plumbing under test, not the clock)."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def step(self, now: float) -> None:
        pass

    def close(self) -> float:
        return self.rate


def test_dynamic_steps_scale_each_regions_h_by_its_speed_against_the_fastest(tree):
    """H = 4 is the fastest region's. The regions report 10 and 5 inner steps per second (fixed
    here, so no timing is involved) with their pseudo-gradients; the root answers the fastest
    rate it heard, and the slower region then syncs every 4 * 5 / 10 = 2 inner steps while the
    fast one keeps 4. eu trains its 12 steps first (asynchronous: nobody waits), so us's first
    acknowledgement already carries eu's rate: us syncs at 4, 6, 8, 10, 12."""
    zones = _two_regions(tree)
    outer = OuterConfig(inner_steps=4, codec="fp32", delta_codec="fp32", asynchronous=True, dynamic_steps=True)
    job = JobConfig(name="as-dyn", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.05), outer=outer)
    x, y = mlp_batches(STEPS, 2 * PER_WORKER)
    models = [_model(), _model()]
    opts = [HpsOptimizer(m, zones[i], job, worker_id=f"dy-w{i}", timeout_s=10) for i, m in enumerate(models)]
    try:
        for region, rate in (("eu", 10.0), ("us", 5.0)):
            def fix(region=region, rate=rate):
                tree.tier(region).outer[job.name].rate = _FixedRate(rate)
            tree.lt.call(fix)
        for i in (0, 1):
            for s in range(STEPS):
                sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
                opts[i].zero_grad()
                _loss(models[i], x[s, sl], y[s, sl]).backward()
                assert opts[i].step().applied
    finally:
        for opt in opts:
            opt.close()
    eu = tree.lt.call(lambda: tree.tier("eu").inner.jobs[job.name].stats)
    us = tree.lt.call(lambda: tree.tier("us").inner.jobs[job.name].stats)
    assert (eu.inner_steps_per_sync, us.inner_steps_per_sync) == (4, 2)
    assert (eu.outer_syncs, us.outer_syncs) == (3, 5)
    assert eu.inner_steps_since_sync == us.inner_steps_since_sync == 0
    assert eu.outer_sync_failures == us.outer_sync_failures == 0
    assert tree.view("root", job.name)[1] == 8


def test_dynamic_steps_need_asynchronous_outer_steps():
    with pytest.raises(BadInput, match="dynamic_steps applies to asynchronous"):
        OuterConfig(inner_steps=4, dynamic_steps=True)


@pytest.mark.parametrize("fragments, codec", [(1, "int8"), (2, "int8"), (1, "int4")])
def test_fragments_sync_in_turn_and_replicas_agree(tree, fragments, codec):
    """H = 4: each fragment is synced exactly once per H inner steps; the zone holds its
    region's inner view bit for bit; both regions hold the same outer version. Two zones per
    region: their first registrations arrive together and make one inner job. int4: both ways
    (pseudo-gradients up, outer versions down). As the workers leave, a region sends what
    every fragment trained since its last sync (F - 1 more syncs after the 8 steps: before, the
    other fragments' last steps stayed in no sync, not counted lost), then leaves."""
    zones = _two_regions(tree, zones_each=2)
    outer = OuterConfig(inner_steps=4, fragments=fragments, codec=codec, delta_codec=codec)
    job = JobConfig(name=f"fr{fragments}{codec}", mode="outer", optimizer=OptimizerConfig(kind="adamw", lr=0.01),
                    outer=outer, min_workers=WORKERS)
    _train(zones, job, steps=8)
    wait_for(lambda: tree.lt.call(lambda: all(job.name not in tree.tier(r).attached for r in ("eu", "us"))),
             "both regions leaving the root's rounds", 30)
    syncs = 8 // (4 // fragments) + fragments - 1
    for region, zone in (("eu", "eu-a"), ("us", "us-a"), ("eu", "eu-b"), ("us", "us-b")):
        st = tree.lt.call(lambda r=region: tree.tier(r).inner.jobs[job.name].stats)
        assert st.outer_syncs == syncs, (region, st.outer_syncs)
        assert st.inner_steps_since_sync == 0 and st.inner_steps_lost == 0
        assert st.outer_bytes_up > 0 and st.pseudo_grad_norm > 0
        inner = tree.lt.call(lambda r=region: (lambda v: (v.epoch, v.version, v.checksum, v.values.copy()))(
            tree.tier(r).inner.jobs[job.name].view))
        zview = tree.view(zone, job.name)
        assert inner[1] == zview[1] and inner[2] == zview[2] and same_bits(inner[3], zview[3])
        # 8 inner steps and one rebase version per sync, from inner version 0
        assert inner[1] == 8 + syncs
    eu, us = tree.view("eu", job.name), tree.view("us", job.name)
    assert eu[1] == us[1] == syncs and same_bits(eu[3], us[3])
    root = tree.view("root", job.name)
    assert root[1] == syncs and root[2] == eu[2]
    # Each outer version's delta carries its fragment's keys alone (the others did not move).
    entries = tree.lt.call(lambda: list(tree.tier("root").jobs[job.name].log.since(0, syncs) or ()))
    assert [e.version for e in entries] == list(range(1, syncs + 1))
    plan_names = OuterPlan(tree.lt.call(lambda: tree.tier("root").jobs[job.name].layout), 4, fragments).names
    for e in entries:
        assert {c.key for c in e.chunks} <= plan_names[(e.version - 1) % fragments], e.version
    # Every fragment went up after its last step: the region holds the outer values whole.
    params = tree.lt.call(lambda: tree.tier("eu").inner.jobs[job.name].params.copy())
    assert same_bits(params, root[3])


def test_kill_9_of_a_regional_master_mid_run(tree, tmp_path):
    """The job goes on after the regional master's restart, and the inner steps it lost are
    reported (its log and its status), never silent."""
    root = tree.add("root", "global")
    eu = ServeProcess(tmp_path / "eu.log", "eu", [
        "--role", "regional", "--name", "eu", "--parent", root, "--insecure",
        "--heartbeat-s", "0.1", "--member-timeout-s", "1"])
    try:
        tree.add("us", "regional", parent="root")
        zones = [_zone_under(tree, "eu-a", eu.address), tree.add("us-a", "zone", parent="us")]
        job = JobConfig(name="ko", mode="outer", optimizer=OptimizerConfig(kind="adamw", lr=0.01),
                        outer=OuterConfig(inner_steps=4, codec="int8"), min_workers=WORKERS)
        x, y = _data()
        applied = [0] * WORKERS
        stop, errors = threading.Event(), []
        models = [_model() for _ in range(WORKERS)]

        def worker(i: int) -> None:
            try:
                model = models[i]
                # 30 s calls: the regional master is a process of its own, and its first inner
                # job imports the root's code (a loaded CI machine timed a join out at 10 s).
                with HpsOptimizer(model, zones[i % len(zones)], job, worker_id=f"ko-w{i}", timeout_s=30) as opt:
                    s = 0
                    deadline = time.monotonic() + 90
                    while not stop.is_set() and time.monotonic() < deadline:
                        sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
                        opt.zero_grad()
                        _loss(model, x[s % STEPS, sl], y[s % STEPS, sl]).backward()
                        try:
                            applied[i] += bool(opt.step().applied)
                        except HpsError:  # the outage: the next step pulls and goes on
                            time.sleep(0.1)
                        s += 1
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(WORKERS)]
        [t.start() for t in threads]

        def wait_for(cond, what: str, timeout: float = 60) -> None:
            deadline = time.monotonic() + timeout
            while not cond() and time.monotonic() < deadline and not errors:
                time.sleep(0.05)
            assert not errors, errors
            assert cond(), what

        wait_for(lambda: min(applied) >= 9, "training did not start")
        eu.signal(signal.SIGKILL)
        before = list(applied)
        time.sleep(1.0)
        eu.restart()
        wait_for(lambda: min(a - b for a, b in zip(applied, before)) >= 12,
                 "training did not go on after the regional master's restart")
        stop.set()
        [t.join(30) for t in threads]
        assert not errors, errors
        text = eu.text()
        assert "were lost" in text, text
        found = re.findall(r"(\d+) inner step\(s\) since its last sync are in no outer version and were lost", text)
        assert len(found) == 1, text  # once per lost lineage
        reported = int(found[0])
        st = next(j for j in eu.status().jobs if j.name == "ko")
        assert st.inner_loop and st.stats.inner_steps_lost == reported and 0 <= reported < 4
        assert st.stats.outer_syncs >= 2  # the new lineage synced with the root
        # (That the regions hold the same outer versions is shown by the tests above: here each
        # region's last flush may make one more outer version after the other has left.)
        assert st.stats.outer_version <= tree.view("root", "ko")[1]
    finally:
        eu.stop()


def test_a_zone_straight_under_the_root_is_refused_with_a_sentence(tree):
    """Above the inner loop only pseudo-gradients travel: a zone (or worker) at the root of an
    outer job would have its raw gradients taken for pseudo-gradients. Refused, nothing joins."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    layout = Layout([KeySpec("w", (8,))])
    job = JobConfig(name="misplaced", mode="outer", outer=OuterConfig(inner_steps=2))
    w = ParameterClient(zone, "misplaced", "w0", timeout_s=10)
    try:
        w.create_job(job, layout, np.zeros(8, np.float32))
        with pytest.raises(BadInput, match="put it below a regional master"):
            w.register()
        assert tree.lt.call(lambda: len(tree.tier("root").jobs["misplaced"].members)) == 0
    finally:
        w.close()


def test_overlap_trains_on_while_a_sync_is_in_flight(tree):
    """With overlap the region does not wait for the root: every fragment still goes up once
    per H inner steps, the outer results are merged as they land, replicas agree."""
    zones = _two_regions(tree)
    job = JobConfig(name="ov", mode="outer", optimizer=OptimizerConfig(kind="adamw", lr=0.01),
                    outer=OuterConfig(inner_steps=2, codec="int8", overlap=True), min_workers=WORKERS)
    _train(zones, job, steps=8)
    deadline = time.monotonic() + 20  # the last sync may still be in flight when the workers finish
    while tree.view("root", "ov")[1] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # (and nothing more arrives)
    root = tree.view("root", "ov")
    assert root[1] == 4  # syncs sent at inner steps 2, 4, 6, 8: each applied once
    for region, zone in (("eu", "eu-a"), ("us", "us-a")):
        st = tree.lt.call(lambda r=region: tree.tier(r).inner.jobs["ov"].stats)
        # merged at the first inner version after each landed (the last one after training ended, if at all)
        assert 3 <= st.outer_syncs <= 4 and st.outer_sync_failures == 0
        inner = tree.lt.call(lambda r=region: (lambda v: (v.version, v.checksum))(tree.tier(r).inner.jobs["ov"].view))
        assert inner == tree.view(zone, "ov")[1:3]


def test_a_relay_that_refuses_a_misplaced_child_does_not_hold_the_roots_rounds(tree):
    """inner_tier zone: a worker straight under a regional master is refused there; the regional
    master, which joined the root's job to ask, leaves it again (else every round waits for it)."""
    tree.add("root", "global")
    region = tree.add("eu", "regional", parent="root")
    layout = Layout([KeySpec("w", (8,))])
    job = JobConfig(name="zoned", mode="outer", outer=OuterConfig(inner_steps=2, inner_tier="zone"))
    w = ParameterClient(region, "zoned", "w0", timeout_s=10)
    try:
        w.create_job(job, layout, np.zeros(8, np.float32))
        with pytest.raises(BadInput, match="put it below a zone"):
            w.register()
        deadline = time.monotonic() + 5
        while tree.lt.call(lambda: len(tree.tier("root").jobs["zoned"].members)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree.lt.call(lambda: len(tree.tier("root").jobs["zoned"].members)) == 0
    finally:
        w.close()


def test_training_goes_on_across_a_root_restart(tree, tmp_path):
    """The root restarts (its checkpoint and log hold the outer state): the regions' syncs retry
    and resume on the new lineage, and every region ends on the root's outer view."""
    tree.add("root", "global", checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3)
    tree.add("eu", "regional", parent="root")
    tree.add("us", "regional", parent="root")
    zones = [tree.add("eu-a", "zone", parent="eu"), tree.add("us-a", "zone", parent="us")]
    job = JobConfig(name="rr", mode="outer", optimizer=OptimizerConfig(kind="adamw", lr=0.01),
                    outer=OuterConfig(inner_steps=2, codec="int8"), min_workers=WORKERS)
    done = threading.Event()
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["results"] = _train(zones, job, steps=STEPS)
        except BaseException as exc:  # surfaced below
            outcome["error"] = exc
        done.set()

    t = threading.Thread(target=train)
    t.start()
    deadline = time.monotonic() + 60
    def root_version() -> int:
        js = tree.tier("root").jobs.get("rr")
        return js.view.version if js is not None else 0

    while tree.lt.call(root_version) < 2:
        assert time.monotonic() < deadline and not done.is_set(), outcome
        time.sleep(0.05)
    port = tree.servers["root"][1]
    before = tree.view("root", "rr")[1]
    tree.stop("root")
    tree.add("root", "global", checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3,
             listen=f"127.0.0.1:{port}")
    assert tree.view("root", "rr")[1] >= before  # no applied outer version lost
    assert done.wait(120), "training did not finish after the root restarted"
    t.join(10)
    assert "error" not in outcome, outcome.get("error")

    def settled() -> bool:  # the regions' last flushes (steps after their last sync) have landed
        busy = any(st.inflight is not None for r in ("eu", "us") for st in tree.tier(r).outer.values())
        return not busy and tree.tier("root").jobs["rr"].round.pushed == {}

    deadline = time.monotonic() + 30
    while not tree.lt.call(settled) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # and the relays' follow loops hold the root's last version
    root = tree.view("root", "rr")
    for region in ("eu", "us"):
        held = tree.view(region, "rr")  # the relay side: the outer view
        assert (held[1], held[2]) == root[1:3] and same_bits(held[3], root[3])
        # a sync every 2 inner steps; one that failed across the restart went with the next
        st = tree.lt.call(lambda r=region: tree.tier(r).inner.jobs["rr"].stats)
        assert st.outer_syncs + st.outer_sync_failures >= STEPS // 2 and st.outer_syncs >= 2
        assert st.inner_steps_since_sync == 0  # every inner step is in an outer version (the last at leave)


def test_the_inner_loop_can_run_at_the_zones(tree):
    """inner_tier zone: each zone runs its own inner loop, the regional masters relay the zones'
    pseudo-gradients (summed, re-encoded with their residuals) and the outer versions."""
    zones = _two_regions(tree)
    job = JobConfig(name="zi", mode="outer", optimizer=OptimizerConfig(kind="adamw", lr=0.01),
                    outer=OuterConfig(inner_steps=2, codec="int8", inner_tier="zone"), min_workers=WORKERS)
    _train(zones, job, steps=6)
    root = tree.view("root", "zi")
    assert root[1] == 3
    for zone in ("eu-a", "us-a"):
        st = tree.lt.call(lambda z=zone: tree.tier(z).inner.jobs["zi"].stats)
        assert st.outer_syncs == 3 and (st.outer_version, st.outer_checksum) == (root[1], root[2])
    assert tree.lt.call(lambda: tree.tier("eu").inner) is None  # the regional master only relays


class _LeftMidPeriod:
    """Two regions, one worker each (us on zones[1] all along); eu's first worker trains 2 of H=4
    steps and leaves, so eu sends them, and the root's synchronous round holds them until us
    syncs. ``steps`` trains a worker on the next n batches; ``us_in_background`` steps us on
    another thread (its sync waits for eu's)."""

    def __init__(self, tree, name: str) -> None:
        self.tree, self.name = tree, name
        self.zones = _two_regions(tree)
        self.job = JobConfig(name=name, mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.1),
                             outer=OuterConfig(inner_steps=4, codec="fp32", delta_codec="fp32"))
        self.x, self.y = mlp_batches(8, PER_WORKER)
        self.eu = tree.tier("eu")
        self.us_model = _model()
        self.us = HpsOptimizer(self.us_model, self.zones[1], self.job, worker_id=f"{name}-us", timeout_s=20)
        try:
            first = _model()
            with HpsOptimizer(first, self.zones[0], self.job, worker_id=f"{name}-eu0", timeout_s=20) as opt:
                self.steps(opt, first, 2)
            self.steps(self.us, self.us_model, 1)
            wait_for(lambda: tree.lt.call(lambda: self.outer.inflight is not None and self.outer.detached),
                     "eu did not send its steps when its last worker left")
        except BaseException:
            self.us.close()
            raise

    @property
    def outer(self):
        return self.eu.outer[self.name]

    def eu_worker(self, model) -> HpsOptimizer:
        return HpsOptimizer(model, self.zones[0], self.job, worker_id=f"{self.name}-eu1", timeout_s=20, resume=True)

    def steps(self, opt, model, n: int) -> None:
        for s in range(n):
            opt.zero_grad()
            _loss(model, self.x[s], self.y[s]).backward()
            assert opt.step().applied

    def us_in_background(self, n: int) -> tuple[threading.Thread, list]:
        done: list = []
        t = threading.Thread(target=lambda: (self.steps(self.us, self.us_model, n), done.append(1)), daemon=True)
        t.start()
        return t, done

    def eu_stats(self):
        return self.tree.lt.call(lambda: self.eu.inner.jobs[self.name].stats)


def test_a_region_whose_last_worker_left_with_a_sync_in_flight_syncs_again_when_one_joins(tree):
    """The last worker of region eu leaves mid-period: eu sends its steps since the last sync
    (a synchronous outer round: it waits at the root for us). A new worker joins eu before us
    syncs. That pseudo-gradient still lands with us's, and eu's next syncs go through: the
    region does not drop it and send the next one under the same sequence number (which the
    root refuses as another body for a push it holds), so neither region stops."""
    run = _LeftMidPeriod(tree, "back")
    try:
        second = _model()
        with run.eu_worker(second) as opt:
            run.steps(run.us, run.us_model, 3)  # us syncs: the round closes with eu's two steps
            t, done = run.us_in_background(4)
            run.steps(opt, second, 4)  # eu's next sync, with us's next one
            t.join(30)
            assert done, "us waited for a sync of eu's that never came"
            stats = run.eu_stats()
            assert stats.outer_sync_failures == 0 and stats.outer_syncs >= 2, stats
            assert tree.view("root", "back")[1] == 2
    finally:
        run.us.close()


def test_a_region_left_twice_while_its_sync_was_in_flight_sends_what_it_trained_in_between(tree):
    """As above, but the worker that joined leaves again before eu's sync has landed: once it
    lands, the steps trained in between go up too (one more sync), and only then does eu leave
    the root's rounds."""
    run = _LeftMidPeriod(tree, "twice")
    try:
        second = _model()
        with run.eu_worker(second) as opt:
            run.steps(opt, second, 2)  # trained between the two departures
        run.steps(run.us, run.us_model, 3)  # us syncs: eu's first sync lands, then its second goes up
        t, done = run.us_in_background(4)
        t.join(30)
        assert done, "us waited for eu"
        wait_for(lambda: tree.lt.call(lambda: "twice" not in run.eu.attached), "eu did not leave the root's rounds")
        stats = run.eu_stats()
        assert stats.outer_syncs == 2 and stats.inner_steps_since_sync == 0 and stats.inner_steps_lost == 0, stats
        assert tree.view("root", "twice")[1] == 2
    finally:
        run.us.close()


def test_a_pull_from_a_non_member_naming_an_old_lineage_counts_no_lost_steps(tree):
    """A regional master counts the inner steps a predecessor lost when a child pulls naming
    that lineage; the count was taken before the membership check, so anyone could inflate
    ``inner_steps_lost`` (and the log) with made-up epochs (review)."""
    from ps.core.errors import NotMember
    from ps.net.rpc import Caller
    from ps.net.wire import pb

    run = _LeftMidPeriod(tree, "lin")
    try:
        with Caller(tree.addr("eu")) as rpc, pytest.raises(NotMember):
            rpc.stream("Pull", pb.PullRequest(job="lin", member="stranger", view_epoch=0x1234, since_version=7), 5)
        assert run.eu_stats().inner_steps_lost == 0
    finally:
        run.us.close()


def test_a_region_that_keeps_leaving_leaves_the_roots_rounds_with_no_sync_in_flight(tree):
    """eu's workers come and go while its syncs wait at the root for us: it merges each
    landing sync and sends what was trained meanwhile, at most F + 1 times. The last of those
    sends used to be left in flight as eu left the root's rounds: the root dropped eu, the sync
    was retried and registered eu again, and the root's rounds then waited for a region with
    no workers, so us stopped for good (found by a review). The last one is merged, not sent."""
    run = _LeftMidPeriod(tree, "flap")
    try:
        for n in (3, 4):  # a worker trains a step and leaves; then us syncs, landing eu's sync
            model = _model()
            with run.eu_worker(model) as opt:
                run.steps(opt, model, 1)
            t, done = run.us_in_background(n)
            t.join(30)
            assert done, "us waited for eu"
        t, done = run.us_in_background(8)  # two more syncs of us's, alone
        t.join(30)
        assert done, "us waited for a region with no workers"
        wait_for(lambda: tree.lt.call(lambda: "flap" not in run.eu.attached), "eu leaving the root's rounds")
        assert tree.lt.call(lambda: run.outer.inflight) is None
        stats = run.eu_stats()  # the step trained last is in no sync: counted lost, not dropped silently
        assert stats.inner_steps_since_sync == 0 and stats.inner_steps_lost == 1, stats
    finally:
        run.us.close()


def test_a_region_that_empties_with_two_fragments_sends_what_each_fragment_trained(tree):
    """F=2, H=4 (a sync every 2 inner steps, the fragments in turn). eu's only worker trains 3
    steps and leaves: fragment 0 went up at step 2 and holds step 3, fragment 1 holds all 3.
    eu used to send one sync (fragment 1) and leave with fragment 0's step in no sync, not
    counted lost (review); it now sends both before leaving the root's rounds."""
    zones = _two_regions(tree)
    job = JobConfig(name="frag", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.1),
                    outer=OuterConfig(inner_steps=4, fragments=2, codec="fp32", delta_codec="fp32"))
    x, y = mlp_batches(10, PER_WORKER)
    eu, us_model, eu_model = tree.tier("eu"), _model(), _model()
    done: list = []

    def steps(opt, model, n: int) -> None:
        for s in range(n):
            opt.zero_grad()
            _loss(model, x[s], y[s]).backward()
            assert opt.step().applied
    with HpsOptimizer(us_model, zones[1], job, worker_id="frag-us", timeout_s=30) as us:
        t = threading.Thread(target=lambda: (steps(us, us_model, 10), done.append(1)), daemon=True)
        t.start()
        with HpsOptimizer(eu_model, zones[0], job, worker_id="frag-eu", timeout_s=30) as opt:
            steps(opt, eu_model, 3)
        wait_for(lambda: tree.lt.call(lambda: "frag" not in eu.attached), "eu leaving the root's rounds", 60)
        t.join(60)
        assert done, "us waited for eu"
    st = tree.lt.call(lambda: eu.inner.jobs["frag"].stats)
    assert st.outer_syncs == 3 and st.inner_steps_lost == 0, st  # step 2's, then fragment 1's and 0's
    assert tree.lt.call(lambda: eu.outer["frag"].unsent) == [0, 0]


@pytest.mark.parametrize("overlap", [False, True])
def test_regions_train_on_while_the_root_is_down_with_sync_wait(tree, tmp_path, overlap):
    """With ``sync_wait_s`` a region does not stop at a sync the root cannot answer: it trains
    on while the root is down, the sync retried meanwhile; once the root is back (from its
    checkpoint and log) the syncs resume, and every inner step ends in the outer model."""
    ckpt = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3)
    tree.add("root", "global", **ckpt)
    tree.add("eu", "regional", parent="root")
    tree.add("us", "regional", parent="root")
    zones = [tree.add("eu-a", "zone", parent="eu"), tree.add("us-a", "zone", parent="us")]
    steps = 40
    job = JobConfig(name="sw", mode="outer", optimizer=OptimizerConfig(kind="adamw", lr=0.01),
                    outer=OuterConfig(inner_steps=2, codec="int8", sync_wait_s=0.3, overlap=overlap),
                    min_workers=WORKERS)
    done = threading.Event()
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["results"] = train_mlp(zones, job, steps, WORKERS, PER_WORKER, data_steps=steps)
        except BaseException as exc:  # surfaced below
            outcome["error"] = exc
        done.set()

    def version(tier: str, inner: bool = False) -> int:
        t = tree.tier(tier)
        js = (t.inner.jobs if inner and t.inner is not None else t.jobs).get("sw")
        return js.view.version if js is not None else 0

    t = threading.Thread(target=train)
    t.start()
    wait_for(lambda: tree.lt.call(lambda: version("root")) >= 2, "outer versions before the root stops", 60)
    port = tree.servers["root"][1]
    tree.stop("root")
    down = [tree.lt.call(lambda r=r: version(r, inner=True)) for r in ("eu", "us")]
    # Without sync_wait_s each region would stop at its next sync (2 inner steps on) until the
    # root is back; with it, both go on well past that.
    wait_for(lambda: all(tree.lt.call(lambda r=r: version(r, inner=True)) >= v + 8 for r, v in zip(("eu", "us"), down))
             or done.is_set(), "inner steps while the root is down", 60)
    assert not done.is_set() or "error" not in outcome, outcome.get("error")
    for r in ("eu", "us"):
        st = tree.lt.call(lambda r=r: tree.tier(r).inner.jobs["sw"].stats)
        assert st.outer_syncs_postponed >= 1, st
    tree.add("root", "global", **ckpt, listen=f"127.0.0.1:{port}")
    assert done.wait(120), "training did not finish after the root came back"
    t.join(10)
    assert "error" not in outcome, outcome.get("error")

    def settled() -> bool:  # the regions' last syncs (the steps since their last one) have landed
        busy = any(st.inflight is not None for r in ("eu", "us") for st in tree.tier(r).outer.values())
        return not busy and tree.tier("root").jobs["sw"].round.pushed == {}

    wait_for(lambda: tree.lt.call(settled), "the regions' last syncs", 60)
    time.sleep(0.5)  # and the relays' follow loops hold the root's last version
    root = tree.view("root", "sw")
    for region in ("eu", "us"):
        held = tree.view(region, "sw")
        assert (held[1], held[2]) == root[1:3] and same_bits(held[3], root[3])
        st = tree.lt.call(lambda r=region: tree.tier(r).inner.jobs["sw"].stats)
        assert st.inner_steps_since_sync == 0 and st.inner_steps_lost == 0, st  # every step in the outer model
        assert st.outer_syncs >= 2, st


_LR = 0.25  # exact-arithmetic jobs below: gradients of ones, inner SGD at this lr, outer SGD lr 1


class _Ones:
    """Workers of an outer job (one per address) that push gradients of ones: inner SGD lr 0.25,
    outer SGD lr 1, fp32 both ways, H = 2, ``sync_wait_s`` 0.3 -- every value exact in fp32
    (``codec`` and ``grad``: another pseudo-gradient codec, another gradient).
    ``step(c)`` pushes and pulls the version that applied it."""

    def __init__(self, addresses: list[str], name: str, round_timeout_s: float = 600.0, codec: str = "fp32",
                 grad: np.ndarray | None = None, **outer) -> None:
        self.layout = Layout([KeySpec("w", (4,))])
        self.grad = np.ones(self.layout.numel, np.float32) if grad is None else grad
        self.job = JobConfig(name=name, mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=_LR),
                             outer=OuterConfig(inner_steps=2, codec=codec, delta_codec="fp32", sync_wait_s=0.3,
                                               optimizer=OptimizerConfig(kind="sgd", lr=1.0), **outer))
        self.clients = [ParameterClient(a, name, f"w-{i}", timeout_s=30, round_timeout_s=round_timeout_s)
                        for i, a in enumerate(addresses)]
        self._clock = [0] * len(self.clients)
        try:
            self.clients[0].create_job(self.job, self.layout, np.zeros(self.layout.numel, np.float32))
            for c in self.clients:
                c.register()
                c.pull(min_version=0)
        except BaseException:
            self.close()
            raise

    def step(self, c: ParameterClient) -> None:
        i = self.clients.index(c)
        v, _ = c.push(self.grad, clock=self._clock[i])
        self._clock[i] += 1
        c.pull(min_version=v)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _full(x: float) -> np.ndarray:
    return np.full(4, x * _LR, np.float32)


def test_a_postponed_sync_merges_keeping_what_the_region_trained_meanwhile(tree):
    """No overlap, sync_wait_s: eu's sync waits at the root for us (a synchronous outer round),
    so eu trains on without it; when it lands, eu's fragment takes the outer values plus what
    eu trained since it sent it, not the outer values alone (which would drop 3 inner steps).
    Exact arithmetic (``_Ones``)."""
    ones = _Ones(_two_regions(tree), "pm")
    eu, us = ones.clients
    try:
        def inner_values(region: str) -> np.ndarray:
            return tree.lt.call(lambda: tree.tier(region).inner.jobs["pm"].view.values.copy())

        for _ in range(4):  # eu: a sync sent after 2 steps (it waits at the root for us), 2 more
            ones.step(eu)
        st = tree.lt.call(lambda: tree.tier("eu").inner.jobs["pm"].stats)
        assert st.outer_syncs_postponed == 1 and st.outer_syncs == 0, st
        assert np.array_equal(inner_values("eu"), _full(-4))
        for _ in range(2):  # us: its sync closes the root's round; outer = 0 - mean(2 lr, 2 lr)
            ones.step(us)
        wait_for(lambda: tree.view("eu", "pm")[1] >= 1, "eu holding the outer version", 10)
        assert np.array_equal(tree.view("root", "pm")[3], _full(-2))
        assert np.array_equal(inner_values("us"), _full(-2))
        ones.step(eu)  # the first inner version after the sync landed merges it
        st = tree.lt.call(lambda: tree.tier("eu").inner.jobs["pm"].stats)
        assert st.outer_syncs == 1, st
        # outer (-2 lr) + trained since the send (-3 lr); dropping it would leave -2 lr
        assert np.array_equal(inner_values("eu"), _full(-5)), inner_values("eu")
    finally:
        ones.close()


def test_a_sync_given_up_on_that_the_root_applied_later_is_not_sent_again(tree):
    """eu gives up on its sync after its 2 s round timeout (it waits at the root for us, in a
    synchronous outer round), and the root applies it once us syncs. eu must take it as landed
    -- not count it failed and send its steps again with the next sync under the same number
    (refused for good as another body) or a new one (applied twice). Exact arithmetic as in the
    postponed-sync test (``_Ones``)."""
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root", round_timeout_s=2.0)
    tree.add("us", "regional", parent="root")
    ones = _Ones([tree.add(f"{r}-a", "zone", parent=r) for r in ("eu", "us")], "gu")
    eu, us = ones.clients
    try:
        def region(name: str):
            return tree.lt.call(lambda: (tree.tier(name).inner.jobs["gu"].stats,
                                         tree.tier(name).inner.jobs["gu"].view.values.copy()))

        for _ in range(4):  # eu: a sync after 2 steps, waiting at the root for us; 2 more
            ones.step(eu)
        wait_for(lambda: tree.lt.call(lambda: tree.tier("eu").jobs["gu"].stats.refused_rounds) >= 1,
                 "eu giving up on its sync after its round timeout", 15)
        for _ in range(2):  # us: its sync closes the root's round, which applies eu's too
            ones.step(us)
        wait_for(lambda: tree.view("root", "gu")[1] >= 1, "the root applying the outer round", 10)
        assert np.array_equal(tree.view("root", "gu")[3], _full(-2))
        wait_for(lambda: tree.lt.call(lambda: tree.tier("eu").outer["gu"].inflight.done()),
                 "eu's sync settled", 20)
        ones.step(eu)  # merged at the first inner version after it: landed, not failed
        st, values = region("eu")
        assert st.outer_syncs == 1 and st.outer_sync_failures == 0 and st.outer_syncs_unsettled == 1, st
        assert np.array_equal(values, _full(-5)), values  # outer + 3 steps since
        # eu's next sync (sent at that merge: 3 steps since the last) carries those 3 steps
        # only; us's carries its next 2. Applied once each: -2 lr - (3 lr + 2 lr) / 2.
        for _ in range(2):
            ones.step(us)
        wait_for(lambda: tree.view("root", "gu")[1] >= 2, "the second outer round", 20)
        root = tree.view("root", "gu")
        assert root[1] == 2 and np.array_equal(root[3], _full(-4.5)), root
        assert tree.lt.call(lambda: tree.tier("root").jobs["gu"].stats.double_applied) == 0
        st, _ = region("eu")
        assert st.outer_sync_failures == 0, st
    finally:
        ones.close()


def test_a_sync_sent_through_a_parent_the_zone_left_is_resolved_not_sent_again(tree):
    """Inner loops at the zones. za's sync is in the root's synchronous round (through r1, with
    zc's) when za loses its link to r1 -- r1 lives on. za moves to r2: it asks the root about
    its sync by its own key instead of sending it again through r2 (whose forward the root
    could not place while r1's batch holds it: each round waited for the other), and r2's
    round stops waiting for za. Exact arithmetic (``_Ones``)."""
    tree.add("root", "global")
    r1, r2 = tree.add("r1", "regional", parent="root"), tree.add("r2", "regional", parent="root")
    link = tree.lt.run(LinkProxy(Link(), r1).start())
    tree.servers["za"] = tree.lt.run(create_server(ServerConfig(role="zone", name="za", parent=f"{link.address},{r2}",
                                                                **FAST)))
    zones = [tree.addr("za"), tree.add("zb", "zone", parent="r2"), tree.add("zc", "zone", parent="r1")]
    ones = _Ones(zones, "mv", round_timeout_s=60, inner_tier="zone")  # bounded: a hang fails the test
    a, b, c = ones.clients
    root = tree.tier("root")
    try:
        for x in (a, a, c, c):  # za's and zc's syncs: r1 sums them, and the root waits for r2
            ones.step(x)
        wait_for(lambda: tree.lt.call(lambda: len(root.jobs["mv"].round.pushed)) == 1, "r1's sum at the root", 10)
        tree.lt.run(link.close())
        wait_for(lambda: tree.lt.call(lambda: "za" in tree.tier("r2").jobs["mv"].members), "za at r2", 30)
        for _ in range(2):  # zb's sync: r2's round, then the root's, close
            ones.step(b)
        wait_for(lambda: tree.view("root", "mv")[1] >= 1, "the outer round", 40)
        assert np.array_equal(tree.view("root", "mv")[3], _full(-2))
        wait_for(lambda: tree.lt.call(lambda: tree.tier("za").outer["mv"].inflight.done()), "za's sync settled", 30)
        ones.step(a)  # merged: landed, not failed
        st = tree.lt.call(lambda: tree.tier("za").inner.jobs["mv"].stats)
        assert st.outer_syncs == 1 and st.outer_sync_failures == 0, st
        for x in (a, c, c, b, b):  # 2 more steps each: the next outer round, each sync applied once
            ones.step(x)
        wait_for(lambda: tree.view("root", "mv")[1] >= 2, "the second outer round", 40)
        got = tree.view("root", "mv")
        assert got[1] == 2 and np.array_equal(got[3], _full(-4)), got
        assert tree.lt.call(lambda: root.jobs["mv"].stats.double_applied) == 0
    finally:
        ones.close()


def test_a_refused_sync_leaves_no_trace_in_a_lossy_codecs_residual(tree):
    """int8 pseudo-gradients under error feedback: what one sync does not carry stays in the
    region's residual for the next. A sync the root refuses is sent again whole (its steps with
    the next sync), so its encode must leave no trace: the residual goes back to what it was
    before it (an earlier build reset it to zero at every refusal, dropping the remainder owed
    from the syncs before; kept, the refused remainder would be carried twice). Checked
    directly, and by conservation: the outer values applied plus the residual left equal every
    inner step's displacement (outer SGD lr 1, one region of one worker)."""
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    g = np.array([1.0, 0.3, 0.7, -0.45], np.float32)  # not a multiple of one level: int8 rounds
    ones = _Ones([tree.add("eu-a", "zone", parent="eu")], "ef", codec="int8", grad=g)
    (w,) = ones.clients
    root, eu = tree.tier("root"), tree.tier("eu")
    refuse = threading.Event()
    apply = root._apply_durably

    async def refusing(js, agg, rec, keys, step, fut):
        if refuse.is_set():
            refuse.clear()
            # as a step that made the parameters non-finite is refused: nothing applied
            root._refuse(js, agg, fut, BadInput("refused by the test: nothing was applied"))
            return
        await apply(js, agg, rec, keys, step, fut)

    root._apply_durably = refusing
    try:
        def residual() -> np.ndarray:
            state = tree.lt.call(lambda: eu.jobs["ef"].encoder.state_dict())
            return state.get("w@0", np.zeros(4, np.float32)).copy()  # none: nothing owed

        def stats():
            return tree.lt.call(lambda: eu.inner.jobs["ef"].stats)

        for _ in range(2):  # the first sync lands: int8 leaves a remainder in the residual
            ones.step(w)
        wait_for(lambda: stats().outer_syncs == 1, "the first sync", 10)
        before = residual()
        assert np.abs(before).max() > 1e-4, before
        refuse.set()
        for _ in range(2):  # the second is refused by the root
            ones.step(w)
        wait_for(lambda: stats().outer_sync_failures == 1, "the refused sync", 10)
        assert same_bits(residual(), before), (residual(), before)
        steps = 4  # on until two more syncs landed and every step is in one (the next carries the 2 refused)
        while not (stats().outer_syncs >= 3 and stats().inner_steps_since_sync == 0):
            assert steps < 12, stats()
            ones.step(w)
            steps += 1
        outer = tree.view("root", "ef")
        assert outer[1] == stats().outer_syncs and stats().outer_sync_failures == 1, (outer[:2], stats())
        trained = np.float32(steps * _LR) * g  # every inner step, each in a sync that landed
        np.testing.assert_allclose(residual() - outer[3], trained, rtol=0, atol=1e-5)
        assert tree.lt.call(lambda: root.jobs["ef"].stats.double_applied) == 0
    finally:
        root._apply_durably = apply
        ones.close()


def test_a_sync_applied_whose_outer_version_is_slow_to_arrive_is_not_counted_failed(tree, monkeypatch):
    """The root applied the sync and said so, but the region's follow of the outer view is
    slow (a slow WAN, a partition after the ack). The region waited for that version at most 60 s
    (1 s here) and then counted the sync failed: its steps went again with the next sync,
    applied twice (found by a review). Now it waits for it, however long; exact arithmetic
    (``_Ones``): every inner step once in the outer values."""
    monkeypatch.setattr(ps.tiers.outersync, "_OUTER_WAIT_S", 1.0)
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    ones = _Ones([tree.add("eu-a", "zone", parent="eu")], "slowv")
    (w,) = ones.clients
    eu = tree.tier("eu")
    blocked = threading.Event()
    pull = eu.up.pull

    async def gated(*args, **kwargs):  # what a pull brings is held while blocked
        got = await pull(*args, **kwargs)
        while blocked.is_set():
            await asyncio.sleep(0.05)
        return got

    eu.up.pull = gated
    try:
        def stats():
            return tree.lt.call(lambda: eu.inner.jobs["slowv"].stats)

        for _ in range(2):
            ones.step(w)
        wait_for(lambda: stats().outer_syncs == 1, "the first sync", 10)
        blocked.set()
        for _ in range(2):  # the second sync is applied; its outer version does not arrive
            ones.step(w)
        wait_for(lambda: tree.view("root", "slowv")[1] == 2, "the root applying the second sync", 10)
        time.sleep(2.5)  # past the old wait (1 s here), twice
        blocked.clear()
        steps = 4
        while not (stats().outer_syncs >= 3 and stats().inner_steps_since_sync == 0):
            assert steps < 12, stats()
            ones.step(w)
            steps += 1
        assert stats().outer_sync_failures == 0, stats()
        outer = tree.view("root", "slowv")
        assert np.array_equal(outer[3], _full(-steps)), (outer[3], steps)  # each inner step once
    finally:
        eu.up.pull = pull
        blocked.clear()
        ones.close()


def _fail_next_inner_version(eu) -> threading.Event:
    """Set the returned event, and the region's next inner version fails part-way: after it is
    published, in its sync bookkeeping (restore ``eu.after_inner_version`` when done)."""
    after = eu.after_inner_version
    fail = threading.Event()

    async def failing(ijs, contributors):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected: the version's sync bookkeeping failed")
        await after(ijs, contributors)

    eu.after_inner_version = failing
    return fail


def test_a_regions_inner_loop_that_fails_part_way_starts_again_from_the_outer_view(tree, caplog):
    """The region's inner root keeps no log: a version that failed part-way (here the step
    after publishing it) left the job refusing every call until the regional master was
    restarted by hand. Now it starts again from the outer view at once: the worker trains on
    after one refused step, and the inner steps since the last sync are counted lost."""
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    ones = _Ones([tree.add("eu-a", "zone", parent="eu")], "dmg", round_timeout_s=20)
    (w,) = ones.clients
    eu = tree.tier("eu")
    after = eu.after_inner_version
    fail = _fail_next_inner_version(eu)
    try:
        for _ in range(3):  # H = 2: one sync landed, one inner step since
            ones.step(w)
        wait_for(lambda: tree.lt.call(lambda: eu.inner.jobs["dmg"].stats.outer_syncs) == 1, "the first sync")
        old = tree.lt.call(lambda: eu.inner.jobs["dmg"])
        fail.set()
        with pytest.raises(HpsError):
            ones.step(w)  # applied, then failed before it was acknowledged: refused, not served
        wait_for(lambda: tree.lt.call(lambda: eu.inner.jobs.get("dmg") not in (None, old)), "a new inner lineage")
        assert tree.lt.call(lambda: "dmg" not in eu.inner.damaged)
        new = tree.lt.call(lambda: eu.inner.jobs["dmg"])
        # lost: the acknowledged step since the sync (the refused one's worker was told)
        assert new.view.epoch != old.view.epoch and new.stats.inner_steps_lost == 1, new.stats
        assert "outer.restarted" in [getattr(r, "event", None) for r in caplog.records]
        w.pull()  # the new lineage: a snapshot of the outer view
        outer = tree.view("root", "dmg")
        assert same_bits(w.view.values, outer[3])
        for _ in range(4):  # and training goes on: two more syncs land
            ones.step(w)
        wait_for(lambda: tree.view("root", "dmg")[1] >= outer[1] + 2, "two more syncs at the root")
        assert tree.lt.call(lambda: tree.tier("root").jobs["dmg"].stats.double_applied) == 0
    finally:
        eu.after_inner_version = after
        ones.close()


@pytest.mark.parametrize("lands", [True, False], ids=["sync-lands", "sync-fails"])
def test_a_failed_inner_loop_starts_again_only_once_its_sync_in_flight_has_landed(tree, lands):
    """The inner job fails part-way while a sync is on its way up. The new lineage starts from
    the outer view, so it must wait for that sync: landed, its steps are in the outer view and
    not lost; failed, they are in neither view and are counted lost with the step since.
    Exact arithmetic (``_Ones``): the new lineage's values are the outer view's."""
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    # (the failing step waits out its round timeout: its zone retries while the restart waits)
    ones = _Ones([tree.add("eu-a", "zone", parent="eu")], "dmg2", round_timeout_s=4)
    (w,) = ones.clients
    eu = tree.tier("eu")
    after, round_trip = eu.after_inner_version, eu._round_trip
    fail, gate = threading.Event(), threading.Event()

    async def failing(ijs, contributors):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected: the version's sync bookkeeping failed")
        await after(ijs, contributors)

    async def gated(ojs, agg):  # the first sync is held until the gate opens
        while not gate.is_set():
            await asyncio.sleep(0.02)
        if not lands:
            raise RuntimeError("injected: the sync failed")
        return await round_trip(ojs, agg)

    eu.after_inner_version, eu._round_trip = failing, gated
    try:
        for _ in range(3):  # H = 2: the sync of steps 1-2 is held; step 3 is acknowledged
            ones.step(w)
        old = tree.lt.call(lambda: eu.inner.jobs["dmg2"])
        assert tree.lt.call(lambda: eu.outer["dmg2"].inflight is not None)
        fail.set()
        with pytest.raises(HpsError):
            ones.step(w)  # applied, then failed before it was acknowledged
        time.sleep(1.0)
        assert tree.lt.call(lambda: eu.inner.jobs.get("dmg2")) is old  # it waits for the sync
        eu._round_trip = round_trip
        gate.set()
        wait_for(lambda: tree.lt.call(lambda: eu.inner.jobs.get("dmg2") not in (None, old)), "a new inner lineage")
        new = tree.lt.call(lambda: eu.inner.jobs["dmg2"])
        assert new.stats.inner_steps_lost == (1 if lands else 3), new.stats
        outer = tree.view("root", "dmg2")
        assert (outer[1], outer[3].tolist()) == ((1, _full(-2).tolist()) if lands else (0, [0.0] * 4))
        # the new lineage, once the zone has it: a snapshot of the outer view
        wait_for(lambda: w.pull() >= 0 and same_bits(w.view.values, outer[3]), "the outer view at the worker")
        for _ in range(2):  # and training goes on: the next sync lands
            ones.step(w)
        wait_for(lambda: tree.view("root", "dmg2")[1] == outer[1] + 1, "the next sync at the root")
        assert np.array_equal(tree.view("root", "dmg2")[3], _full(-4 if lands else -2))
    finally:
        gate.set()
        eu.after_inner_version, eu._round_trip = after, round_trip
        ones.close()


def test_a_region_whose_first_child_could_not_join_does_not_hold_the_other_regions(tree):
    """A regional master joins the root's job for its first child before it makes the region's
    inner loop; when making it failed (torch still loading, no outer view yet: NotReady) and
    that child never came back, the region stayed a member at the root, kept alive by its
    heartbeats, and every synchronous outer round waited for its syncs: the other regions
    stopped for good (review). It leaves the root's rounds again."""
    from ps.core.errors import NotReady
    from ps.net.rpc import Caller
    from ps.net.wire import pb

    tree.add("root", "global", round_timeout_s=20.0)
    tree.add("eu", "regional", parent="root")
    tree.add("us", "regional", parent="root")
    eu_zone, us_zone = (tree.add(f"{r}-a", "zone", parent=r) for r in ("eu", "us"))
    job = JobConfig(name="lone", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.1),
                    outer=OuterConfig(inner_steps=2, codec="fp32", delta_codec="fp32"))
    us = tree.tier("us")
    real, failed = us._ensure_inner, []

    async def not_yet(ojs):
        if not failed:
            failed.append(1)
            raise NotReady("loading (injected)")
        return await real(ojs)
    tree.lt.call(lambda: setattr(us, "_ensure_inner", not_yet))
    model = _model()
    x, y = mlp_batches(4, PER_WORKER)
    with HpsOptimizer(model, eu_zone, job, worker_id="eu-w", timeout_s=20) as opt:
        with Caller(us_zone) as rpc, pytest.raises(HpsError, match="loading"):  # us's only worker, once
            rpc.call("Register", pb.RegisterRequest(job="lone", member="us-w", role=pb.ROLE_WORKER,
                                                    incarnation=7), 10)
        wait_for(lambda: tree.lt.call(lambda: [m.id for m in tree.tier("root").jobs["lone"].members]) == ["eu"],
                 "us to leave the root's rounds")
        for s in range(4):  # two syncs of eu's, each a synchronous outer round
            opt.zero_grad()
            _loss(model, x[s], y[s]).backward()
            assert opt.step().applied
    assert tree.view("root", "lone")[1] >= 2


def test_a_regions_residual_outlives_a_root_restart(tree, tmp_path):
    """A top-k pseudo-gradient leaves most of the region's update in its encoder's residual, to
    go up with the next syncs. A root restart (its log restores every acknowledged version) made
    a new lineage, and the region dropped that residual as a raw gradient's is dropped: training
    the outer model never received, and the region's rebased parameters no longer held (review)."""
    ckpt = str(tmp_path / "ckpt")
    tree.add("root", "global", checkpoint_dir=ckpt)
    tree.add("eu", "regional", parent="root")
    zone = tree.add("eu-a", "zone", parent="eu")
    job = JobConfig(name="kept", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.1),
                    outer=OuterConfig(inner_steps=1, codec="topk", delta_codec="fp32"))
    model = _model()
    x, y = mlp_batches(3, PER_WORKER)
    eu = tree.tier("eu")

    def residual() -> float:
        state = eu.jobs["kept"].encoder.state_dict()
        return float(sum(np.square(v, dtype=np.float64).sum() for k, v in state.items() if ":" not in k))

    with HpsOptimizer(model, zone, job, worker_id="w", timeout_s=30) as opt:
        for s in range(2):
            opt.zero_grad()
            _loss(model, x[s], y[s]).backward()
            assert opt.step().applied
        wait_for(lambda: tree.lt.call(lambda: eu.outer["kept"].inflight is None), "eu's last sync to land")
        before = tree.lt.call(residual)
        assert before > 0
        port, epoch = tree.servers["root"][1], tree.view("root", "kept")[0]
        tree.stop("root")
        tree.add("root", "global", checkpoint_dir=ckpt, listen=f"127.0.0.1:{port}")
        wait_for(lambda: tree.view("eu", "kept")[0] not in (0, epoch), "eu to follow the root's new lineage",
                 timeout=20)
        assert tree.lt.call(residual) == before
        opt.zero_grad()
        _loss(model, x[2], y[2]).backward()
        assert opt.step().applied  # and training goes on


def test_steps_a_leaving_region_could_not_send_are_counted_lost(tree):
    """Every worker of a region left: it sends each fragment's steps in turn before it leaves
    the root's rounds. When a later one of those syncs could not be sent (no outer view to sync
    with), the region left with those steps neither sent nor counted: lost silently (review)."""
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    zone = tree.add("eu-a", "zone", parent="eu")
    job = JobConfig(name="gone", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.1),
                    outer=OuterConfig(inner_steps=4, fragments=2, codec="fp32", delta_codec="fp32"))
    eu = tree.tier("eu")
    model = _model()
    x, y = mlp_batches(3, PER_WORKER)
    opt = HpsOptimizer(model, zone, job, worker_id="w", timeout_s=20)
    try:
        for s in range(3):  # a sync of one fragment after 2 steps; both fragments hold steps after 3
            opt.zero_grad()
            _loss(model, x[s], y[s]).backward()
            assert opt.step().applied
        wait_for(lambda: tree.lt.call(lambda: eu.outer["gone"].inflight is None), "the first sync to land")
        real, sends = eu._send, []

        def first_only(ijs, st):  # the leave's first sync goes; the next finds no outer view
            sends.append(1)
            if len(sends) == 1:
                return real(ijs, st)
            ijs.stats.outer_sync_failures += 1
        tree.lt.call(lambda: setattr(eu, "_send", first_only))
    finally:
        opt.close()  # the region's last worker leaves
    wait_for(lambda: tree.lt.call(lambda: len(tree.tier("root").jobs["gone"].members)) == 0,
             "the region to leave the root's rounds")
    stats = tree.lt.call(lambda: eu.inner.jobs["gone"].stats)
    assert len(sends) == 2, sends
    assert stats.inner_steps_lost > 0 and stats.inner_steps_since_sync == 0, stats


def test_asynchronous_outer_shares_count_the_workers_of_regions_that_have_not_synced_yet(tree):
    """The root applies a region's pseudo-gradient at its share of every region's workers. A
    region's count came only with its pushes, and one that had not synced yet counted as one:
    eu's first sync (2 workers) was applied at 2/3, not 2/4, while us's 2 workers trained on
    (review). Relays now say their workers with their heartbeats."""
    zones = _two_regions(tree)
    layout = Layout([KeySpec("w", (6,))])
    outer = OuterConfig(inner_steps=1, codec="fp32", delta_codec="fp32", asynchronous=True,
                        optimizer=OptimizerConfig(kind="sgd", lr=1.0))
    job = JobConfig(name="share", mode="outer", optimizer=OptimizerConfig(kind="sgd", lr=0.1), outer=outer)
    clients = [ParameterClient(zones[i % 2], "share", f"w{i}", timeout_s=20) for i in range(4)]  # eu, us, eu, us
    try:
        clients[0].create_job(job, layout, np.zeros(6, np.float32))
        for c in clients:
            c.register()
            c.pull(min_version=0)
        root = tree.tier("root")
        wait_for(lambda: tree.lt.call(lambda: sorted((m.id, m.workers) for m in root.jobs["share"].members))
                 == [("eu", 2), ("us", 2)], "the regions' heartbeats to say their workers")
        g = np.arange(6, dtype=np.float32)
        with ThreadPoolExecutor(2) as pool:  # eu's round: both push g
            a, b = [f.result(20)[0] for f in [pool.submit(clients[i].push, g) for i in (0, 2)]]
            assert a == b  # one inner version
        wait_for(lambda: tree.view("root", "share")[1] == 1, "eu's sync")
        # inner: -0.1 g (the average of two g); its pseudo-gradient 0.1 g, at eu's share 2 of 4
        np.testing.assert_allclose(tree.view("root", "share")[3], -0.05 * g, rtol=1e-6)
    finally:
        for c in clients:
            c.close()


def test_a_region_whose_inner_loop_started_again_with_no_child_coming_back_leaves_the_roots_rounds(tree):
    """The region's inner loop failed part-way and started a new lineage; its children must
    register with the new one. When none did (they died with it), the new lineage had no member
    to leave, so the region stayed in the root's rounds, kept alive by its heartbeats, and
    every other region's synchronous rounds waited for it (review). After a member timeout
    with no child, it leaves them."""
    tree.add("root", "global")
    ones = _Ones([tree.add("eu", "regional", parent="root")], "orphan", round_timeout_s=20)  # a worker at eu
    (w,) = ones.clients
    eu = tree.tier("eu")
    after = eu.after_inner_version
    fail = _fail_next_inner_version(eu)
    try:
        ones.step(w)
        old = tree.lt.call(lambda: eu.inner.jobs["orphan"])
        w._hb_stop.set()  # the worker dies with the old lineage: no heartbeat, no goodbye, no return
        w._hb_thread.join(5)
        fail.set()
        with pytest.raises(HpsError):
            ones.step(w)  # its last push: applied, then the inner loop failed
        w._config = None  # (its close says no goodbye either)
        wait_for(lambda: tree.lt.call(lambda: eu.inner.jobs.get("orphan") not in (None, old)), "a new inner lineage")
        # (The client registered with the new lineage as its push failed; a worker killed at
        # that moment never does: the new lineage has no member, and no member ever leaves it.)
        tree.lt.call(lambda: eu.inner.jobs["orphan"].members.leave("w-0"))
        wait_for(lambda: tree.lt.call(lambda: len(tree.tier("root").jobs["orphan"].members)) == 0,
                 "the region to leave the root's rounds", timeout=15)
    finally:
        eu.after_inner_version = after
        ones.close()
