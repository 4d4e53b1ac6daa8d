"""A CreateJob sent to a relay goes up frame by frame as it arrives (cut through): the root
checks the caller and the configuration at the first frame, the relay never holds the values,
and a stream cut short, or malformed, creates nothing anywhere."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from ps.core.codecs import get_codec
from ps.core.config import JobConfig
from ps.core.tensors import split
from ps.core.view import KeySpec, Layout
from ps.net.wire import encode_create_job, stubs

BIG = Layout([KeySpec("w", (300_000,))])  # 1.2 MB of values: past a 1 MB budget
ADMIN = "admin-" + "x" * 40


def _frames(name: str, values: np.ndarray) -> list[bytes]:
    return encode_create_job(JobConfig(name=name), BIG, split(BIG, values, get_codec("fp32")))


def test_a_zone_passes_a_create_on_without_holding_its_values(tree):
    """The zone assembled a create's values whole before it sent them up: it reserved them from
    its push budget (a 1 MB zone refused a 1.2 MB job that its root would take) and held them."""
    tree.add("root", "global")
    zone = tree.add("eu-a", "zone", parent="root", push_budget_mb=1)
    budget = tree.lt.call(lambda: tree.tier("eu-a").budget)
    tree.lt.call(lambda: budget.reserve(4096))  # a push being received holds this
    values = np.arange(BIG.numel, dtype=np.float32)
    reply = stubs(grpc.insecure_channel(zone))["CreateJob"](iter(_frames("big", values)), timeout=20)
    assert reply.created
    assert np.array_equal(tree.lt.call(lambda: tree.tier("root").jobs["big"].view.values), values)
    assert tree.lt.call(lambda: budget.used) == 4096


def test_a_strangers_create_is_refused_by_the_root_before_its_values_are_sent(tree, tmp_path):
    """Without the admin's token. The zone waited for every value frame before it asked the
    root, which refused: here the sender holds its values back until it hears, so the zone
    waited for them until the call's deadline. Now the root refuses at the first frame."""
    admin = tmp_path / "admin"
    admin.write_text(ADMIN + "\n")
    tree.add("root", "global", admin_token_file=str(admin))
    zone = tree.add("eu-a", "zone", parent="root", admin_token_file=str(admin))
    frames, answered = _frames("intruded", np.zeros(BIG.numel, np.float32)), threading.Event()

    def held_back():
        yield frames[0]
        answered.wait(30)  # the values go only once the call has its answer (never, before)
        yield from frames[1:]
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        try:
            stubs(grpc.insecure_channel(zone))["CreateJob"](held_back(), timeout=20)
        finally:
            answered.set()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    assert time.monotonic() - t0 < 15
    assert "intruded" not in tree.lt.call(lambda: dict(tree.tier("root").jobs))


def test_a_strangers_create_sent_whole_through_two_relays_is_refused_with_the_roots_status(tree, tmp_path):
    """Frames sent at once, through a zone under a regional master: each relay writes the next
    frame after the root's refusal has come (a write to an ended call) and the zone's own call
    up is a grpc.aio sender; the caller must still hear the root's UNAUTHENTICATED, not an
    INTERNAL from a relay."""
    admin = tmp_path / "admin"
    admin.write_text(ADMIN + "\n")
    tree.add("root", "global", admin_token_file=str(admin))
    tree.add("eu", "regional", parent="root", admin_token_file=str(admin))
    zone = tree.add("eu-a", "zone", parent="eu", admin_token_file=str(admin))
    frames = _frames("intruded", np.zeros(BIG.numel, np.float32))
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as err:
            stubs(grpc.insecure_channel(zone))["CreateJob"](iter(frames), timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    assert "intruded" not in tree.lt.call(lambda: dict(tree.tier("root").jobs))


@pytest.mark.parametrize("cut", ["no end marker", "a bad end marker"])
def test_a_create_cut_short_at_a_zone_creates_nothing_at_the_root(tree, cut):
    """A partial create is never taken for a whole one: the root sees the call above cancelled,
    not its end, and the sender hears why from the zone."""
    tree.add("root", "global")
    zone = tree.add("eu-a", "zone", parent="root")
    frames = _frames("cut", np.ones(BIG.numel, np.float32))
    if cut == "no end marker":
        frames = frames[:-1]
    else:
        frames = frames[:-2] + frames[-1:]  # a value frame short: the end marker's counts differ
    with pytest.raises(grpc.RpcError) as err:
        stubs(grpc.insecure_channel(zone))["CreateJob"](iter(frames), timeout=20)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "create-job stream" in err.value.details()
    time.sleep(0.5)  # (the root would have created it by now)
    assert "cut" not in tree.lt.call(lambda: dict(tree.tier("root").jobs))
    assert tree.lt.call(lambda: tree.tier("root").budget.used) == 0
