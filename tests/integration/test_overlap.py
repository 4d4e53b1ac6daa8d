"""A bsp step's push streamed from backward hooks (``HpsOptimizer(..., overlap=True)``, issue 18):
the push is under way at the zone before ``step()`` is called; the workers still reach one
process's parameters (invariant 2); a gradient changed after it was sent is refused with
nothing applied; micro-batches inside ``no_sync()`` go up summed; a push cut halfway changes
nothing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ps.core.config import JobConfig, OptimizerConfig
from tests.helpers import mlp_batches, mlp_loss, small_mlp, train_mlp, wait_for
from tests.integration.test_bsp_equivalence import PER_WORKER, STEPS, WORKERS, _reference
from worker import HpsOptimizer
from worker.streamed import StreamedPush

TINY_BUCKETS = 0.0005  # MB: ~500 bytes, so the small MLP's 4 keys fall into 2 buckets


def test_four_workers_streaming_from_backward_match_one_process(tree):
    tree.add("root", "global")
    tree.add("eu", "regional", parent="root")
    zones = [tree.add("eu-a", "zone", parent="eu"), tree.add("eu-b", "zone", parent="eu")]
    opt_cfg = OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, warmup_steps=5)
    results = train_mlp(zones, JobConfig(name="eq-overlap", optimizer=opt_cfg), STEPS, WORKERS, PER_WORKER,
                        overlap=True, bucket_mb=TINY_BUCKETS)
    ref = _reference(opt_cfg)
    for i in range(WORKERS):
        for got, want in zip(results[i], ref, strict=True):
            rel = (got - want).norm() / want.norm()
            assert rel <= 1e-5, f"worker {i}: relative difference {rel:.2e}"


def _worker(tree, name: str, model: torch.nn.Module, **kw) -> tuple[HpsOptimizer, str]:
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    return HpsOptimizer(model, zone, JobConfig(name=name, optimizer=OptimizerConfig(kind="sgd", lr=0.1)),
                        worker_id="w0", **kw), zone


def _zone_push_open(tree, job: str) -> bool:
    def get():
        js = tree.tier("z").jobs.get(job)
        return js is not None and js.members.get("w0").in_flight > 0
    return tree.lt.call(get)


def test_the_push_is_at_the_zone_before_step_is_called(tree):
    model = small_mlp()
    opt, _ = _worker(tree, "early", model, overlap=True, bucket_mb=TINY_BUCKETS)
    x, y = mlp_batches(2, 8)
    for s in range(2):
        opt.zero_grad()
        mlp_loss(model, x[s], y[s]).backward()
        # The header and the buckets backward finished went up during backward: the zone
        # has the push open (its decode buffer reserved) while step() has not been called.
        wait_for(lambda: _zone_push_open(tree, "early"), "the streamed push to reach the zone", timeout=10)
        result = opt.step()
        assert result.applied and result.version == s + 1
        assert result.bytes_up == 4 * sum(p.numel() for p in model.parameters())  # fp32, every key once
        # The header, sent during backward, carries this step's clock (not the last one's):
        # the version's clock floor is this step's + 1, as with whole pushes.
        assert tree.lt.call(lambda: tree.tier("root").jobs["early"].view.clock_min) == s + 1
    opt.close()


def _root_version(tree, job: str) -> int:
    return tree.lt.call(lambda: tree.tier("root").jobs[job].view.version)


def test_a_gradient_clipped_after_backward_is_refused_and_nothing_is_applied(tree):
    model = small_mlp()
    opt, _ = _worker(tree, "clip", model, overlap=True, bucket_mb=TINY_BUCKETS)
    x, y = mlp_batches(2, 8)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    mlp_loss(model, x[0], y[0]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # after the hooks sent them
    with pytest.raises(ValueError, match="changed after that"):
        opt.step()
    time.sleep(0.5)  # the cut push would have been applied by now
    assert _root_version(tree, "clip") == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # The next step, unclipped, goes through with the sequence number the cut one did not use.
    opt.zero_grad()
    mlp_loss(model, x[1], y[1]).backward()
    assert opt.step().applied
    assert _root_version(tree, "clip") == 1
    opt.close()


def _residuals(opt: HpsOptimizer) -> dict:
    return {k: v.copy() for k, v in opt.client.encoder.state_dict().items()}


def test_a_cut_or_skipped_push_leaves_the_error_feedback_as_it_was(tree):
    """top-k: each bucket's encode moves its residuals; a push refused (clipped gradients) or
    whose round is skipped (a non-finite gradient) puts them back, so nothing of that step
    reaches the root later either."""
    model = small_mlp()
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    job = JobConfig(name="ef", push_codec="topk", topk=0.1, optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    x, y = mlp_batches(3, 8)
    with HpsOptimizer(model, zone, job, worker_id="w0", overlap=True, bucket_mb=TINY_BUCKETS) as opt:
        opt.zero_grad()
        mlp_loss(model, x[0], y[0]).backward()
        assert opt.step().applied
        before = _residuals(opt)
        assert before and any(v.any() for v in before.values())  # top-k left something unsent
        opt.zero_grad()
        mlp_loss(model, x[1], y[1]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with pytest.raises(ValueError, match="changed after that"):
            opt.step()
        after = _residuals(opt)
        assert after.keys() == before.keys() and all((after[k] == before[k]).all() for k in before)
        opt.zero_grad()
        (mlp_loss(model, x[2], y[2]) * float("inf")).backward()  # non-finite, as backward makes them
        result = opt.step()
        assert not result.applied  # the round was skipped
        after = _residuals(opt)
        assert all((after[k] == before[k]).all() for k in before)


def test_a_round_skipped_for_another_workers_overflow_leaves_the_error_feedback_as_it_was(tree):
    """w1 overflows, so the round is skipped for w0 too: nothing w0's streamed push carried is
    applied, so its top-k residuals must be as before the step (they were kept)."""
    models = [small_mlp(), small_mlp()]
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    job = JobConfig(name="ef2", push_codec="topk", topk=0.1, optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    x, y = mlp_batches(2, 8)
    opts = [HpsOptimizer(models[0], zone, job, worker_id="w0", overlap=True, bucket_mb=TINY_BUCKETS),
            HpsOptimizer(models[1], zone, job, worker_id="w1")]
    results: dict = {}

    def step(i: int, s: int) -> None:
        opts[i].zero_grad()
        loss = mlp_loss(models[i], x[s], y[s])
        (loss * float("inf") if (i, s) == (1, 1) else loss).backward()
        results[i] = opts[i].step()

    try:
        for s in range(2):
            if s == 1:
                before = _residuals(opts[0])
                assert before and any(v.any() for v in before.values())  # top-k left something unsent
            threads = [threading.Thread(target=step, args=(i, s)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(results) == 2 and results[0].applied == (s == 0), results
            results.clear()
        after = _residuals(opts[0])
        assert after.keys() == before.keys() and all((after[k] == before[k]).all() for k in before)
    finally:
        for o in opts:
            o.close()


def _streaming_and_whole(tree, job: str) -> tuple[list, list[HpsOptimizer]]:
    """A top-k bsp job at a root: w0 streams its pushes from backward, w1 pushes whole."""
    models = [small_mlp(), small_mlp()]
    root = tree.add("root", "global")
    cfg = JobConfig(name=job, push_codec="topk", topk=0.1, optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    return models, [HpsOptimizer(models[0], root, cfg, worker_id="w0", overlap=True, bucket_mb=TINY_BUCKETS),
                    HpsOptimizer(models[1], root, cfg, worker_id="w1")]


def _interrupted_streamed_step(tree, monkeypatch, opt, model, x, y, job: str, scale: float = 1.0) -> None:
    """``opt.step()`` interrupted (Ctrl-C) once its streamed push is placed in the root's round
    (its loss times ``scale``: inf for a step that overflows)."""
    wait = StreamedPush._wait

    def interrupted(self) -> None:
        monkeypatch.setattr(StreamedPush, "_wait", wait)
        wait_for(lambda: tree.lt.call(lambda: "w0" in tree.tier("root").jobs[job].round.pushed),
                 "w0's push placed in its round")
        raise KeyboardInterrupt
    monkeypatch.setattr(StreamedPush, "_wait", interrupted)
    opt.zero_grad()
    (mlp_loss(model, x, y) * scale).backward()
    with pytest.raises(KeyboardInterrupt):
        opt.step()


@pytest.mark.parametrize("skipped", [True, False], ids=["skipped", "applied"])
@pytest.mark.parametrize("then", ["push", "abort", "state_dict"])
def test_a_streamed_push_interrupted_on_its_way_is_settled_by_what_became_of_it(tree, monkeypatch, then, skipped):
    """Ctrl-C in w0's step() while its streamed push waits for its round: the push goes on being
    delivered by its RPC thread, and w1's overflow then skips the round. Nothing said yet that
    the push was unsure, so its encode was kept at the interrupt and what it took of w0's top-k
    residual was lost. Now it is decided once the delivery ends, before the next push: taken
    back, as for any push whose round was skipped (and kept if the round was applied). So too
    before an abort of the next step's push (``idle()``, ``close()``), which took the encode
    back as its own, and before a checkpoint reads the residuals."""
    models, opts = _streaming_and_whole(tree, "ef3")
    x, y = mlp_batches(2, 8)
    results: dict = {}

    def step(i: int) -> None:
        opts[i].zero_grad()
        mlp_loss(models[i], x[0], y[0]).backward()
        results[i] = opts[i].step()

    try:
        threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert results[0].applied and results[1].applied, results
        before = _residuals(opts[0])
        assert before and any(v.any() for v in before.values())  # top-k left something unsent
        _interrupted_streamed_step(tree, monkeypatch, opts[0], models[0], x[1], y[1], "ef3")
        encoded = _residuals(opts[0])  # what the interrupted push's encode left
        assert any((encoded[k] != before[k]).any() for k in before)
        opts[1].zero_grad()
        loss = mlp_loss(models[1], x[1], y[1])
        (loss * float("inf") if skipped else loss).backward()
        assert opts[1].step().applied != skipped  # the round, with w0's push in it
        if then == "push":
            opts[0].client._land_pending()  # what w0's next push does first
        elif then == "abort":
            opts[0]._overlap.abort()
        else:
            opts[0].state_dict()
        assert opts[0].client.acked_seq == 2 and opts[0].client.last_skipped == skipped
        after, want = _residuals(opts[0]), before if skipped else encoded
        assert after.keys() == want.keys() and all((after[k] == want[k]).all() for k in want)
    finally:
        for o in opts:
            o.close()


@pytest.mark.parametrize("retry", ["step", "backward-and-step", "overflowed"])
def test_a_streamed_step_the_script_retries_after_ctrl_c_is_applied_once(tree, monkeypatch, retry):
    """Ctrl-C in w0's step() while its streamed push waits; the round is then applied (w1 steps).
    The script calls step() again: no backward streamed it, so it goes as a whole push, whose
    bytes are not the streamed one's. It took the next number, and was refused as Stale (a
    step told "not applied" that was). Now the interrupted push's answer is waited for, and
    the step sent again is known by what it was made from: answered with that version. So too
    when the script runs backward again on the same batch first (a streamed push again, cut),
    and when the step overflowed (its round skipped: a whole push sends zeros for it)."""
    models, opts = _streaming_and_whole(tree, "again")
    x, y = mlp_batches(1, 8)
    try:
        overflowed = retry == "overflowed"
        _interrupted_streamed_step(tree, monkeypatch, opts[0], models[0], x[0], y[0], "again",
                                   scale=float("inf") if overflowed else 1.0)
        opts[1].zero_grad()
        mlp_loss(models[1], x[0], y[0]).backward()
        assert opts[1].step().applied != overflowed
        if retry == "backward-and-step":
            opts[0].zero_grad()
            mlp_loss(models[0], x[0], y[0]).backward()
        result = opts[0].step()  # sent again, as the script's retry loop does
        assert result.version == 1 and result.applied != overflowed and opts[0].client.acked_seq == 1, result
        assert opts[0].client.lost_steps == 0 and opts[0].client.last_skipped == overflowed
        assert tree.lt.call(lambda: tree.tier("root").jobs["again"].view.version) == 1
        assert all(bool((p == q).all()) for p, q in zip(models[0].parameters(), models[1].parameters()))
    finally:
        for o in opts:
            o.close()


def test_a_backward_without_a_step_is_dropped_by_zero_grad(tree):
    """A batch skipped after its backward (or a backward that raised): zero_grad drops the
    push it began, and the next backward and step go through."""
    model = small_mlp()
    opt, _ = _worker(tree, "skipped", model, overlap=True, bucket_mb=TINY_BUCKETS)
    x, y = mlp_batches(2, 8)
    opt.zero_grad()
    mlp_loss(model, x[0], y[0]).backward()
    opt.zero_grad()
    mlp_loss(model, x[1], y[1]).backward()
    assert opt.step().applied
    assert _root_version(tree, "skipped") == 1
    opt.close()


def test_micro_batches_inside_no_sync_go_up_summed(tree):
    """Three micro-batches, the first two inside no_sync(): the step pushes their sum, exactly
    as the same script without overlap does (fp32: bit for bit)."""
    x, y = mlp_batches(3, 8)
    finals = []
    for name, overlap in (("acc-plain", False), ("acc-overlap", True)):
        model = small_mlp()
        tree.add(f"root-{name}", "global")
        zone = tree.add(f"z-{name}", "zone", parent=f"root-{name}")
        with HpsOptimizer(model, zone, JobConfig(name=name, optimizer=OptimizerConfig(kind="sgd", lr=0.1)),
                          worker_id="w0", overlap=overlap, bucket_mb=TINY_BUCKETS) as opt:
            opt.zero_grad()
            with opt.no_sync():
                for s in range(2):
                    mlp_loss(model, x[s], y[s]).backward()
            mlp_loss(model, x[2], y[2]).backward()
            assert opt.step().applied
            finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


def test_a_parameter_without_a_gradient_stays_put_and_frozen_ones_too(tree):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 2), "unused": torch.nn.Linear(4, 2),
                                 "frozen": torch.nn.Linear(4, 2)})
    model["frozen"].requires_grad_(False)
    opt, _ = _worker(tree, "absent", model, overlap=True, bucket_mb=TINY_BUCKETS)
    unused = [p.detach().clone() for p in model["unused"].parameters()]
    used = [p.detach().clone() for p in model["used"].parameters()]
    for _ in range(2):
        opt.zero_grad()
        model["used"](torch.ones(3, 4)).sum().backward()
        assert opt.step().applied
    assert all(torch.equal(a, b) for a, b in zip(unused, model["unused"].parameters(), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(used, model["used"].parameters(), strict=True))
    opt.close()


def test_a_streamed_push_cut_halfway_changes_nothing(tree):
    """The stream is cut after its first buckets went up (the worker aborts): the zone drops
    it, nothing is applied, and the next push reuses the sequence number."""
    model = small_mlp()
    opt, _ = _worker(tree, "cut", model, overlap=True, bucket_mb=TINY_BUCKETS)
    x, y = mlp_batches(2, 8)
    opt.zero_grad()
    mlp_loss(model, x[0], y[0]).backward()
    wait_for(lambda: _zone_push_open(tree, "cut"), "the streamed push to reach the zone", timeout=10)
    opt.idle()  # this worker contributes nothing this round after all: the push is cut
    assert opt.last_result is not None and opt.last_result.version == 1  # the (empty) round closed
    wait_for(lambda: not _zone_push_open(tree, "cut"), "the zone to drop the cut push", timeout=10)
    assert tree.lt.call(lambda: tree.tier("root").jobs["cut"].stats.pushes) == 1  # the empty one
    opt.zero_grad()
    mlp_loss(model, x[1], y[1]).backward()
    assert opt.step().applied
    opt.close()


def test_overlap_is_refused_where_it_is_not_built(tree, monkeypatch):
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    with pytest.raises(ValueError, match="already pushes in the background"):
        HpsOptimizer(small_mlp(), zone, JobConfig(name="async-o", mode="async"), worker_id="w0", overlap=True)
    # HPS_OVERLAP set for a whole fleet: where overlap is not built it is skipped with a warning.
    monkeypatch.setenv("HPS_OVERLAP", "1")
    with HpsOptimizer(small_mlp(), zone, JobConfig(name="async-e", mode="async"), worker_id="w1") as opt:
        assert opt._overlap is None
    monkeypatch.delenv("HPS_OVERLAP")
    model = small_mlp()
    with HpsOptimizer(model, zone, JobConfig(name="amp-o"), worker_id="w0", overlap=True) as opt:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(mlp_loss(model, *[t[0] for t in mlp_batches(1, 8)])).backward()
        with pytest.raises(ValueError, match="GradScaler"):
            scaler.step(opt)


def test_close_removes_the_hooks_and_stops_the_encoding_thread(tree):
    model = small_mlp()
    opt, _ = _worker(tree, "threads", model, overlap=True, bucket_mb=TINY_BUCKETS)
    assert any(t.name == "hps-overlap-w0" for t in threading.enumerate())
    opt.close()
    wait_for(lambda: not any(t.name == "hps-overlap-w0" for t in threading.enumerate()),
             "the encoding thread to stop", timeout=5)
    x, y = mlp_batches(1, 8)
    mlp_loss(model, x[0], y[0]).backward()  # no hook left to take the gradient
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the device tool's GPU machine)")
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_on_a_gpu_the_streamed_push_equals_the_whole_one(tree, codec):
    """Gradients on the GPU: each hook's copy into the flat device buffer is ordered before
    the encoding thread's work on it (CUDA events), and the codec runs on the device. fp32:
    the parameters equal those of the same script without overlap bit for bit; int8 (its
    stochastic rounding draws in another order per bucket): every step is applied and the
    parameters stay finite."""
    x, y = (t.cuda() for t in mlp_batches(4, 64))
    finals = []
    for overlap in (False, True):
        name = f"gpu-{codec}-{int(overlap)}"
        tree.add(f"root-{name}", "global")
        zone = tree.add(f"z-{name}", "zone", parent=f"root-{name}")
        model = small_mlp().cuda()
        job = JobConfig(name=name, push_codec=codec, optimizer=OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9))
        with HpsOptimizer(model, zone, job, worker_id="w0", overlap=overlap, bucket_mb=TINY_BUCKETS) as opt:
            for s in range(4):
                opt.zero_grad()
                mlp_loss(model, x[s], y[s]).backward()
                assert opt.step().applied
            finals.append([p.detach().cpu().clone() for p in model.parameters()])
    if codec == "fp32":
        assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in finals[1])
