"""A worker's push through faults, as its script sees them (found by a read-only review of the
worker side): what a push that is not applied does to the error-feedback residual, a push
interrupted after it was sent, and the last pushes of an ssp/async run failing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import Stale, UnknownJob
from ps.core.types import StepInfo
from ps.core.view import KeySpec, Layout
from tests.helpers import wait_for
from worker import ParameterClient
from worker.sender import Sender

LAYOUT = Layout([KeySpec("w", (64,))])


def _clients(address: str, names: str, **job) -> list[ParameterClient]:
    cs = [ParameterClient(address, "j", n, timeout_s=10, retry_s=2.0) for n in names]
    cs[0].create_job(JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=0.1), **job), LAYOUT,
                     np.zeros(LAYOUT.numel, np.float32))
    for c in cs:
        c.register()
        c.pull()
    return cs


def _grad(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.numel).astype(np.float32)


def _residual(c: ParameterClient) -> np.ndarray:
    return np.concatenate([np.asarray(v, np.float32).ravel() for k, v in sorted(c.encoder.state_dict().items())])


def _interrupted_once_placed(tree, c: ParameterClient, grad: np.ndarray | None, clock: int = 0,
                             go=None, job: str = "j", placed=None) -> None:
    """``c.push`` (or ``go()``) interrupted (Ctrl-C) while its round waits, once the root has
    placed it (or once ``placed()``)."""
    call, sent = c._call, threading.Event()

    def interrupted(name, request, timeout=None):
        if name != "Push" or sent.is_set():
            return call(name, request, timeout)
        sent.set()
        threading.Thread(target=call, args=(name, request, timeout), daemon=True).start()
        wait_for(placed or (lambda: tree.lt.call(lambda: c.worker_id in tree.tier("root").jobs[job].round.pushed)),
                 "the push placed")
        raise KeyboardInterrupt
    c._call = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            go() if go is not None else c.push(grad, clock=clock)
    finally:
        c._call = call


def _topk_after_a_round(tree) -> tuple[ParameterClient, ParameterClient, dict]:
    """Workers a and b of a top-k job after one applied round, and what a's residual owes."""
    a, b = _clients(tree.add("root", "global"), "ab", push_codec="topk", topk=0.25)
    done = _round([lambda: a.push(_grad(1), clock=0), lambda: b.push(_grad(2), clock=0)])
    assert done[0][0] == done[1][0] == 1, done
    for c in (a, b):
        c.pull(min_version=1)
    return a, b, a.encoder.state_dict()


def _encoded_from(c: ParameterClient, owed: dict, grad: np.ndarray, step: int) -> dict:
    """The encoder state ``c``'s encode of ``grad`` leaves when its residual owes ``owed``."""
    from ps.core.encoder import Encoder
    ref = Encoder.for_job(c.config, seed=c.worker_id, worker=True)
    ref.load_state_dict(owed)
    ref.split(LAYOUT, grad, step=step, copy=False)
    return ref.state_dict()


def _round(pushes, wait_s: float = 60) -> dict:
    """Run ``pushes`` (callables) at once, as one bsp round's workers; what each returned or
    raised (none: still running after ``wait_s``)."""
    out: dict = {}

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as exc:  # asserted on by the caller
            out[i] = exc
    ts = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(pushes)]
    [t.start() for t in ts]
    deadline = time.monotonic() + wait_s
    [t.join(max(0.0, deadline - time.monotonic())) for t in ts]
    return out


def test_a_round_skipped_for_an_overflow_takes_nothing_from_any_workers_residual(tree):
    """bsp, top-k with error feedback. a's step overflowed (AMP): its push used to encode zeros,
    which sent what its residual owed earlier, acknowledged steps in a round that is skipped,
    so that mass was lost. b's push in the same round lost the same way. Now the skipped push
    carries no gradient, and b's encode is taken back once the round says it was skipped."""
    a, b = _clients(tree.add("root", "global"), "ab", push_codec="topk", topk=0.25)
    done = _round([lambda: a.push(_grad(1), clock=0), lambda: b.push(_grad(2), clock=0)])
    assert done == {0: (1, done[0][1]), 1: (1, done[1][1])}, done
    for c in (a, b):
        c.pull(min_version=1)
    before_a, before_b = _residual(a), _residual(b)
    assert np.abs(before_a).max() > 0 and np.abs(before_b).max() > 0
    done = _round([lambda: a.push(np.zeros(LAYOUT.numel, np.float32), clock=1, step=StepInfo(skip=True)),
                   lambda: b.push(_grad(3), clock=1)])
    assert done[0][0] == done[1][0] == 2 and a.last_skipped and b.last_skipped, done
    assert np.array_equal(_residual(a), before_a) and np.array_equal(_residual(b), before_b)
    for c in (a, b):  # and the next round encodes as if the skipped one had never been
        c.close()


