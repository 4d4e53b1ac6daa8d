"""Invariant 7 and the refusals around it, on real tiers: a push cut after k of its n frames
changes nothing (cancel, deadline, kill -9 of the sender, a dropped connection) and its retry
is applied once; a sequence number reused with another body is refused; a round whose sum or
whose optimizer step is not finite is refused whole and the version does not move."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, OptimizerConfig
from ps.core.errors import BadInput, Conflict
from ps.core.tensors import split
from ps.core.types import PushMeta
from ps.core.view import KeySpec, Layout
from ps.net.wire import encode_push, stubs
from ps.tools.wanem import Link, LinkProxy
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (64,)), KeySpec("b", (16,))])
LR = 0.5


@pytest.fixture
def small_frames(monkeypatch):
    """Frames of at most 64 payload bytes, so a small push spans many (the server does not care)."""
    import ps.net.wire
    monkeypatch.setattr(ps.net.wire, "MAX_FRAME_PAYLOAD", 64)


def _setup(tree, through_zone: bool, **job):
    root = tree.add("root", "global")
    addr = tree.add("z", "zone", parent="root") if through_zone else root
    a, b = ParameterClient(addr, "j", "a"), ParameterClient(addr, "j", "b")
    a.create_job(JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=LR), **job), LAYOUT,
                 np.zeros(LAYOUT.numel, np.float32))
    for c in (a, b):
        c.register()
        c.pull()
    return ("root" if not through_zone else "z"), addr, a, b


def _frames(client, seq: int, grad: np.ndarray) -> list[bytes]:
    meta = PushMeta("j", client.worker_id, seq, client.view.version, client.view.epoch,
                    incarnation=client.incarnation)
    return encode_push(meta, split(LAYOUT, grad, get_codec("fp32")))


def _state(tree, tier: str):
    """What must not change: every tier's view, the root's parameters, the open round."""
    def read():
        out = []
        for name in tree.servers:
            js = tree.tier(name).jobs["j"]
            out.append((name, js.view.version, js.view.checksum, js.view.values.tobytes(),
                        dict(js.round.pushed)))
        out.append(tree.tier("root").jobs["j"].params.tobytes())
        return out
    return tree.lt.call(read)


def _wait(tree, tier: str, cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tree.lt.call(lambda: cond(tree.tier(tier))):
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _in_flight(member: str):
    return lambda t: t.jobs["j"].members.find(member).in_flight


def _held(frames: list[bytes], k: int, release: threading.Event):
    """The first ``k`` frames, then nothing until ``release``: a stream stalled mid-push."""
    yield from frames[:k]
    release.wait(30)


def _cut_by_cancel(addr, frames, k, tree, tier):
    release = threading.Event()
    call = stubs(grpc.insecure_channel(addr))["Push"].future(_held(frames, k, release), timeout=30)
    _wait(tree, tier, _in_flight("a"), "the push to start arriving")
    call.cancel()
    release.set()


def _cut_by_deadline(addr, frames, k, tree, tier):
    release = threading.Event()
    with pytest.raises(grpc.RpcError) as err:
        stubs(grpc.insecure_channel(addr))["Push"](_held(frames, k, release), timeout=1.0)
    release.set()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


_SENDER = """
import pickle, sys, time, grpc
from ps.net.wire import stubs
addr, path, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
frames = pickle.load(open(path, "rb"))
def gen():
    yield from frames[:k]
    time.sleep(60)
