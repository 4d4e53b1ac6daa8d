"""The worker keeps a PyTorch script's habits (issue 13): a real torch optimizer whose schedule
reaches the root, parameters without a gradient left alone, buffers and frozen parameters
shared, AMP's GradScaler, a new run that does not silently resume an old job."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import Conflict
from tests.helpers import same_bits
from worker import HpsOptimizer

PER_WORKER = 8


def _in_threads(fns) -> list:
    out: list = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def _two_workers(tree, job: JobConfig, make_model):
    """Two workers on one zone; the first creates the job, the second joins it."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    models = [make_model(seed) for seed in (0, 1)]
    a = HpsOptimizer(models[0], zone, job, worker_id="w0")
    b = HpsOptimizer(models[1], zone, job, worker_id="w1")
    return models, [a, b]


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def test_an_lr_schedule_travels_with_the_push_and_matches_one_process(tree):
    """StepLR on each worker's HpsOptimizer and a hand-written annealing step equal one
    process with torch's own SGD and StepLR on the concatenated batch."""
    steps = 8
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(steps, 2 * PER_WORKER, 6, generator=g), torch.randint(0, 3, (steps, 2 * PER_WORKER), generator=g)
    job = JobConfig(name="sched", optimizer=OptimizerConfig(kind="sgd", lr=0.2, momentum=0.9))
    models, opts = _two_workers(tree, job, _mlp)
    assert all(isinstance(o, torch.optim.Optimizer) for o in opts)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in opts]

    def train(i):
        for s in range(steps):
            opts[i].zero_grad()
            xs, ys = x[s, i * PER_WORKER:(i + 1) * PER_WORKER], y[s, i * PER_WORKER:(i + 1) * PER_WORKER]
            torch.nn.functional.cross_entropy(models[i](xs), ys).backward()
            opts[i].step()
            scheds[i].step()
            if s == 5:
                for group in opts[i].param_groups:  # word_language_model's `lr /= 4`
                    group["lr"] /= 4
    _in_threads([lambda: train(0), lambda: train(1)])

    ref = _mlp(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x[s]), y[s]).backward()
        opt.step()
        sched.step()
        if s == 5:
            for group in opt.param_groups:
                group["lr"] /= 4
    for got, want in zip(models[0].parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert opts[0].param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for o in opts:
        o.close()


def test_workers_that_disagree_on_the_lr_in_bsp_get_a_clear_error(tree):
    job = JobConfig(name="disagree", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    models, opts = _two_workers(tree, job, _mlp)
    opts[1].param_groups[0]["lr"] = 0.05
    x = torch.randn(4, 6)

    results: list[str] = []

    def step(i):
        models[i](x).sum().backward()
        try:
            opts[i].step()
            results.append("ok")
        except Exception as exc:
            results.append(str(exc))
    # The second push into the round is refused with a sentence; the first waits for a round
    # that cannot complete (its worker would go on once the other is fixed and restarted).
    for i in (0, 1):
        threading.Thread(target=step, args=(i,), daemon=True).start()
    deadline = time.monotonic() + 30
    while not results and time.monotonic() < deadline:
        time.sleep(0.05)
    assert results and "disagree on a hyperparameter" in results[0] and "lr" in results[0], results
    opts[1].close()


class _Heads(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(4, 4)
        self.used = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)   # never in the loss: its .grad stays None

    def forward(self, x):
        return self.used(torch.tanh(self.body(x)))


def test_a_parameter_without_a_gradient_stays_put(tree):
    """torch.optim leaves a parameter whose .grad is None alone (no momentum, no weight decay);
    so does the root. Pushing zeros instead moved an unused head by 0.23 under momentum."""
    job = JobConfig(name="nograd", optimizer=OptimizerConfig(kind="sgd", lr=0.5, momentum=0.9, weight_decay=0.1))
    models, opts = _two_workers(tree, job, _Heads)
    before = [p.detach().clone() for p in models[0].unused.parameters()]
    moved = models[0].used.weight.detach().clone()

    def train(i):
        for _ in range(5):
            opts[i].zero_grad()
            models[i](torch.randn(8, 4)).pow(2).mean().backward()
            opts[i].step()
    _in_threads([lambda: train(0), lambda: train(1)])
    for m in models:
        for p, b in zip(m.unused.parameters(), before, strict=True):
            assert torch.equal(p, b)
    assert not torch.equal(models[0].used.weight, moved)
    for o in opts:
        o.close()


class _Norm(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.fc = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(self.frozen(x)))


@pytest.mark.parametrize("every", [1, 3, 0], ids=["every-step", "every-3", "never"])
def test_buffers_and_frozen_parameters_follow_the_jobs_schedule(tree, every):
    job = JobConfig(name=f"buffers{every}", optimizer=OptimizerConfig(kind="sgd", lr=0.1), buffer_sync_every=every)
    models, opts = _two_workers(tree, job, _Norm)
    # Frozen layers start from the creating worker's values on every worker, whatever its seed.
    assert torch.equal(models[0].frozen.weight, models[1].frozen.weight)
    # Steps in lock-step (bsp): compare the buffers after each one from the main thread.
    results = []
    for step in range(6):
        def one(i):
            g = torch.Generator().manual_seed(100 * step + i)
            opts[i].zero_grad()
            x = torch.randn(16, 4, generator=g) * (1 + 3 * i) + 2 * i
            models[i](x).pow(2).mean().backward()
            opts[i].step()
        _in_threads([lambda: one(0), lambda: one(1)])
        results.append(torch.equal(models[0].bn.running_mean, models[1].bn.running_mean)
                       and torch.equal(models[0].bn.running_var, models[1].bn.running_var))
    expected = [bool(every) and (s + 1) % every == 0 for s in range(6)]
    assert results == expected
    assert torch.equal(models[0].frozen.weight, models[1].frozen.weight)  # never changed by training
    if every == 1:  # the average of the two workers' statistics, not one worker's
        assert models[0].bn.num_batches_tracked.item() == 6
    for o in opts:
        o.close()


def test_gradscaler_overflow_on_one_worker_skips_the_round_everywhere(tree):
    job = JobConfig(name="amp", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    models, opts = _two_workers(tree, job, _mlp)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in opts]
    snapshots: list = [None, None]

    def step(i, s):
        opts[i].zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models[i](torch.randn(8, 6)).float().pow(2).mean()
        scalers[i].scale(loss).backward()
        if s == 1 and i == 1:  # an overflow on one worker only
            next(models[i].parameters()).grad[0, 0] = float("inf")
        scalers[i].unscale_(opts[i])
        torch.nn.utils.clip_grad_norm_(models[i].parameters(), 1.0)  # the AMP docs' pattern
        scalers[i].step(opts[i])
        scalers[i].update()

    for s in range(3):
        if s == 1:
            snapshots = [[p.detach().clone() for p in m.parameters()] for m in models]
        _in_threads([lambda s=s: step(0, s), lambda s=s: step(1, s)])
        if s == 1:
            for m, snap in zip(models, snapshots, strict=True):   # skipped by both
                assert all(torch.equal(p, q) for p, q in zip(m.parameters(), snap, strict=True))
            assert not opts[0].last_result.applied and not opts[1].last_result.applied
            assert scalers[0].get_scale() == scalers[1].get_scale() == 512.0   # both backed off
    assert opts[0].version == 3
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True))
    for o in opts:
        o.close()