def test_a_push_interrupted_after_it_was_sent_is_settled_before_its_number_goes_to_another(tree):
    """Ctrl-C while the round waits (a notebook's interrupt): the push was placed, but the
    worker recorded nothing, so its next gradient went under the same number and was refused as
    another body (Conflict) for good once the first was applied. Now an interrupted send is
    unsure: the next push asks the root, which applied it, and takes the next number."""
    a, b = _clients(tree.add("root", "global"), "ab")
    _interrupted_once_placed(tree, a, _grad(1), clock=0)
    assert a._unsure is not None and a._unsure[0] == 1
    assert b.push(_grad(2), clock=0)[0] == 1  # the round, with a's interrupted push, is applied
    for c in (a, b):
        c.pull(min_version=1)
    version, _ = _round([lambda: a.push(_grad(3), clock=1), lambda: b.push(_grad(4), clock=1)])[0]
    assert version == 2 and a.acked_seq == 2
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0
    for c in (a, b):
        c.close()


def test_a_push_given_up_on_and_not_applied_gives_back_what_it_took_of_the_residual(tree):
    """bsp, top-k with error feedback. a's push went unanswered (interrupted before it reached
    the tier) and was kept as if applied: what it took of the residual, owed to earlier,
    acknowledged steps, was gone once the root said it was never applied. Now the encode waits
    for the next push to ask the root, which takes it back; that push encodes from there."""
    a, b, owed = _topk_after_a_round(tree)
    assert max(np.abs(v).max() for v in owed.values()) > 0
    call = a._call

    def unsent(name, request, timeout=None):
        if name == "Push":
            raise KeyboardInterrupt  # before it left: the tiers never saw it
        return call(name, request, timeout)
    a._call = unsent
    with pytest.raises(KeyboardInterrupt):
        a.push(_grad(3), clock=1)
    a._call = call
    assert a._unsure is not None and a._unsure[0] == 2
    # What a's next push must encode from: the residual as the lost push found it.
    want = _encoded_from(a, owed, _grad(4), step=1)
    done = _round([lambda: a.push(_grad(4), clock=1), lambda: b.push(_grad(5), clock=1)])
    assert done[0][0] == done[1][0] == 2 and a._unsure is None, done
    got = a.encoder.state_dict()
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    for c in (a, b):
        c.close()


def test_a_push_given_up_on_whose_round_was_skipped_gives_back_what_it_took_too(tree):
    """The same, but a's push did reach the root, in a round that b's AMP overflow skipped:
    the root answers the question "applied, in a skipped round" (``ResolveReply.skipped``),
    and nothing of it was applied, so its encode is taken back as well."""
    a, b, owed = _topk_after_a_round(tree)
    _interrupted_once_placed(tree, a, _grad(3), clock=1)
    assert b.push(np.zeros(LAYOUT.numel, np.float32), clock=1, step=StepInfo(skip=True))[0] == 2
    assert b.last_skipped
    for c in (a, b):
        c.pull(min_version=2)
    want = _encoded_from(a, owed, _grad(4), step=2)
    done = _round([lambda: a.push(_grad(4), clock=2), lambda: b.push(_grad(5), clock=2)])
    assert done[0][0] == done[1][0] == 3 and a.acked_seq == 3, done  # the skipped push spent its number
    got = a.encoder.state_dict()
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    for c in (a, b):
        c.close()


def test_a_lossy_push_sent_again_after_its_answer_was_lost_is_applied_once(tree):
    """bsp, top-k. a's push was placed and applied, but a was interrupted before the answer
    came; its script calls push again with the same gradient (a retry loop around the step).
    A lossless push is known by its bytes; a lossy one encoded again is other bytes (its residual
    moved on), so it took the next number: in bsp it was refused as Stale, and the script told
    "not applied" about a step that was (in async, next test, it was applied twice). Now it is
    known by what it was made from and answered with the first one's version; its second encode
    is taken back, and the residual holds one encode."""
    a, b, owed = _topk_after_a_round(tree)
    g = _grad(3)
    want = _encoded_from(a, owed, g, step=1)
    _interrupted_once_placed(tree, a, g, clock=1)
    assert b.push(_grad(4), clock=1)[0] == 2
    again = _round([lambda: a.push(g, clock=1)], wait_s=10)
    if not again:
        b.push(_grad(5), clock=2)  # let it end, then fail
    assert again and again[0][0] == 2 and a.acked_seq == 2 and a._unsure is None, again
    got = a.encoder.state_dict()
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    # A new gradient on the same view is a new push: it takes the next number.
    for c in (a, b):
        c.pull(min_version=2)
    done = _round([lambda: a.push(_grad(6), clock=2), lambda: b.push(_grad(7), clock=2)])
    assert done[0][0] == done[1][0] == 3 and a.acked_seq == 3, done
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0
    for c in (a, b):
        c.close()