stubs(grpc.insecure_channel(addr))["Push"](gen(), timeout=60)
"""


def _cut_by_kill(addr, frames, k, tree, tier, tmp_path):
    path = tmp_path / "frames.pkl"
    path.write_bytes(pickle.dumps(frames))
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, addr, str(path), str(k)],
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        _wait(tree, tier, _in_flight("a"), "the push to start arriving", timeout=30)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _cut_by_dropped_connection(addr, frames, k, tree, tier):
    link = tree.lt.run(LinkProxy(Link(), addr).start())
    release = threading.Event()
    call = stubs(grpc.insecure_channel(link.address))["Push"].future(_held(frames, k, release), timeout=30)
    try:
        _wait(tree, tier, _in_flight("a"), "the push to start arriving")
    finally:
        tree.lt.run(link.close())  # the sender is alive; the path to it is gone
        release.set()
    with pytest.raises(grpc.RpcError):
        call.result(timeout=30)


@pytest.mark.parametrize("cut", ["cancel", "deadline", "kill", "dropped"])
@pytest.mark.parametrize("through_zone", [False, True], ids=["at-root", "at-zone"])
def test_a_push_cut_after_k_of_n_frames_changes_nothing_and_its_retry_applies_once(
        tree, small_frames, tmp_path, cut, through_zone):
    tier, addr, a, b = _setup(tree, through_zone)
    ga = np.linspace(-1, 1, LAYOUT.numel).astype(np.float32)
    gb = np.full(LAYOUT.numel, 0.25, np.float32)
    frames = _frames(a, 1, ga)
    k = len(frames) // 2
    assert 2 <= k < len(frames) - 1  # the header and some chunks arrive, not the end marker
    before = _state(tree, tier)
    if cut == "kill":
        _cut_by_kill(addr, frames, k, tree, tier, tmp_path)
    else:
        {"cancel": _cut_by_cancel, "deadline": _cut_by_deadline,
         "dropped": _cut_by_dropped_connection}[cut](addr, frames, k, tree, tier)
    _wait(tree, tier, lambda t: not _in_flight("a")(t), "the cut push to be dropped")
    assert _state(tree, tier) == before, "a partial push changed state"
    assert tree.lt.call(lambda: tree.tier(tier).budget.used) == 0  # its memory is given back
    # The retry (the same bytes) and b's push make version 1, with a's gradient once.
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("a", stubs(grpc.insecure_channel(addr))["Push"](
        iter(frames), timeout=30)))
    t.start()
    version, _ = b.push(gb)
    t.join(30)
    assert version == 1 and result["a"].applied_version == 1 and not result["a"].duplicate
    expected = (-LR * (ga + gb) / 2).astype(np.float32)
    b.pull(min_version=1)
    np.testing.assert_array_equal(b.view.values, expected)
    for c in (a, b):
        c.close()


def test_a_sequence_number_reused_with_another_body_is_refused(tree):
    """Invariant 4: a retry is recognised only when its body is the same push -- while the
    first is waiting in its round, and after it was applied."""
    _, addr, a, b = _setup(tree, through_zone=True)
    rpc = stubs(grpc.insecure_channel(addr))
    g1, g2 = np.ones(LAYOUT.numel, np.float32), np.full(LAYOUT.numel, 7.0, np.float32)
    first = rpc["Push"].future(iter(_frames(a, 1, g1)), timeout=30)
    _wait(tree, "z", lambda t: "a" in t.jobs["j"].round.pushed, "a's push to wait in its round")
    with pytest.raises(grpc.RpcError) as err:  # garbage riding on the pending number
        rpc["Push"](iter(_frames(a, 1, g2)), timeout=5)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "another body" in err.value.details()
    b.push(np.zeros(LAYOUT.numel, np.float32))
    assert first.result(timeout=30).applied_version == 1
    with pytest.raises(grpc.RpcError) as err:  # and after it was applied
        rpc["Push"](iter(_frames(a, 1, g2)), timeout=5)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    again = rpc["Push"](iter(_frames(a, 1, g1)), timeout=5)  # the same push: its recorded ack
    assert again.duplicate and again.applied_version == 1
    b.pull(min_version=1)
    np.testing.assert_array_equal(b.view.values, (-LR * g1 / 2).astype(np.float32))
    for c in (a, b):
        c.close()


def _both_push(a, b, ga, gb) -> dict:
    out = {}

    def run(name, c, g):
        try:
            out[name] = c.push(g)
        except Exception as exc:  # asserted on below
            out[name] = exc
    ts = [threading.Thread(target=run, args=(n, c, g)) for n, c, g in (("a", a, ga), ("b", b, gb))]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    return out


@pytest.mark.parametrize("through_zone", [False, True], ids=["at-root", "at-zone"])
def test_a_round_whose_sum_overflows_is_refused_and_the_version_does_not_move(tree, through_zone):
    tier, addr, a, b = _setup(tree, through_zone)
    before = _state(tree, "root")
    huge = np.full(LAYOUT.numel, 3e38, np.float32)  # each finite; their sum is not
    out = _both_push(a, b, huge, huge)
    for name in "ab":
        assert isinstance(out[name], BadInput) and "not finite" in str(out[name]), out[name]
    assert _state(tree, "root") == before
    # The round opened again: the same sequence numbers, finite gradients, version 1.
    g = np.ones(LAYOUT.numel, np.float32)
    out = _both_push(a, b, g, g)
    assert out["a"][0] == out["b"][0] == 1, out
    for c in (a, b):
        c.close()


@pytest.mark.parametrize("durable", [False, True], ids=["in-memory", "checkpointed"])
def test_an_optimizer_step_that_overflows_is_refused_and_the_job_is_unchanged(tree, tmp_path, durable):
    """Each gradient and their mean are finite; lr x mean is not. The root rolls the job back to
    its version exactly: from an in-memory copy, or from its checkpoint and log."""
    kw = {"checkpoint_dir": str(tmp_path / "ckpt")} if durable else {}
    tree.add("root", "global", **kw)
    a, b = ParameterClient(tree.addr("root"), "j", "a"), ParameterClient(tree.addr("root"), "j", "b")
    cfg = JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=1e10, momentum=0.9))
    a.create_job(cfg, LAYOUT, np.zeros(LAYOUT.numel, np.float32))
    for c in (a, b):
        c.register()
        c.pull()
    small = np.full(LAYOUT.numel, 1e-12, np.float32)
    assert _both_push(a, b, small, small)["a"][0] == 1  # momentum state is not zero now
    for c in (a, b):
        c.pull(min_version=1)
    before = _state(tree, "root")
    state = tree.lt.call(lambda: {k: (v.copy() if hasattr(v, "copy") else v)
                                  for k, v in tree.tier("root").jobs["j"].optimizer.state_dict().items()})
    big = np.full(LAYOUT.numel, 1e30, np.float32)
    out = _both_push(a, b, big, big)
    for name in "ab":
        assert isinstance(out[name], BadInput) and "non-finite" in str(out[name]), out[name]
    assert _state(tree, "root") == before
    after = tree.lt.call(lambda: tree.tier("root").jobs["j"].optimizer.state_dict())
    assert after.keys() == state.keys()
    for k, v in state.items():
        np.testing.assert_array_equal(after[k], v)
    out = _both_push(a, b, small, small)  # the round opened again on version 1
    assert out["a"][0] == out["b"][0] == 2, out
    for c in (a, b):
        c.close()


def test_conflict_reaches_the_client_as_conflict(tree):
    """The exact error class travels (trailing metadata), not only its status code."""
    _, addr, a, b = _setup(tree, through_zone=False)
    rpc = stubs(grpc.insecure_channel(addr))
    first = rpc["Push"].future(iter(_frames(a, 1, np.ones(LAYOUT.numel, np.float32))), timeout=30)
    _wait(tree, "root", lambda t: "a" in t.jobs["j"].round.pushed, "a's push to wait in its round")
    with pytest.raises(Conflict):
        a._call("Push", iter(_frames(a, 1, np.zeros(LAYOUT.numel, np.float32))))
    b.push(np.ones(LAYOUT.numel, np.float32))
    first.result(timeout=30)
    for c in (a, b):
        c.close()