def test_step_takes_a_closure_and_the_state_dict_has_torchs_shape(tree):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    model = _mlp(0)
    opt = HpsOptimizer(model, zone, JobConfig(name="closure", optimizer=OptimizerConfig(kind="adam", lr=0.01)),
                       worker_id="w0")
    x = torch.randn(4, 6)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and opt.last_result.version == 1
    with pytest.raises(TypeError, match="step\\(loss=...\\)"):
        opt.step(0.5)
    sd = opt.state_dict()
    assert sd["state"] == {} and sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sd["param_groups"][0]["lr"] == 0.01 and sd["hps"]["clock"] == 1
    opt.param_groups[0]["lr"] = 0.5
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.01
    adam = torch.optim.Adam(_mlp(0).parameters())
    adam.zero_grad()
    _mlp(0)(x).sum().backward()
    torch_sd = adam.state_dict()
    torch_sd["state"] = {0: {"step": torch.tensor(1.0)}}
    with pytest.raises(ValueError, match="lives at the root"):
        opt.load_state_dict(torch_sd)
    opt.close()


def test_a_new_run_does_not_silently_resume_an_old_job(tree, monkeypatch):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    job = JobConfig(name="again", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    monkeypatch.setenv("HPS_RUN_ID", "run-1")
    model = _mlp(0)
    first = HpsOptimizer(model, zone, job, worker_id="w0")
    second = HpsOptimizer(_mlp(0), zone, job, worker_id="w1")  # same run: joins
    second.close()
    model(torch.randn(2, 6)).sum().backward()
    first.step()
    first.close()
    same_run = HpsOptimizer(_mlp(0), zone, job, worker_id="w2")  # a restart within run-1: joins
    same_run.close()
    monkeypatch.setenv("HPS_RUN_ID", "run-2")
    with pytest.raises(Conflict, match="resume=True") as err:
        HpsOptimizer(_mlp(0), zone, job, worker_id="w0")
    assert "run-1" in str(err.value) and "HPS_RESUME" in str(err.value)
    monkeypatch.delenv("HPS_RUN_ID")
    with pytest.raises(Conflict, match="names no run"):
        HpsOptimizer(_mlp(0), zone, job, worker_id="w0")
    resumed = HpsOptimizer(_mlp(0), zone, job, worker_id="w0", resume=True)
    assert resumed.version == 1
    resumed.close()
    monkeypatch.setenv("HPS_RESUME", "1")
    again = HpsOptimizer(_mlp(0), zone, job, worker_id="w0")
    again.close()


def test_a_declared_job_is_joined_by_name_after_it_trained(tree, monkeypatch):
    """`hps job create lm`, then workers with HPS_JOB=lm: a late or restarted worker (of any run,
    or none) joins at the published version; it was refused until resume=True."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    tree.lt.run(_declare(tree.tier("root"), JobConfig(name="decl", optimizer=OptimizerConfig(kind="sgd", lr=0.1))))
    model = _mlp(0)
    with HpsOptimizer(model, zone, "decl", worker_id="w0") as first:
        model(torch.randn(2, 6)).sum().backward()
        first.step()
    with HpsOptimizer(_mlp(0), zone, "decl", worker_id="w1") as late:
        assert late.version == 1
    monkeypatch.setenv("HPS_RUN_ID", "torchrun-7")
    with HpsOptimizer(_mlp(0), zone, "decl", worker_id="w0") as restarted:
        assert restarted.version == 1


def test_address_job_and_rank_come_from_the_environment(tree, monkeypatch):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    tree.lt.run(_declare(tree.tier("root"), JobConfig(name="envjob", optimizer=OptimizerConfig(kind="sgd", lr=0.1))))
    monkeypatch.setenv("HPS_ADDRESS", zone)
    monkeypatch.setenv("HPS_JOB", "envjob")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    opt = HpsOptimizer(_mlp(0))
    assert opt.client.worker_id == "rank1" and opt.local_rank == 1 and opt.client.job == "envjob"
    opt.close()
    monkeypatch.delenv("HPS_ADDRESS")
    with pytest.raises(ValueError, match="HPS_ADDRESS"):
        HpsOptimizer(_mlp(0))


async def _declare(root, cfg: JobConfig) -> None:
    await root.create_job(cfg, None, None)



def test_an_ssp_worker_whose_step_overflows_still_moves_its_clock_floor(tree):
    """ssp(0): a skipped step (AMP overflow) pushes nothing, yet the next step waits for the
    clock floor that step would have raised, and the only worker that can raise it is this one.
    Before the fix each step after the overflow waited the whole round timeout, then failed."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    job = JobConfig(name="ssp-skip", mode="ssp", staleness=0, optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    model = _mlp(0)
    with HpsOptimizer(model, zone, job, worker_id="w0", round_timeout_s=5.0) as opt:
        clocks = []
        for s in range(4):
            opt.zero_grad()
            model(torch.randn(8, 6)).pow(2).mean().backward()
            if s in (1, 2):  # two overflows in a row: more than the staleness bound allows
                next(model.parameters()).grad[0, 0] = float("nan")
            t0 = time.monotonic()
            r = opt.step()
            assert time.monotonic() - t0 < 4.0, f"step {s} waited for its own clock floor"
            clocks.append((r.applied, opt.clock))
        assert opt.sync(timeout_s=10) >= 2
    assert clocks == [(True, 1), (False, 2), (False, 3), (True, 4)]


def test_an_ssp_push_that_fails_in_the_background_is_raised_by_the_step_waiting_for_it(tree, monkeypatch):
    """ssp(0): step c+1 waits for the floor that step c's push raises; that push failed at once
    in the sender, yet the step waited the whole round timeout, then blamed a slow worker."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    job = JobConfig(name="ssp-fail", mode="ssp", staleness=0, optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    model = _mlp(0)
    with HpsOptimizer(model, zone, job, worker_id="w0", round_timeout_s=60.0) as opt:
        push, calls = opt.client.push, []

        def refusing_the_second(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise Conflict("refused (simulated)")
            return push(*args, **kwargs)
        monkeypatch.setattr(opt.client, "push", refusing_the_second)
        t0 = time.monotonic()
        with pytest.raises(Conflict, match="simulated"):
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 6)).pow(2).mean().backward()
                opt.step()
        assert time.monotonic() - t0 < 20.0


def test_an_ssp_step_skipped_on_a_buffer_sync_step_leaves_the_buffers_at_the_root(tree, monkeypatch):
    """ssp, buffers synced every 2 steps: step 1 (a sync step) overflows while step 0's push is
    still out, so the sender sums the skip with step 2, which carries no buffers. The sum said
    "one push carried buffers" with every buffer key absent, and the root set BatchNorm's
    running statistics to zeros."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    job = JobConfig(name="ssp-bn-skip", mode="ssp", staleness=4, buffer_sync_every=2,
                    optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    model = _Norm(0)
    with HpsOptimizer(model, zone, job, worker_id="w0", round_timeout_s=20.0) as opt:
        push, first_out, release = opt.client.push, threading.Event(), threading.Event()

        def held_first(*args, **kwargs):
            if not first_out.is_set():
                first_out.set()
                assert release.wait(20.0)
            return push(*args, **kwargs)
        monkeypatch.setattr(opt.client, "push", held_first)
        for s in range(3):
            opt.zero_grad()
            model(torch.randn(16, 4) + 2.0).pow(2).mean().backward()
            if s == 1:
                model.fc.weight.grad[0, 0] = float("nan")
            opt.step()
            if s == 0:
                assert first_out.wait(10.0)
        release.set()
        opt.sync(timeout_s=20)
        layout, values = opt.client.layout, opt.client.view.values
        off = layout.offset("bn.running_var")
        running_var = values[off:off + 4]
        assert (running_var > 0).all(), f"the root's bn.running_var became {running_var}"


def test_sync_loads_at_least_the_version_that_applied_the_last_push_through_a_lagging_zone(tree):
    """A zone answers a push once the root applied it, and pulls that version a moment later.
    ``sync()`` pulled without waiting, so it could load a view without the worker's own last
    updates (a script that saves the model after ``sync()`` lost them)."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    relay = tree.tier("z")
    real = relay.up.pull

    async def lagging(*args, **kwargs):
        out = await real(*args, **kwargs)
        await asyncio.sleep(0.5)  # the zone's view trails the root's by half a second
        return out
    relay.up.pull = lagging
    job = JobConfig(name="ssp-sync", mode="ssp", staleness=8, optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    model = _mlp(0)
    with HpsOptimizer(model, zone, job, worker_id="w0", round_timeout_s=20.0) as opt:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
        held = opt.sync(timeout_s=20)
        # The root's parameters, bit for bit (a later version there may only raise the clock
        # floor: it moves no parameter).
        assert same_bits(opt.client.view.values, tree.view("root", "ssp-sync")[3])
        assert held >= opt.sender.newest[1] >= 2