def test_in_async_a_lossy_push_sent_again_after_its_answer_was_lost_is_not_applied_twice(tree):
    """async, top-k: the same, where nothing stops a second application (no round to be stale
    for): the resend was applied as a version of its own."""
    (a,) = _clients(tree.add("root", "global"), "a", mode="async", push_codec="topk", topk=0.25)
    g = _grad(3)
    _interrupted_once_placed(tree, a, g, clock=0,
                             placed=lambda: tree.lt.call(lambda: tree.tier("root").jobs["j"].view.version) == 1)
    assert a.push(g, clock=0)[0] == 1 and a.acked_seq == 1
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].view.version) == 1  # applied once
    assert a.push(_grad(4), clock=1)[0] == 2  # and the next gradient is a push of its own
    a.close()


def test_a_step_the_script_retries_after_its_answer_was_lost_is_applied_once(tree):
    """fp32, through ``HpsOptimizer``: w0's step is interrupted once its push is placed, and the
    script calls ``step(loss=...)`` again. The push is lossless, but its header carries the
    step's telemetry (seconds since the last step), which differs the second time: its digest
    did not match, so it took the next number and was refused as Stale: the script was told the
    step was not applied (a lost step) although it was. Now it is known by what it was made
    from, and answered with the first one's version."""
    from tests.helpers import mlp_batches, mlp_loss, small_mlp
    from worker import HpsOptimizer

    root = tree.add("root", "global")
    job = JobConfig(name="retry", optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    models = [small_mlp(), small_mlp()]
    opts = [HpsOptimizer(m, root, job, worker_id=f"w{i}") for i, m in enumerate(models)]
    x, y = mlp_batches(2, 8)
    try:
        losses = []
        for i, o in enumerate(opts):
            o.zero_grad()
            losses.append(mlp_loss(models[i], x[0], y[0]))
            losses[-1].backward()
        _interrupted_once_placed(tree, opts[0].client, None, go=lambda: opts[0].step(loss=losses[0]), job="retry")
        assert opts[1].step(loss=losses[1]).version == 1
        time.sleep(0.05)  # (another step time: other telemetry)
        again = _round([lambda: opts[0].step(loss=losses[0])], wait_s=10)
        if not again:
            opts[1].zero_grad()
            mlp_loss(models[1], x[1], y[1]).backward()
            opts[1].step()  # let it end, then fail
        assert again and again[0].applied and again[0].version == 1 and opts[0].client.acked_seq == 1, again
        assert tree.lt.call(lambda: tree.tier("root").jobs["retry"].view.version) == 1
        assert torch_equal(models[0], models[1])  # both hold version 1
    finally:
        for o in opts:
            o.close()


def torch_equal(a, b) -> bool:
    return all(bool((p == q).all()) for p, q in zip(a.parameters(), b.parameters()))


def test_the_last_pushes_of_an_async_run_failing_is_said_by_drain_not_swallowed(tree):
    """The background sender kept a push's error for the next ``submit``; at the end of a run
    there is none, and ``drain`` (``HpsOptimizer.sync``) returned as if every push had been
    applied. It raises that error now."""
    (a,) = _clients(tree.add("root", "global"), "a", mode="async")
    sender = Sender(a)
    try:
        sender.submit(_grad(1), 0, a.view.version, a.view.epoch)
        assert sender.drain(30)
        tree.lt.run(tree.tier("root").end_job("j"))
        sender.submit(_grad(2), 1, a.view.version, a.view.epoch)
        with pytest.raises(UnknownJob):
            sender.drain(30)
        assert sender.drain(30)  # said once
    finally:
        sender.close(5)
        a.close()


def test_a_push_that_raises_something_else_is_said_by_drain_and_the_sender_goes_on(tree, monkeypatch):
    """A push that raised anything but an hps error (out of memory while a GPU encodes) ended its
    sending thread without a word: its gradient was gone, and drain() said all was applied."""
    (a,) = _clients(tree.add("root", "global"), "a", mode="async")
    push = a.push
    calls = []

    def failing_first_and_third(*args, **kwargs):
        calls.append(1)
        if len(calls) in (1, 3):
            raise RuntimeError("CUDA out of memory (simulated)")
        return push(*args, **kwargs)
    monkeypatch.setattr(a, "push", failing_first_and_third)
    sender = Sender(a)
    try:
        sender.submit(_grad(1), 0, a.view.version, a.view.epoch)
        with pytest.raises(RuntimeError, match="out of memory"):
            sender.drain(30)
        sender.submit(_grad(2), 1, a.view.version, a.view.epoch)  # the thread still sends
        assert sender.drain(30) and sender.pushes == 1
        sender.submit(_grad(3), 2, a.view.version, a.view.epoch)
    finally:
        sender.close(5)  # the kept error is logged, not raised: closing goes on
        a.close()


class _Batches:
    """A leased sampler's progress, one batch per step (what ``LeasedSampler.step_progress``
    hands the optimizer): the last batch of shard 3 of epoch 0, then batches of shard 4."""

    def __init__(self) -> None:
        self.steps = 0

    def step_progress(self, batches: int = 1):
        self.steps += 1
        return ((0, 3, 100),) if self.steps == 1 else ((0, 4, 10 * (self.steps - 1)),)


def _refusing_once(client, sent: list):
    """``client.push``, which records each push's step information and refuses the first as
    Stale (its round closed while a tier restarted: not applied)."""
    push = client.push

    def once(*args, **kw):
        sent.append(kw.get("step"))
        if len(sent) == 1:
            raise Stale("refused by the test: not applied", wait_version=0)
        return push(*args, **kw)
    client.push = once


@pytest.mark.parametrize("mode", ["bsp", "async"])
def test_a_lost_steps_data_progress_goes_with_the_next_push(tree, mode):
    """A step refused as Stale took its batch's progress with it: at a shard's last batch the
    shard stayed leased to this worker for good, and the other workers waited for it forever.
    The next push carries it now (bsp through the optimizer, ssp/async through its sender)."""
    import torch

    from worker import HpsOptimizer
    root = tree.add("root", "global")
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 1), "frozen": torch.nn.Linear(4, 1)})
    model["frozen"].requires_grad_(False)
    opt = HpsOptimizer(model, root, JobConfig(name="j", mode=mode, optimizer=OptimizerConfig(kind="sgd", lr=0.1)),
                       worker_id="w0")
    try:
        opt._sampler = _Batches()
        sent: list = []
        _refusing_once(opt.client, sent)
        for _ in range(2):
            model["used"](torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        if opt.sender is not None:
            assert opt.sender.drain(30)
        assert opt.client.lost_steps == 1
        assert [s.progress for s in sent] == [((0, 3, 100),), ((0, 3, 100), (0, 4, 10))]
        # only the progress is carried: the frozen keys stay absent (not pushed as zeros)
        assert sent[0].absent and sent[1].absent == sent[0].absent, [s.absent for s in sent]
    finally:
        opt.close()


def test_an_encode_that_fails_leaves_no_recording_open_and_takes_nothing(tree):
    """The encode itself raising (out of memory on the device, Ctrl-C) left the encoder's
    recording open: every later push found one in flight and recorded nothing, so roll-backs
    were off for the rest of the process. Now it is taken back: residual as before, none open."""
    a, b = _clients(tree.add("root", "global"), "ab", push_codec="topk", topk=0.25)
    done = _round([lambda: a.push(_grad(1), clock=0), lambda: b.push(_grad(2), clock=0)])
    assert done[0][0] == done[1][0] == 1, done
    before = _residual(a)
    split = a.encoder.split

    def failing_split(*args, **kw):
        split(*args, **kw)  # the residuals change ...
        raise KeyboardInterrupt  # ... and the push never goes
    a.encoder.split = failing_split
    with pytest.raises(KeyboardInterrupt):
        a.push(_grad(3), clock=1)
    del a.encoder.split
    assert not a.encoder.recording and np.array_equal(_residual(a), before)
    for c in (a, b):
        c.close()


class _Counting:
    """A leased sampler that records how many batches each step reported."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def step_progress(self, batches: int = 1):
        self.asked.append(batches)
        return ()


def test_a_step_on_micro_batches_reports_every_batch_it_trained_on(tree):
    """Gradients accumulated over k batches under ``no_sync`` (as with DDP), then one step: it
    reported one batch, so the progress fell ever further behind the data trained -- shards
    stayed leased after they were trained, and at the last epoch's end for good."""
    import torch

    from worker import HpsOptimizer
    model = torch.nn.Linear(4, 1)
    opt = HpsOptimizer(model, tree.add("root", "global"), JobConfig(name="j", optimizer=OptimizerConfig(lr=0.1)),
                       worker_id="w0")
    try:
        opt._sampler = counting = _Counting()
        for k in (3, 1):
            for _ in range(k - 1):
                with opt.no_sync():
                    model(torch.ones(2, 4)).sum().backward()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert counting.asked == [3, 1]
    finally:
        opt.close()


class _BookClient:
    """The lease calls of one worker, answered by a ``LeaseBook`` in this process."""

    worker_id, _closed, _rank_info = "a", False, None

    def __init__(self, book) -> None:
        self.book = book

    def lease(self, dataset, epoch, want=True, held=()):
        import time

        self.book.declare(dataset)
        return self.book.lease(self.worker_id, 1, epoch, now=time.monotonic(), want=want, held=held)


def test_a_loop_that_leaves_an_epoch_early_leaves_its_shard_to_be_trained_and_reports_no_untrained_batch():
    """A training loop that broke out of an epoch (max_steps, an exception) kept its shard
    leased -- renewed as held for as long as the process lived, trained by nobody -- and the
    batches prefetched but never stepped on were reported as progress with the next steps.
    Iterating the epoch again now resumes the shard at what was trained."""
    from ps.core.leases import LeaseBook
    from worker.sampler import LeasedSampler, shard_indices

    book = LeaseBook()
    sampler = LeasedSampler(_BookClient(book), dataset_len=40, batch_size=4, shard_size=16)
    it = iter(sampler)
    first = [next(it), next(it), next(it)]  # three batches fetched (a prefetching DataLoader) ...
    assert book.progress(sampler.step_progress(), now=0) == 1  # ... one trained and stepped on
    it.close()  # the loop left the epoch
    assert sampler.step_progress() == ()  # the two never trained are nobody's progress
    shard0 = shard_indices(sampler.dataset, 0, 0).tolist()
    assert first[0] == shard0[:4]
    again = iter(sampler)
    resumed = next(again)
    assert resumed == shard0[4:8]  # the same shard, from what was trained
    book.progress(sampler.step_progress(), now=0)
    # A generator closed late (collected after the loop went on) takes back only its own: the
    # iteration started meanwhile (on the next shard: shard 0 was still listed as held) keeps
    # its batches and its lease.
    third = iter(sampler)
    fetched = next(third)
    again.close()
    assert fetched == shard_indices(sampler.dataset, 0, 1).tolist()[:4]
    assert sampler.step_progress() == ((0, 1, 4),) and (0, 1) in sampler._held
    book.progress(((0, 1, 4),), now=0)
    for batch in third:
        book.progress(sampler.step_progress(), now=0)
    assert 0 in book.finished


def test_many_async_pushes_refused_as_stale_do_not_make_the_next_one_from_the_future(tree):
    """An async sender (a relay's windows after a root restart) numbers each push in flight
    ahead of the last acknowledged; pushes refused as Stale never moved the tier's record of the
    numbers seen, so after 17 refusals in a row every push was refused for good as BadInput."""
    (a,) = _clients(tree.add("root", "global"), "a", mode="async")
    for _ in range(20):  # computed on a lineage the tier does not hold: not applied
        with pytest.raises(Stale):
            a.push(_grad(1), view_epoch=a.view.epoch + 1, pipelined=True)
    version, _ = a.push(_grad(2), pipelined=True)
    assert version == 1
    a.close()


def test_a_new_lineage_found_after_a_failed_version_still_resets_the_residuals(tree, monkeypatch):
    """A version that fails its checksum sets the view's epoch to 0 (ask for a snapshot). The
    snapshot that came next, of a new lineage (the root restarted or was promoted by force),
    was then not seen as one (the epoch held was 0), and the error-feedback residuals owed to
    the dead lineage went into the new one (review of the pull path)."""
    import worker.client

    tree.add("root", "global")
    (c,) = _clients(tree.addr("root"), ["w0"], push_codec="topk", topk=0.1)
    c.push(_grad(0))
    assert np.abs(_residual(c)).max() > 0
    js = tree.tier("root").jobs["j"]

    def new_lineage() -> None:  # what a forced promotion does (ps.tiers.pairing)
        js.view.epoch ^= 0x5A5A
        js.log.clear()
    tree.lt.call(new_lineage)
    real, calls = worker.client.apply_pull, []

    def failing_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise Stale("version 2 fails its checksum (injected)")
        return real(*args, **kw)
    monkeypatch.setattr(worker.client, "apply_pull", failing_once)
    c.pull()
    assert len(calls) == 2 and c.view.epoch == tree.lt.call(lambda: js.view.epoch)
    assert not any(np.abs(v).max() > 0 for v in c.encoder.state_dict().values())  # before: kept
    c.close()
