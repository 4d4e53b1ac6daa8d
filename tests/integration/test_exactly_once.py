"""Invariant 4: a push retried after a dropped acknowledgement is applied once."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from ps.core.codecs import get_codec
from ps.core.config import JobConfig, OptimizerConfig, ServerConfig
from ps.core.errors import BadInput, TimedOut
from ps.core.tensors import split
from ps.core.types import PushKey, PushMeta
from ps.core.view import KeySpec, Layout
from ps.net.messages import OUTCOME_NAME
from ps.net.wire import as_resend, encode_push, keys_to_pb, pb, push_digest, stubs
from ps.server import create_server
from ps.tools.wanem import Link, LinkProxy
from tests.helpers import FAST, bsp_rounds, wait_for
from worker import ParameterClient

LAYOUT = Layout([KeySpec("w", (10,))])
LR = 0.5


def _clients(addresses: list[str], names: str, client_kw: dict | None = None, **job) -> list[ParameterClient]:
    """One client per address and name of job "j" (SGD at LR, ``job``'s other settings),
    created by the first, each registered and holding version 0."""
    cs = [ParameterClient(addr, "j", name, **(client_kw or {})) for addr, name in zip(addresses, names)]
    cs[0].create_job(JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=LR), **job), LAYOUT,
                     np.zeros(10, np.float32))
    for c in cs:
        c.register()
        c.pull()
    return cs


def _setup(tree, through_zone: bool):
    root = tree.add("root", "global")
    addr = tree.add("z", "zone", parent="root") if through_zone else root
    a, b = _clients([addr, addr], "ab")
    return addr, a, b


def _frames(client, seq: int, grad: np.ndarray, base: int = 0, epoch: int = 0):
    return encode_push(PushMeta("j", client.worker_id, seq, base, epoch, 1, 0, 0, incarnation=client.incarnation),
                       split(LAYOUT, grad, get_codec("fp32")))


@pytest.mark.parametrize("through_zone", [False, True], ids=["at-root", "through-zone"])
def test_retry_after_a_dropped_ack_is_applied_once(tree, through_zone):
    addr, a, b = _setup(tree, through_zone)
    ga, gb = np.full(10, 1.0, np.float32), np.full(10, 3.0, np.float32)
    rpc = stubs(grpc.insecure_channel(addr))
    # a's push reaches the tier, but its acknowledgement is lost: the call gives up first
    # (the round cannot close until b pushes).
    with pytest.raises(grpc.RpcError) as err:
        rpc["Push"](iter(_frames(a, 1, ga, epoch=a.view.epoch)), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    version, _ = b.push(gb)                                # completes the round
    assert version == 1
    # a retries the same (job, worker, sequence): the recorded ack, nothing re-applied.
    ack = rpc["Push"](iter(_frames(a, 1, ga, epoch=a.view.epoch)), timeout=5)
    assert ack.duplicate and ack.applied_version == 1
    b.pull(min_version=1)
    expected = -LR * (ga + gb) / 2                        # one SGD step on the mean, once
    np.testing.assert_array_equal(b.view.values, expected.astype(np.float32))
    _, root_version, _, root_values = tree.view("root", "j")
    assert root_version == 1
    np.testing.assert_array_equal(root_values, expected.astype(np.float32))
    for c in (a, b):
        c.close()


def test_duplicate_while_the_round_is_still_open_waits_for_the_same_ack(tree):
    addr, a, b = _setup(tree, through_zone=False)
    rpc = stubs(grpc.insecure_channel(addr))
    g = np.ones(10, np.float32)
    first = rpc["Push"].future(iter(_frames(a, 1, g, epoch=a.view.epoch)), timeout=10)
    second = rpc["Push"].future(iter(_frames(a, 1, g, epoch=a.view.epoch)), timeout=10)
    b.push(g)
    acks = sorted([first.result(), second.result()], key=lambda r: r.duplicate)
    assert [r.applied_version for r in acks] == [1, 1]
    assert [r.duplicate for r in acks] == [False, True]
    assert tree.view("root", "j")[1] == 1
    for c in (a, b):
        c.close()


@pytest.mark.parametrize("through_zone", [False, True], ids=["at-root", "through-zone"])
def test_a_sequence_number_older_than_the_acknowledgements_kept_is_refused_not_applied_again(tree, through_zone):
    """Found by the request fuzzer: a push reusing a sequence number acknowledged more than 64
    pushes ago (the acknowledgements a tier keeps per sender), with another body, was taken for
    the retry of a refused push and applied a second time; the root logged it CRITICAL (a worker
    push applied by two versions) and counted it in hps_double_applied."""
    addr, a, b = _setup(tree, through_zone)
    one = np.ones(10, np.float32)
    bsp_rounds([a, b], 70, lambda i, step: one)
    version = tree.view("root", "j")[1]
    forged = stubs(grpc.insecure_channel(addr))["Push"].future(
        iter(_frames(a, 1, np.full(10, 5.0, np.float32), base=version, epoch=a.view.epoch)), timeout=5)
    with ThreadPoolExecutor(1) as pool:
        b_push = pool.submit(b.push, one)  # b's part of the round
        with pytest.raises(grpc.RpcError) as err:
            forged.result()
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "another body" in err.value.details()
        a.push(one)  # a's real gradient closes the round
        assert b_push.result(10)[0] == version + 1
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0
    assert tree.view("root", "j")[3].tobytes() == np.full(10, -LR * 71, np.float32).tobytes()
    for c in (a, b):
        c.close()  # their heart-beating threads must not outlive the test


@pytest.mark.parametrize("then", ["retry", "next-step", "new-workers"])
def test_a_forward_a_zone_gave_up_on_and_the_root_applied_later_is_not_applied_again(tree, then):
    """The zone's round timeout passes before the root answers its forward (the root's round
    waits for a worker pushing there directly): the zone tells its workers their pushes timed
    out. Then the root's round closes, the forward in it. One worker retries, the other leaves:
    the retry is answered with that version, from the root's record asked through the zone --
    not summed into a new forward under the number the first one used (another body: the root
    refused it as a Conflict, and every later round of the zone too) -- and the rounds after
    it go on. Or the worker goes on to its next step instead: it asks before giving the timed
    out push's number to another gradient, and takes the next (that one was applied). Or both
    leave and new workers come: the zone's next forward asks the root first, and takes the
    next number."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root", round_timeout_s=2.0)
    a, b = ParameterClient(zone, "j", "a"), ParameterClient(zone, "j", "b")
    d = ParameterClient(tree.addr("root"), "j", "d", round_timeout_s=20)  # a broken zone: fails, not hangs
    a.create_job(JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=LR)), LAYOUT,
                 np.zeros(10, np.float32))
    for c in (a, b, d):
        c.register()
        c.pull()
    ga, gb, gd = (np.full(10, g, np.float32) for g in (1.0, 2.0, 3.0))
    with ThreadPoolExecutor(2) as pool:
        # The zone waits its 2 s for the root's round, then gives up on its forward.
        for f in [pool.submit(a.push, ga), pool.submit(b.push, gb)]:
            with pytest.raises(TimedOut):
                f.result(30)
        assert d.push(gd)[0] == 1  # the root's round closes, with the zone's forward in it
        b.close()
        if then == "retry":
            version, _ = a.push(ga)  # the same push again: the root's answer, nothing re-applied
            assert version == 1
        elif then == "new-workers":
            a.close()
            a = ParameterClient(zone, "j", "a2")
            a.register()
        for step in (2, 3):
            for c in (a, d):
                c.pull(min_version=step - 1)
            fa, fd = pool.submit(a.push, ga), pool.submit(d.push, gd)
            assert fa.result(30)[0] == fd.result(30)[0] == step
    _, root_version, _, root_values = tree.view("root", "j")
    assert root_version == 3
    expected = -LR * (ga + gb + gd) / 3 - 2 * LR * (ga + gd) / 2
    np.testing.assert_allclose(root_values, expected, rtol=1e-6)
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0
    for c in (a, d):
        c.close()


def test_a_retry_of_a_push_whose_forward_was_settled_applied_is_answered_not_placed_again(tree):
    """ssp, where no base-version check would catch it: the zone gives up on a's forward (the
    root's apply is held past the zone's round timeout) and the root applies it afterwards.
    c's next push makes the zone ask the root first (applied: a new number); a's resend --
    raw frames, as a client that does not ask first would send them -- must then get the
    version that applied it, not be placed in a new window and applied a second time."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root", round_timeout_s=2.0)
    a, c = _clients([zone, zone], "ac", mode="ssp", staleness=4)
    root = tree.tier("root")

    async def hold(lock: asyncio.Lock) -> None:
        async with lock:
            await asyncio.sleep(3.0)

    held = asyncio.run_coroutine_threadsafe(hold(root.jobs["j"].apply_lock), tree.lt.loop)
    ga, gc = np.full(10, 1.0, np.float32), np.full(10, 4.0, np.float32)
    rpc = stubs(grpc.insecure_channel(zone))
    with pytest.raises(grpc.RpcError):  # the zone waited its 2 s for the root, then gave up
        rpc["Push"](iter(_frames(a, 1, ga, epoch=a.view.epoch)), timeout=10)
    held.result(10)
    wait_for(lambda: tree.lt.call(lambda: root.jobs["j"].view.version) == 1, "the root applying it", 10)
    assert c.push(gc)[0] == 2
    ack = rpc["Push"](iter(_frames(a, 1, ga, epoch=a.view.epoch)), timeout=10)
    assert ack.applied_version == 1 and ack.duplicate
    _, root_version, _, root_values = tree.view("root", "j")
    assert root_version == 2
    np.testing.assert_allclose(root_values, -LR * (ga + gc) / 2, rtol=1e-6)  # each weighed by 1 of 2 workers
    assert tree.lt.call(lambda: root.jobs["j"].stats.double_applied) == 0
    for x in (a, c):
        x.close()



def _cut_link_mid_round(tree, link: LinkProxy, addresses: tuple[str, str, str], moved: tuple[str, str]) -> None:
    """Workers a, b, c at ``addresses``; a and c push, and once the root's round holds their
    forward (waiting for b's side), ``link`` -- on a's path -- is cut and the one that moves
    (``moved``: its member id and the tier it moves to) joins there; then b pushes. Every
    gradient must be applied once, in version 1."""
    a, b, c = _clients(list(addresses), "abc", {"round_timeout_s": 30})  # bounded: a hang fails the test
    try:
        ga, gb, gc = (np.full(10, g, np.float32) for g in (1.0, 3.0, 4.0))
        rt = tree.tier("root")
        with ThreadPoolExecutor(2) as ex:
            pushed = [ex.submit(a.push, ga), ex.submit(c.push, gc)]
            wait_for(lambda: tree.lt.call(lambda: len(rt.jobs["j"].round.pushed)) == 1, "a forward at the root", 10)
            tree.lt.run(link.close())
            member, tier = moved
            wait_for(lambda: tree.lt.call(lambda: member in tree.tier(tier).jobs["j"].members),
                     f"{member} at {tier}", 30)
            assert b.push(gb)[0] == 1
            assert [p.result(60)[0] for p in pushed] == [1, 1]
        _, root_version, _, root_values = tree.view("root", "j")
        assert root_version == 1
        np.testing.assert_array_equal(root_values, (-LR * (ga + gb + gc) / 3).astype(np.float32))  # each once
        assert tree.lt.call(lambda: rt.jobs["j"].stats.double_applied) == 0
    finally:
        for x in (a, b, c):
            x.close()


def test_a_push_in_flight_when_its_zone_became_unreachable_is_resolved_at_the_root_not_placed_again(tree):
    """a's push is in the root's round (forwarded by za, which waits there for zb) when a loses
    its link to za -- za itself lives on, with c. a moves to its alternate zb and resends the
    same body there: zb would place it as new and the root apply a's gradient twice (once from
    za's forward, once from zb's). a must ask the root first and get the version that applied
    the one za forwarded -- and zb's round must not wait meanwhile for a's push, which is za's
    to bring (the root's round waits for zb: each would wait for the other)."""
    tree.add("root", "global")
    za, zb = tree.add("za", "zone", parent="root"), tree.add("zb", "zone", parent="root")
    link = tree.lt.run(LinkProxy(Link(), za).start())
    _cut_link_mid_round(tree, link, (f"{link.address},{zb}", zb, za), moved=("a", "zb"))


def test_a_forward_in_flight_when_its_parent_became_unreachable_is_resolved_not_placed_again(tree):
    """The relay's form of the test above: za's forward of a's push is in the root's round
    (through r1, which waits there for r2) when za loses its link to r1 -- r1 lives on, with
    zone zc. za moves to its alternate parent r2: it asks the root first instead of forwarding
    a's push again through r2 (applied twice), and r2's round does not wait for za meanwhile."""
    tree.add("root", "global")
    r1, r2 = tree.add("r1", "regional", parent="root"), tree.add("r2", "regional", parent="root")
    link = tree.lt.run(LinkProxy(Link(), r1).start())
    tree.servers["za"] = tree.lt.run(create_server(ServerConfig(role="zone", name="za", parent=f"{link.address},{r2}",
                                                                **FAST)))
    zb, zc = tree.add("zb", "zone", parent="r2"), tree.add("zc", "zone", parent="r1")
    _cut_link_mid_round(tree, link, (tree.addr("za"), zb, zc), moved=("za", "r2"))


def _ask_root(addr: str, key: PushKey) -> tuple[str, int]:
    """The root's answer to a relay asking what became of one push (the Resolve call)."""
    with grpc.insecure_channel(addr) as ch:
        r = stubs(ch)["Resolve"](pb.ResolveRequest(job="j", member="r1", keys=keys_to_pb((key,)), wait_ms=1000),
                                 timeout=10)
    return OUTCOME_NAME[r.outcome], r.version


def test_a_push_applied_before_the_records_the_root_keeps_is_never_answered_not_applied(tree, tmp_path):
    """The root records which pushes its last 1024 versions applied, and a checkpoint the last
    64. Asked about one applied before those (a region whose sync's answer was lost, asking
    after a long outage; a relay asking after a root restart), it answered "not applied", and
    the asker sent it again: applied twice, and not even counted. Now a push number the root
    has dropped the record of is answered as applied at or before the newest version dropped;
    a later number of the same sender is still "not applied"."""
    ckpt = str(tmp_path / "ckpt")
    tree.add("root", "global", checkpoint_dir=ckpt, checkpoint_every=10)
    a, b = _clients([tree.addr("root")] * 2, "ab", mode="async")
    # a's pushes 1 and 3 are applied (versions 1 and 2); its number 2 never is (async: out of order)
    frames = {seq: _frames(a, seq, np.ones(10, np.float32), epoch=a.view.epoch) for seq in (1, 3)}
    with grpc.insecure_channel(tree.addr("root")) as ch:
        assert [stubs(ch)["Push"](iter(frames[seq]), timeout=10).applied_version for seq in (1, 3)] == [1, 2]
    key, hole, third, later = (PushKey("a", a.incarnation, s, push_digest(frames[1 if s != 3 else 3]))
                               for s in (1, 2, 3, 4))
    assert _ask_root(tree.addr("root"), key) == ("applied", 1)
    for s in range(69):
        v, _ = b.push(np.full(10, 0.01, np.float32), clock=s)
        b.pull(min_version=v)
    assert v == 71
    assert _ask_root(tree.addr("root"), key) == ("applied", 1)  # within the live horizon of 1024
    tree.stop("root")  # its last checkpoint (version 71) keeps the records of versions 8..71
    tree.add("root", "global", checkpoint_dir=ckpt, checkpoint_every=10)
    assert tree.view("root", "j")[1] == 71
    # Restored: versions 1 and 2's records are gone (on 1aa3b69 this answered "not_applied", 0).
    assert _ask_root(tree.addr("root"), key) == ("applied", 7)   # at or before version 7
    assert _ask_root(tree.addr("root"), third) == ("applied", 7)
    # Never applied: still "not applied", below a number that was (a review found a first form
    # of this fix, which kept the highest number dropped, answering "applied" for it)
    assert _ask_root(tree.addr("root"), hole) == ("not_applied", 0)
    assert _ask_root(tree.addr("root"), later) == ("not_applied", 0)
    # The same past the live horizon (a long outage): a's record drops out of the book.
    tree.lt.call(lambda: setattr(tree.tier("root").jobs["j"].applied, "horizon", 4))
    c = ParameterClient(tree.addr("root"), "j", "c")
    c.register()
    c.pull()
    for s in range(6):
        v, _ = c.push(np.full(10, 0.01, np.float32), clock=s)
        c.pull(min_version=v)
    assert _ask_root(tree.addr("root"), key) == ("applied", v - 4)
    assert _ask_root(tree.addr("root"), hole) == ("not_applied", 0)
    assert _ask_root(tree.addr("root"), later) == ("not_applied", 0)
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0
    for x in (a, b, c):
        x.close()


def test_a_given_up_forward_whose_push_was_applied_with_another_body_does_not_wedge_its_relay(tree):
    """A zone gave up on a forward holding w's push 1; w asked elsewhere, was told "not
    applied", and its push 1 went up again with another body, applied. When the zone asked the
    root about its forward, the root answered Conflict (that number was applied with another
    body), which the zone passed to every round it forwarded after: wedged (found by a review).
    The forward, applied whole or not at all, was not applied: the zone settles it so."""
    addr, a, b = _setup(tree, through_zone=True)
    for c in (a, b):
        c.pull()
    bsp_rounds([a, b], 1, lambda i, s: np.full(10, 1.0, np.float32))  # a's push 1: applied as version 1
    zone = tree.tier("z")
    other = PushKey("a", a.incarnation, 1, b"x" * 16)  # its number, another body
    tree.lt.call(lambda: zone.unanswered.gave_up("j", 99, (other, PushKey("b", b.incarnation, 7, b"y" * 16))))
    bsp_rounds([a, b], 1, lambda i, s: np.full(10, 1.0, np.float32))  # the zone's next round goes up
    assert tree.view("root", "j")[1] == 2
    assert tree.lt.call(lambda: zone.unanswered.pending("j")) == []
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0


def test_a_round_refused_above_leaves_a_lossy_relays_residual_as_it_was(tree):
    """A zone re-encodes its round's sum with int8 under error feedback: what one forward does
    not carry is owed by the next. A round the root refuses is pushed again whole by the
    workers, so its encode must leave no trace; the zone reset its whole residual instead,
    dropping what earlier applied rounds still owed (found by a review)."""
    tree.add("root", "global")
    tree.add("z", "zone", parent="root")
    a, b = _clients([tree.addr("z")] * 2, "ab", push_codec="int8")
    grad = np.linspace(-1.0, 0.7, 10, dtype=np.float32)  # int8 rounds all but its extremes
    bsp_rounds([a, b], 1, lambda i, s: grad * (i + 1))
    zone, top = tree.tier("z"), tree.tier("root")

    def residual() -> np.ndarray:
        state = tree.lt.call(lambda: zone.jobs["j"].encoder.state_dict())
        return state.get("w@0", np.zeros(10, np.float32)).copy()

    before = residual()
    assert np.abs(before).max() > 0, before
    apply = top._apply_durably
    refused = []

    async def refuse_once(js, agg, rec, keys, step, fut):
        if not refused:
            refused.append(rec.version)  # as a step that made the parameters non-finite is refused
            top._refuse(js, agg, fut, BadInput("refused by the test: nothing was applied"))
            return
        await apply(js, agg, rec, keys, step, fut)

    top._apply_durably = refuse_once
    try:
        with pytest.raises(AssertionError, match="refused by the test"):  # each worker's push: BadInput
            bsp_rounds([a, b], 1, lambda i, s: grad * (i + 1))
        assert refused and np.array_equal(residual(), before), (residual(), before)
    finally:
        top._apply_durably = apply
        for c in (a, b):
            c.close()


def test_a_push_the_root_applied_already_is_answered_from_its_record_whatever_the_relay_forgot(tree):
    """Defence in depth for invariant 4: a zone that restarted remembers nothing of a push it
    forwarded, and a sender that does not ask the root first (an older client, a script using
    the raw protocol) sends it again. In async nothing below the root stops it; the root's
    record of applied pushes now does: the very push is answered with the version that applied
    it, and a push reusing its number with another body is refused."""
    tree.add("root", "global")
    tree.add("z", "zone", parent="root")
    (a,) = _clients([tree.addr("z")], "a", mode="async")
    first = _frames(a, 1, np.ones(10, np.float32), epoch=a.view.epoch)
    with grpc.insecure_channel(tree.addr("z")) as ch:
        assert stubs(ch)["Push"](iter(first), timeout=10).applied_version == 1
    port = tree.servers["z"][1]
    a.close()
    tree.stop("z")
    tree.add("z", "zone", parent="root", listen=f"127.0.0.1:{port}")  # remembers nothing
    with grpc.insecure_channel(tree.addr("z")) as ch:
        rpc = stubs(ch)
        rpc["Register"](pb.RegisterRequest(job="j", member="a", role=pb.ROLE_WORKER, last_seq=0,
                                           incarnation=a.incarnation), timeout=10)
        ack = rpc["Push"](iter(first), timeout=10)  # the very push again, as new at the zone
        assert ack.applied_version == 1 and ack.duplicate, ack
        with pytest.raises(grpc.RpcError) as err:  # its number with another body
            rpc["Push"](iter(_frames(a, 1, np.full(10, 2.0, np.float32), epoch=a.view.epoch)), timeout=10)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value
    assert tree.view("root", "j")[1] == 1
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0


def test_a_resend_asks_the_root_first_only_at_another_incarnation_than_its_earlier_copies(tree):
    """A resend names the tier incarnation its earlier copies went to. The same incarnation's
    own book is authoritative (a push it does not hold was never placed here): placed at once,
    no question to the root -- a round restarted under N workers is not N questions. Another
    incarnation may have passed an earlier copy on: the root is asked, and a push it applied
    is answered from its record, never placed again."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root")
    (a,) = _clients([zone], "a", mode="async")
    z = tree.tier("z")

    def resolved() -> int:
        return tree.lt.call(lambda: z.jobs["j"].stats.resolved)
    with grpc.insecure_channel(zone) as ch:
        rpc = stubs(ch)
        first = _frames(a, 1, np.ones(10, np.float32), epoch=a.view.epoch)
        ack = rpc["Push"](as_resend(first, z.epoch), timeout=10)  # this incarnation's: its book knows
        assert (ack.applied_version, ack.duplicate, resolved()) == (1, False, 0)
        second = _frames(a, 2, np.full(10, 2.0, np.float32), base=1, epoch=a.view.epoch)
        ack = rpc["Push"](as_resend(second, z.epoch ^ 1), timeout=10)  # another's: the root decides
        assert (ack.applied_version, ack.duplicate, resolved()) == (2, False, 1)
    # The root applied 1 and 2; a zone that restarted remembers neither: a resend of 2 from a
    # sender that never noticed is answered with version 2, and nothing is applied again.
    port = tree.servers["z"][1]
    a.close()
    tree.stop("z")
    tree.add("z", "zone", parent="root", listen=f"127.0.0.1:{port}")
    with grpc.insecure_channel(zone) as ch:
        rpc = stubs(ch)
        rpc["Register"](pb.RegisterRequest(job="j", member="a", role=pb.ROLE_WORKER, last_seq=0,
                                           incarnation=a.incarnation), timeout=10)
        ack = rpc["Push"](as_resend(second, z.epoch), timeout=10)
        assert (ack.applied_version, ack.duplicate) == (2, True), ack
    assert tree.view("root", "j")[1] == 2
    assert tree.lt.call(lambda: tree.tier("z").jobs["j"].stats.resolved) == 1
    assert tree.lt.call(lambda: tree.tier("root").jobs["j"].stats.double_applied) == 0


def test_a_lossy_zones_forward_given_up_on_keeps_its_encode_once_the_root_says_it_was_applied(tree):
    """A top-k zone encodes its round's sum s = topk(g + r) and keeps g + r - s as its residual.
    When it gave up on the forward unanswered, it put the residual back to r, as for a forward
    refused: if the root had applied s, the residual owed s a second time, and sent it again
    (error feedback broken: the applied sum drifts). The encode now stands until the root says:
    applied, kept (review)."""
    tree.add("root", "global")
    zone = tree.add("z", "zone", parent="root", round_timeout_s=2.0, up_codec="topk")
    a, b = ParameterClient(zone, "j", "a"), ParameterClient(zone, "j", "b")
    d = ParameterClient(tree.addr("root"), "j", "d", round_timeout_s=20)
    a.create_job(JobConfig(name="j", optimizer=OptimizerConfig(kind="sgd", lr=LR)), LAYOUT,
                 np.zeros(10, np.float32))
    for c in (a, b, d):
        c.register()
        c.pull()
    ga, gb, gd = (np.arange(10, dtype=np.float32) * g for g in (1.0, 2.0, 3.0))
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(a.push, ga), pool.submit(b.push, gb)]:  # the zone gives up after 2 s
            with pytest.raises(TimedOut):
                f.result(30)
        assert d.push(gd)[0] == 1  # the root's round closes, with the zone's forward in it
    assert a.push(ga)[0] == 1  # asked through the zone: applied; the zone's forward is settled
    sent = -3 * tree.view("root", "j")[3] / LR - gd  # what the root applied of the zone's sum
    assert 0 < np.count_nonzero(sent) < 10  # top-k
    residual = tree.lt.call(lambda: tree.tier("z").jobs["j"].encoder.state_dict())
    held = np.concatenate([np.zeros(0, np.float32)] + [v.ravel() for k, v in sorted(residual.items()) if ":" not in k])
    assert held.size == 10, residual  # (taken back to the residual before the round: none)
    np.testing.assert_allclose(held, ga + gb - sent, rtol=1e-5, atol=1e-5)
    for c in (a, b, d):
        c.close()
